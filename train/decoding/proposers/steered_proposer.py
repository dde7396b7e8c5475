"""Steered drafting (SD^2): a drafter whose MLPs receive biases computed from the verifier's states.

:class:`SteeredProposer` wraps the ordinary :class:`~train.decoding.proposers.model_proposer.ModelProposer`.
After every verifier forward the loop hands it the verifier's hidden states at the position g that produced
the last committed token (the correction or bonus; ``observe``; the same forward, no extra pass); it
projects them once. Which guide steers which drafter position is the rule training uses,
:func:`train.models.steering_module.guide_for`: the latest guide position strictly before it. So the first
block, drafted before any verification, is unsteered; the tokens of a block get the newest guide; and
after a fully accepted block the last draft (at position g itself, which the drafter has not read yet)
keeps the previous guide in the catch-up forward while the bonus token after it gets the new one (one
bias per position there). The steering module is any callable with ``verifier_layers`` (indices into
Hugging Face's ``hidden_states``) whose output (L, d_ff) a handle adds to the drafter's MLPs
(:class:`train.models.steering_module.SteeringModule` and its ``attach``). Verification is unchanged, so
steered decoding is exactly as lossless as plain decoding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from train.decoding.draft import Draft
from train.decoding.metrics import DecodeStats
from train.decoding.proposers.model_proposer import ModelProposer
from train.decoding.sampling import SamplingParams
from train.models.steering_module import guide_for

__all__ = ["SteeredProposer"]


class SteeredProposer:
    """A :class:`ModelProposer` whose drafter is steered by ``steering`` through ``handle``."""

    def __init__(self, base: ModelProposer, steering: Any, handle: Any) -> None:
        self.base, self.steering, self.handle = base, steering, handle
        self.hidden_layers = tuple(int(i) for i in steering.verifier_layers)
        param = next(steering.parameters())
        self._device, self._dtype = param.device, param.dtype
        self._drafter_device = base.drafter.device
        base.before_forward = self._steer
        self._guides: list[int] = []  # guide positions, increasing (pruned to the ones still needed)
        self._deltas: dict[int, torch.Tensor] = {}  # guide position -> its biases (L, d_ff)
        self._observed_at = -1
        self.guide_time = 0.0
        self.guides = 0

    def start(self) -> None:
        self.base.start()
        self.base.before_forward = self._steer
        self.handle.set(None)
        self._guides, self._deltas, self._observed_at = [], {}, -1
        self.guide_time, self.guides = 0.0, 0

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        self.base.commit(length, path)
        # the loop commits up to the last committed token (excluded) and then observes the states of the
        # position that produced it: length - 1
        self._observed_at = length - 1

    def observe(self, states: torch.Tensor) -> None:
        """The verifier's states (P, S, d) at the positions just committed (called by the loop after
        :meth:`commit`, inside ``generate``'s inference mode); the guide reads the last one's (S, d), the
        position that produced the last committed token."""
        start = time.perf_counter()
        states = states[-1]
        if states.device != self._device or states.dtype != self._dtype:
            states = states.to(self._device, self._dtype)
        deltas = self.steering(states)
        if deltas.device != self._drafter_device:
            deltas = deltas.to(self._drafter_device)
        self._guides.append(self._observed_at)
        self._deltas[self._observed_at] = deltas
        # the drafter never again reads positions below its cache: older guides are not needed
        keep = guide_for(self.base._length, self._guides)
        while self._guides[0] < keep:
            del self._deltas[self._guides.pop(0)]
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self.guide_time += time.perf_counter() - start
        self.guides += 1

    def _steer(self, first: int, count: int) -> None:
        """Before a drafter forward over positions first .. first + count - 1: each position gets the
        biases of its guide (:func:`~train.models.steering_module.guide_for`, the rule training uses), none
        before the first guide. A catch-up forward may mix two guides (after a fully accepted block the
        last draft keeps the previous one, the bonus token gets the new one): one bias per position."""
        start = time.perf_counter()
        sources = [guide_for(t, self._guides) for t in range(first, first + count)]
        if all(g == sources[0] for g in sources):
            self.handle.set(self._deltas[sources[0]] if sources[0] >= 0 else None)
        else:
            some = self._deltas[max(sources)]
            rows = [self._deltas[g] if g >= 0 else torch.zeros_like(some) for g in sources]
            self.handle.set(torch.stack(rows)[None])  # (1, count, L, d_ff)
        self.guide_time += time.perf_counter() - start

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
