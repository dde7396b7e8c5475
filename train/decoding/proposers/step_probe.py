"""What a block of drafting costs for a proposer on the verifier's hidden states (:func:`proposer_costs`).

A drafter that reads the verifier's features (EAGLE-3, DFlash, prediction heads) is not a causal LM the
cost probe (:mod:`train.decoding.cost_probe`) can feed tokens to: its step is the proposer's own work
(EAGLE-3: a catch-up forward, then one forward per tree level; DFlash: one forward over the block;
heads: one forward of the heads). So it is timed as the loop runs it: one verifier prefill of a
:data:`~train.decoding.cost_probe.PREFIX_TOKENS`-token prefix gives real hidden states, the proposer
drafts after it once (its own prefill, a warm-up), then ``repeats`` blocks as after plain steps (one
more committed token and its states each), and the seconds per drafter forward of each block
(``stats.drafter_time / stats.drafter_calls``) are taken at their median. Greedy settings; the
proposer is reset afterwards (``start``). The result is cached like every step cost, keyed by the pair
and the draft's shape.
"""

from __future__ import annotations

import statistics

import torch

from train.decoding.cost_probe import (
    MEASURED_TOKENS,
    PREFIX_TOKENS,
    check_costs,
    cost_key,
    random_tokens,
    with_drafter_step,
)
from train.decoding.costs import StepCosts
from train.decoding.metrics import DecodeStats
from train.decoding.model_call import TimedModel
from train.decoding.proposers.protocol import Proposer
from train.decoding.sampling import SamplingParams

__all__ = ["proposer_costs", "proposer_step_seconds"]

_GREEDY = SamplingParams(temperature=0.0)


def proposer_step_seconds(proposer: Proposer, verifier: TimedModel, depth: int, repeats: int = 5) -> float:
    """Measure (no cache): seconds per drafter forward of ``proposer``'s blocks of at most ``depth``
    tokens after a cached prefix (module docstring). The proposer must read hidden states."""
    layers = proposer.hidden_layers
    if not layers:
        raise ValueError("proposer_step_seconds times proposers that read the verifier's hidden states")
    tokens = random_tokens(verifier, PREFIX_TOKENS + repeats + 2)
    with torch.inference_mode():
        out = verifier(tokens, None, logits_to_keep=1, hidden_layers=list(layers))
        assert out.hidden is not None
        states = torch.stack([out.hidden[i] for i in layers], dim=1)  # (T, L, d)
        proposer.start()
        proposer.observe(states[:PREFIX_TOKENS])
        stats = DecodeStats()
        proposer.propose(tokens[: PREFIX_TOKENS + 1], depth, _GREEDY, None, frozenset(), stats)  # warm-up
        per_forward = []
        for step in range(1, repeats + 1):
            committed = PREFIX_TOKENS + step
            proposer.commit(committed)
            proposer.observe(states[committed - 1 : committed])
            calls, seconds = stats.drafter_calls, stats.drafter_time
            proposer.propose(tokens[: committed + 1], depth, _GREEDY, None, frozenset(), stats)
            if stats.drafter_calls > calls:
                per_forward.append((stats.drafter_time - seconds) / (stats.drafter_calls - calls))
        proposer.start()
    if not per_forward:
        raise RuntimeError(f"{type(proposer).__name__} drafted nothing while its step was timed")
    return statistics.median(per_forward)


def proposer_costs(
    verifier: TimedModel,
    proposer: Proposer,
    drafter: torch.nn.Module,
    max_tokens: int,
    depth: int,
    shape: str,
) -> StepCosts:
    """The verifier's checks of 1 .. ``max_tokens`` tokens (:func:`~train.decoding.cost_probe.check_costs`)
    and ``proposer``'s drafter forward (:func:`proposer_step_seconds`), cached per machine, setting, pair
    (``drafter``: the module whose identity keys it) and draft ``shape``."""
    checks = check_costs(verifier, max_tokens)
    key = cost_key(verifier.model, drafter, max(max_tokens, MEASURED_TOKENS), shape=shape)
    return with_drafter_step(checks, key, lambda: proposer_step_seconds(proposer, verifier, depth))
