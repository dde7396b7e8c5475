"""One proposer, and another where the first proposes nothing (:class:`FallbackProposer`).

The engine's hybrid of a free drafter and a model: prompt lookup
(:class:`~train.decoding.proposers.lookup_proposer.PromptLookupProposer`) first, the drafter model where
the sequence offers nothing to copy. Each block has one proposer's draft, so the verification rules
and the loop see an ordinary chain; the draft is a function of the committed sequence (and of the
drafter's own randomness), so the output law stays the verifier's.

Both proposers hear every ``start`` and ``commit``: the model proposer crops its cache to the
committed length even in blocks it did not draft, and on its next block feeds, in one call, the
committed tokens it has not seen (a copied draft's accepted tokens among them). A second proposer
that reads the verifier's hidden states (a steered drafter) gets them after every block, whoever
drafted it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from train.decoding.draft import Draft
from train.decoding.metrics import DecodeStats
from train.decoding.proposers.protocol import Proposer
from train.decoding.sampling import SamplingParams

__all__ = ["FallbackProposer"]


class FallbackProposer:
    """``first``'s draft when it proposes one, else ``second``'s of at most ``second_budget`` tokens."""

    def __init__(self, first: Proposer, second: Proposer, second_budget: int) -> None:
        if first.hidden_layers:
            raise ValueError("FallbackProposer: the first proposer must read no verifier hidden states")
        if isinstance(second_budget, bool) or not isinstance(second_budget, int) or second_budget < 1:
            raise ValueError(f"second_budget must be an integer >= 1, got {second_budget!r}")
        self.first = first
        self.second = second
        self.second_budget = second_budget

    @property
    def hidden_layers(self) -> tuple[int, ...] | None:
        """The second proposer's (a steered drafter reads the verifier's states after every block)."""
        return self.second.hidden_layers

    def start(self) -> None:
        self.first.start()
        self.second.start()

    def propose(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        draft = self.first.propose(sequence, budget, params, generator, eos, stats)
        if len(draft):
            return draft
        return self.second.propose(sequence, min(budget, self.second_budget), params, generator, eos, stats)

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        self.first.commit(length, path)
        self.second.commit(length, path)

    def observe(self, states: torch.Tensor) -> None:
        self.second.observe(states)
