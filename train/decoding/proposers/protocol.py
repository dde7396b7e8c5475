"""What the engine's loop asks of a drafting part: the :class:`Proposer` protocol.

A proposer is given the committed sequence and a budget, returns a :class:`~train.decoding.draft.Draft`,
and is told afterwards how much of the sequence is final (:meth:`Proposer.commit`), so it can drop
whatever it cached past that point. It records its own calls and time into the
:class:`~train.decoding.metrics.DecodeStats` it is handed. A proposer that reads the verifier's
hidden states (prediction heads, a steered drafter, EAGLE-3) names the layers in ``hidden_layers`` and
receives them in ``observe``, at every position a verifier forward committed; the others return None and
ignore ``observe``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from train.decoding.draft import Draft
from train.decoding.metrics import DecodeStats
from train.decoding.sampling import SamplingParams

__all__ = ["Proposer"]


class Proposer(Protocol):
    """The drafting part of a decoder."""

    def start(self) -> None:
        """Forget everything: a new ``generate`` begins."""

    def propose(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        """A draft of at most ``budget`` tokens continuing ``sequence`` (prompt + committed tokens)."""
        ...

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        """The first ``length`` tokens of the sequence are final; anything cached past them is stale.
        ``path``: the accepted draft nodes (indices into the last draft), from the top."""

    @property
    def hidden_layers(self) -> tuple[int, ...] | None:
        """Indices into the verifier's ``hidden_states`` this proposer reads (None: none). When set, the
        loop asks the verifier's forward for them and passes their rows at the positions it committed
        to :meth:`observe` after every verification, at no extra forward."""
        ...

    def observe(self, states: torch.Tensor) -> None:
        """The verifier's hidden states (P, len(hidden_layers), hidden) at the P positions the last verifier
        forward fed that are now committed, in order: the context tokens fed (at the prefill, the whole
        prompt), then the accepted draft path's nodes. Called after :meth:`commit`. ``states[-1]`` is the
        position that produced the last committed token (the correction or bonus)."""
