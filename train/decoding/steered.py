"""Steered drafting (SD^2): a drafter whose MLPs receive biases computed from the verifier's states.

:class:`SteeredProposer` wraps the ordinary :class:`~train.decoding.proposers.ModelProposer`. After
every verifier forward the loop hands it the verifier's hidden states at the position that produced
the correction or bonus token (``observe``; the same forward, no extra pass); it projects them once
with the steering module and holds the resulting biases for the whole next block. The first block,
before any verification, is drafted unsteered. The steering module is any callable with
``verifier_layers`` (indices into Hugging Face's ``hidden_states``) whose output (L, d_ff) a handle
adds to the drafter's MLPs (:class:`train.models.steering.SteeringModule` and its ``attach``).
Verification is unchanged, so steered decoding is exactly as lossless as plain decoding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from .draft import Draft
from .metrics import DecodeStats
from .proposers import ModelProposer
from .sampling import SamplingParams

__all__ = ["SteeredProposer"]


class SteeredProposer:
    """A :class:`ModelProposer` whose drafter is steered by ``steering`` through ``handle``."""

    def __init__(self, base: ModelProposer, steering: Any, handle: Any) -> None:
        self.base, self.steering, self.handle = base, steering, handle
        self.hidden_layers = tuple(int(i) for i in steering.verifier_layers)
        param = next(steering.parameters())
        self._device, self._dtype = param.device, param.dtype
        self._drafter_device = base.drafter.device
        self.guide_time = 0.0
        self.guides = 0

    def start(self) -> None:
        self.base.start()
        self.handle.set(None)
        self.guide_time, self.guides = 0.0, 0

    def observe(self, states: torch.Tensor) -> None:
        """The verifier's states (S, d) at the position that produced the last committed token (called
        by the loop inside ``generate``'s inference mode)."""
        start = time.perf_counter()
        if states.device != self._device or states.dtype != self._dtype:
            states = states.to(self._device, self._dtype)
        deltas = self.steering(states)
        if deltas.device != self._drafter_device:
            deltas = deltas.to(self._drafter_device)
        self.handle.set(deltas)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self.guide_time += time.perf_counter() - start
        self.guides += 1

    def propose(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        return self.base.propose(sequence, budget, params, generator, eos, stats)

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        self.base.commit(length, path)
