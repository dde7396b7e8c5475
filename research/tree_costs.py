"""What a tree costs, beside the evaluator's figures (``scripts/trees.py``, docs/trees.md): the verifier's
time per call against the tree tokens it scores, how often SpecInfer's i.i.d. siblings repeat a token, and
each tree decoder's loop overhead on the random-weight benchmark pair."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from research.pairs import random_pair, random_prompts
from train.decoding import (
    DecodeStats,
    SamplingParams,
    SpeculativeDecoder,
    TimedModel,
    TreeSpeculativeDecoder,
    keep_positions,
    loop_overhead,
)
from train.decoding.proposers.tree_proposers import TreeProposer
from train.decoding.tree_attention import tree_attention_mask, tree_position_ids
from train.models.draft_vocab import with_draft_vocab
from train.tables import markdown_table


@torch.inference_mode()
def verifier_cost(verifier: Any, prefix_len: int = 64, reps: int = 15) -> str:
    """The verifier's median time for one forward over a binary tree of n tokens after a cached prefix."""
    timed = TimedModel(verifier)
    prefix = list(range(3, 3 + prefix_len))
    base = timed(prefix, None, logits_to_keep=1).cache
    rows, first = [], None
    for n in (1, 4, 8, 16, 32, 64):
        parents = [(i - 1) // 2 for i in range(n)]  # a binary tree, level by level
        depths = [(i + 1).bit_length() for i in range(n)]  # node i's depth in that tree (the root's: 1)
        tokens = [5 + (i % 50) for i in range(n)]
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            out = timed(
                tokens,
                base,
                position_ids=tree_position_ids(prefix_len, 0, depths),
                attention_mask=tree_attention_mask(prefix_len, 0, parents, timed.mask_dtype),
                logits_to_keep=n,
            )
            times.append(time.perf_counter() - start)
            keep_positions(out.cache, list(range(prefix_len)))
        ms = statistics.median(times) * 1000
        first = first or ms
        rows.append([str(n), f"{ms:.2f}", f"{ms / first:.2f}"])
    return markdown_table(
        ["tree tokens per call", "verifier ms per call (median)", "x one token"], rows, "rrr"
    )


@torch.inference_mode()
def sibling_duplicate_rate(
    drafter: Any, prompts: list[torch.Tensor], branching: tuple[int, ...] = (2, 2, 1)
) -> str:
    """How often SpecInfer's i.i.d. siblings repeat a token at T = 1 (what RSD's sampling without
    replacement avoids): each prompt cut at up to 6 points (its last 24 tokens), a tree per cut."""
    drafting = TimedModel(with_draft_vocab(drafter))  # as the evaluator drafts: over config.draft_vocab
    proposer = TreeProposer(drafting, drafter.config.vocab_size, "specinfer", branching=branching)
    stats = DecodeStats()
    generator = torch.Generator().manual_seed(0)
    pairs = same = cuts = 0
    for ids in prompts:
        seq = ids[0].tolist()
        for cut in range(max(len(seq) - 24, 1), len(seq), 4):
            cuts += 1
            proposer.start()
            draft = proposer.propose(
                seq[:cut], len(branching), SamplingParams(1.0), generator, frozenset(), stats
            )
            for node in [-1, *range(len(draft))]:
                kids = [draft.tokens[c] for c in draft.children(node)]
                pairs += len(kids) * (len(kids) - 1) // 2
                same += sum(a == b for i, a in enumerate(kids) for b in kids[i + 1 :])
    return (
        f"SpecInfer {list(branching)} at T = 1 drew the same token for {same} of {pairs} sibling pairs "
        f"({same / max(pairs, 1):.1%}; {len(prompts)} prompts, {cuts} cuts)."
    )


@torch.inference_mode()
def bench_pair_overhead(
    prompts: int = 3, new_tokens: int = 96, devices: tuple[Any, Any] = ("cpu", "cpu")
) -> str:
    """Loop overhead (wall / model forward time - 1) of each decoder on the benchmark pair of
    ``scripts/bench.py decoding`` (random-weight Llama, 33.7M / 2.6M parameters, sharing a bigram
    component so acceptance is realistic), where a verifier forward costs several milliseconds;
    ``devices``: the verifier's and the drafter's."""
    verifier, drafter = random_pair()
    verifier.to(devices[0])
    drafter.to(devices[1])
    inputs = random_prompts(prompts)
    decoders = {
        "sd@g3": SpeculativeDecoder(verifier, drafter, gamma=3),
        "specinfer [2, 2, 1]": TreeSpeculativeDecoder(verifier, drafter, "specinfer", branching=(2, 2, 1)),
        "rsd_c [2, 2, 1]": TreeSpeculativeDecoder(verifier, drafter, "rsd_c", branching=(2, 2, 1)),
        "rsd_s d3 w3": TreeSpeculativeDecoder(verifier, drafter, "rsd_s", depth=3, beam_width=3),
    }
    rows = []
    for name, decoder in decoders.items():
        for t in (0.0, 1.0):
            params = SamplingParams(temperature=t)
            decoder.generate(inputs[0], 8, params, generator=torch.Generator().manual_seed(0))  # warm-up
            overheads, taus = [], []
            for i, ids in enumerate(inputs):
                res = decoder.generate(ids, new_tokens, params, generator=torch.Generator().manual_seed(i))
                overheads.append(loop_overhead(res.stats))
                taus.append(res.stats.new_tokens / res.stats.verifier_calls)
            rows.append(
                [name, f"{t:g}", f"{statistics.mean(taus):.2f}", f"{100 * statistics.mean(overheads):.1f}%"]
            )
    return markdown_table(["decoder", "T", "block efficiency", "loop overhead"], rows, "llrr")
