"""The synchronous schedule: propose -> verify -> accept -> commit, block after block.

One block (docs/decoding.md)::

    draft   = proposer.propose(sequence, budget)               # up to max_draft tokens (0: plain decoding)
    logits  = verifier(uncached committed tokens + draft)      # ONE forward over a cached prefix
    verdict = rule.verify(logits, draft)                       # pure: chain rule, tree walk, typical
    commit path + [next]; crop both caches to the accepted prefix

Cache invariants (batch size 1): the verifier cache holds every committed token except the last one,
so the first block's verifier forward is the prompt prefill and a block costs exactly one verifier
call; on rejection both caches are cropped back to the accepted prefix; nothing is re-encoded. The
draft budget of a block is ``min(max_draft, tokens still allowed - 1)`` (as in Hugging Face assisted
generation), so a block never overshoots ``max_new_tokens``; this changes no output distribution.
An accepted EOS ends generation without a bonus token. With no proposer (``max_draft == 0``) the same loop
is plain autoregressive decoding. Scoring, committing and the cache bookkeeping are the block step both
schedules share (:mod:`train.decoding.block_step`); this loop adds the proposer's side.

A tree draft (:mod:`train.decoding.tree_attention`) goes through the same block: the verifier scores
every node in one forward with a tree mask, the rule walks it
(:func:`~train.decoding.rules.tree_walk.verify_tree`), and both caches keep the committed prefix plus the
accepted path, compacted (``keep_positions``). ``max_draft`` is then the tree's depth (a chain's is its
gamma). A proposer with ``hidden_layers`` (prediction heads, a steered drafter, EAGLE-3) gets those
layers' hidden states at every position a verifier forward fed and committed (``observe``: the context
tokens, then the accepted path's nodes, in order; at the prefill the whole prompt), at no extra forward;
nothing is gathered when ``hidden_layers`` is unset.

The asynchronous schedule (AMUSD) replaces this loop and reuses the proposers and rules unchanged.
"""

from __future__ import annotations

import time

import torch

from train.decoding.block_step import VerifierCache, settle_block
from train.decoding.draft import Draft
from train.decoding.metrics import DecodeResult, DecodeStats
from train.decoding.model_call import CallResult, TimedModel
from train.decoding.proposers.protocol import Proposer
from train.decoding.rules.rejection import LOSSLESS
from train.decoding.rules.verdict import VerificationRule
from train.decoding.sampling import SamplingParams

__all__ = ["run_synchronous"]

_EMPTY = Draft()


# more than 8 parameters: a decode request (prompt, max_new_tokens, params, eos, generator) and the
# schedule's parts
def run_synchronous(
    verifier: TimedModel,
    proposer: Proposer | None,
    prompt: list[int],
    max_new_tokens: int,
    max_draft: int,
    params: SamplingParams,
    eos: frozenset[int],
    generator: torch.Generator | None,
    rule: VerificationRule = LOSSLESS,
) -> DecodeResult:
    """Decode up to ``max_new_tokens`` after ``prompt``; see the module docstring. ``rule``: how a draft is
    verified, with its settings (default: lossless rejection sampling)."""
    t_start = time.perf_counter()
    stats = DecodeStats(max_draft=max_draft if proposer is not None else 0)
    seq = list(prompt)
    limit = len(prompt) + max_new_tokens
    scored = VerifierCache(verifier, stats)
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
        out = scored.score(seq, draft, layers)
        verdict = rule.verify(out.logits, draft, params, generator, eos)
        settled = settle_block(stats, draft, verdict, eos, limit - n_seq)
        seq.extend(settled.tokens)
        if proposer is not None:  # the last block too: a gate or a calibration records every block it drafted
            proposer.commit(n_seq + verdict.accepted, verdict.path)
        done = settled.done
        if done:
            break
        scored.keep(n_seq, draft, verdict.path)
        if proposer is not None and layers and out.hidden is not None:
            proposer.observe(_committed_states(out, layers, scored.context_length, verdict.path))
    stats.new_tokens = len(seq) - len(prompt)
    stats.wall_time = time.perf_counter() - t_start
    return DecodeResult(torch.tensor(seq[len(prompt) :], dtype=torch.long), stats)


def _committed_states(out: CallResult, layers: list[int], context: int, path: list[int]) -> torch.Tensor:
    """The hidden states (P, L, d) of the positions a forward fed and the block committed: the
    ``context`` tokens, then the accepted path's nodes, in order."""
    assert out.hidden is not None
    fed = [*range(context), *(context + i for i in path)]
    rows = torch.tensor(fed, device=out.hidden[layers[0]].device)
    return torch.stack([out.hidden[i].index_select(0, rows) for i in layers], dim=1)
