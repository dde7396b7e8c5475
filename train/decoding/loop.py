"""The synchronous schedule: propose -> verify -> accept -> commit, block after block.

One block (docs/decoding.md)::

    draft  = proposer.propose(sequence, budget)                # up to max_draft tokens (0: plain decoding)
    logits = verifier(uncached committed tokens + draft)       # ONE forward over a cached prefix
    n, next = rule(verifier distributions, draft)              # pure: greedy_chain / chain_rejection
    commit draft[:n] + [next]; crop both caches to the accepted prefix

Cache invariants (batch size 1): the verifier cache holds every committed token except the last one,
so the first block's verifier forward is the prompt prefill and a block costs exactly one verifier
call; on rejection both caches are cropped back to the accepted prefix; nothing is re-encoded. The
draft budget of a block is ``min(max_draft, tokens still allowed - 1)`` (as in Hugging Face assisted
generation), so a block never overshoots ``max_new_tokens``; this changes no output distribution.
An accepted EOS ends generation without a bonus token. With no proposer (``max_draft == 0``) the same loop
is plain autoregressive decoding.

A tree draft (:mod:`train.decoding.tree_attention`) goes through the same block: the verifier scores
every node in one forward with a tree mask, :func:`~train.decoding.rules.tree_walk.verify_tree` walks it,
and both caches keep the committed prefix plus the accepted path, compacted (``keep_positions``).
``max_draft`` is then the tree's depth (a chain's is its gamma). A proposer with ``hidden_layers``
(prediction heads, a steered drafter, EAGLE-3) gets those layers' hidden states at every position
a verifier forward fed and committed (``observe``: the context tokens, then the accepted path's nodes,
in order; at the prefill the whole prompt), at no extra forward; nothing is gathered when
``hidden_layers`` is unset.

The asynchronous schedule (AMUSD) replaces this loop and reuses the proposers and rules unchanged.
"""

from __future__ import annotations

import time

import torch

from train.decoding.cache import crop_cache, keep_positions
from train.decoding.draft import Draft
from train.decoding.metrics import DecodeResult, DecodeStats
from train.decoding.model_call import TimedModel
from train.decoding.proposers.protocol import Proposer
from train.decoding.rules.chain import verify_chain
from train.decoding.rules.tree_walk import verify_tree
from train.decoding.rules.typical import TypicalAcceptance, verify_typical
from train.decoding.sampling import (
    SamplingParams,
)
from train.decoding.tree_attention import tree_attention_mask, tree_position_ids

__all__ = ["run_synchronous"]

_EMPTY = Draft()


def run_synchronous(
    verifier: TimedModel,
    proposer: Proposer | None,
    prompt: list[int],
    max_new_tokens: int,
    max_draft: int,
    params: SamplingParams,
    eos: frozenset[int],
    generator: torch.Generator | None,
    lenience: str | None = None,
    eps: float = 1.0,
    typical: TypicalAcceptance | None = None,
) -> DecodeResult:
    """Decode up to ``max_new_tokens`` after ``prompt``; see the module docstring. ``typical``: Medusa's
    lossy typical acceptance for every draft at T > 0 (:mod:`train.decoding.rules.typical`)."""
    t_start = time.perf_counter()
    stats = DecodeStats(max_draft=max_draft if proposer is not None else 0)
    seq = list(prompt)
    limit = len(prompt) + max_new_tokens
    v_cache = None
    v_len = 0
    # A proposer that drafts from the verifier's own hidden states (prediction heads, steering) names
    # the layers (indices into Hugging Face's hidden_states) it reads.
    hidden_layers = proposer.hidden_layers if proposer is not None else None
    layers = list(hidden_layers) if hidden_layers else None
    if proposer is not None:
        proposer.start()
    done = max_new_tokens == 0
    while not done:
        n_seq = len(seq)
        draft = _EMPTY
        if proposer is not None:
            budget = min(max_draft, limit - n_seq - 1)
            if budget > 0:
                draft = proposer.propose(seq, budget, params, generator, eos, stats)
        k = len(draft)
        tree = k > 1 and not draft.is_chain
        # ---- verify: one forward over the uncached committed token(s) and the drafts
        context = seq[v_len:]
        feed = context + draft.tokens
        if tree:
            depths = draft.depths()
            out = verifier(
                feed,
                v_cache,
                position_ids=tree_position_ids(v_len, len(context), depths),
                attention_mask=tree_attention_mask(v_len, len(context), draft.parents, verifier.mask_dtype),
                logits_to_keep=k + 1,
                hidden_layers=layers,
            )
        else:
            out = verifier(feed, v_cache, logits_to_keep=k + 1, hidden_layers=layers)
        if v_cache is None:
            stats.verifier_prefill_calls += 1
            stats.verifier_prefill_time += out.seconds
        v_cache = out.cache
        v_len += len(feed)
        stats.verifier_calls += 1
        stats.verifier_time += out.seconds
        stats.verifier_tokens += k + 1
        if k and typical is not None and not params.greedy:
            tv = verify_typical(out.logits, draft, params, generator, eos, typical)
            path, next_token, tested, expected = tv.path, tv.next, tv.tested, tv.expected
            drafted = max(draft.depths())
        elif tree:  # (k + 1, V): after the context, after each node
            tv = verify_tree(out.logits, draft, params, generator, eos)
            path, next_token, tested, expected = tv.path, tv.next, tv.tested, tv.expected
            drafted = max(depths)
        else:
            verdict = verify_chain(out.logits, draft, params, generator, lenience, eps)
            path, tested, expected, drafted = (
                list(range(verdict.accepted)),
                verdict.tested,
                verdict.expected,
                k,
            )
            next_token = None if (verdict.accepted == k and k and draft.tokens[-1] in eos) else verdict.next
        n = len(path)
        # ---- bookkeeping (a tree counts its depth as drafted positions; its other nodes are discarded)
        if k:
            stats.drafted += drafted
            stats.accepted += n
            stats.tested += tested
            stats.sum_expected_acceptance += expected
            stats.count_depths(drafted, tested, n)
            stats.discarded += k - n if tree else k - tested
            if n < drafted:
                stats.rollbacks += 1
        new = [draft.tokens[i] for i in path]
        if next_token is not None:  # None: an accepted EOS, which gets no bonus token
            new.append(next_token)
        for j, x in enumerate(new):
            if x in eos:
                new = new[: j + 1]
                done = True
                break
        room = limit - n_seq
        if len(new) >= room:
            new = new[:room]
            done = True
        seq.extend(new)
        if done:
            break
        # ---- keep the accepted prefix in both caches (the last emitted token stays uncached)
        keep = n_seq + n
        if tree:
            v_len = keep_positions(v_cache, [*range(n_seq), *(n_seq + i for i in path)], v_len)
        elif v_len > keep:
            crop_cache(v_cache, keep, v_len)
            v_len = keep
        if proposer is not None:
            proposer.commit(keep, path)
            if layers and out.hidden is not None:  # the committed positions of this forward: (P, L, d)
                fed = [*range(len(context)), *(len(context) + i for i in path)]
                rows = torch.tensor(fed, device=out.hidden[layers[0]].device)
                proposer.observe(torch.stack([out.hidden[i].index_select(0, rows) for i in layers], dim=1))
    stats.new_tokens = len(seq) - len(prompt)
    stats.wall_time = time.perf_counter() - t_start
    return DecodeResult(torch.tensor(seq[len(prompt) :], dtype=torch.long), stats)
