"""A proposer behind a :class:`~train.decoding.draft_gate.DraftGate`: the inner proposer's draft in
blocks the gate lets draft, no draft (a plain verifier step) in the others, or, where the decoder gives
a *fallback* (a cheaper draft of the same drafter: a tree's chain, its length chosen by cost), the
fallback's draft in the others.

With a fallback the gate weighs the inner shape against the fallback's own measured rate as well as
a plain step's, and tries the fallback now and then where the shape holds
(:meth:`~train.decoding.draft_gate.DraftGate.choose`).

The inner proposer hears every ``start``, ``commit`` and ``observe``, drafted block or not, as behind
:class:`~train.decoding.proposers.fallback_proposer.FallbackProposer`: a model proposer crops its cache
to the committed length and feeds what it has not seen at its next draft. A drafted block is recorded
at its ``commit``: the accepted path plus the correction or bonus token, at the cost of its checked
tokens and the drafter forwards it ran (``stats.drafter_calls`` before and after); a block whose drafter
ran but drafted nothing (a DFlash chain cut to nothing by cost) is recorded too, one token for a plain
step and the forward. A block that ends the
generation is never committed, so it is not recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from train.decoding.costs import StepCosts
from train.decoding.draft import Draft
from train.decoding.draft_gate import FALLBACK, DraftGate
from train.decoding.length_policy import regime
from train.decoding.metrics import DecodeStats
from train.decoding.proposers.protocol import Proposer
from train.decoding.sampling import SamplingParams

__all__ = ["GatedProposer", "behind_gate", "capped"]

_EMPTY = Draft()

#: A proposer's ``propose``: (sequence, budget, params, generator, eos, stats) -> Draft.
Propose = Callable[
    [list[int], int, SamplingParams, torch.Generator | None, frozenset[int], DecodeStats], Draft
]


class GatedProposer:
    """``inner``'s draft where ``gate`` says drafting pays, else ``fallback``'s (None: none)."""

    def __init__(self, inner: Proposer, gate: DraftGate, fallback: Propose | None = None) -> None:
        self.inner = inner
        self.gate = gate
        self.fallback = fallback
        #: (regime, cost, whether the fallback drafted it) of the last block, until its commit records it.
        self._pending: tuple[object, float, bool] | None = None

    @property
    def hidden_layers(self) -> tuple[int, ...] | None:
        return self.inner.hidden_layers

    def start(self) -> None:
        self._pending = None
        self.inner.start()

    def propose(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        self._pending = None
        key = regime(params)
        choice = self.gate.choose(key, self.fallback is not None)
        if choice is None:
            return _EMPTY
        fallen = choice == FALLBACK
        propose = self.fallback if fallen and self.fallback is not None else self.inner.propose
        calls = stats.drafter_calls
        draft = propose(sequence, budget, params, generator, eos, stats)
        if draft.tokens or stats.drafter_calls > calls or fallen:  # a drafter that ran for nothing cost too
            seconds = self.gate.block_seconds(len(draft.tokens), stats.drafter_calls - calls)
            self._pending = (key, seconds, fallen)
        return draft

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        if self._pending is not None:
            key, seconds, fallen = self._pending
            if fallen:
                self.gate.record_fallback(key, len(path or ()) + 1, seconds)
            else:
                self.gate.record(key, len(path or ()) + 1, seconds)
            self._pending = None
        self.inner.commit(length, path)

    def observe(self, states: torch.Tensor) -> None:
        self.inner.observe(states)


def behind_gate(
    proposer: Proposer,
    gate: DraftGate | None,
    measure_costs: Callable[[], StepCosts],
    fallback: Propose | None = None,
) -> Proposer:
    """``proposer`` behind ``gate`` (itself when there is none), the gate's costs measured by
    ``measure_costs`` the first time they are needed, ``fallback`` drafting where the gate refuses
    (None: a plain step): what a decoder with ``plain_steps`` drafts with."""
    if gate is None:
        return proposer
    if gate.costs is None:
        gate.costs = measure_costs()
    return GatedProposer(proposer, gate, fallback)


def capped(propose: Propose, most: int) -> Propose:
    """``propose`` drafting at most ``most`` tokens whatever the block's budget: a tree's fallback chain of
    ``fallback_gamma`` drafts, where the loop's budget is the longer of the tree's depth and that chain."""

    def propose_capped(sequence: list[int], budget: int, *rest: Any) -> Draft:
        return propose(sequence, min(budget, most), *rest)

    return propose_capped
