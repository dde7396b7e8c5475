"""``AsyncSpeculativeDecoder``: a drafter model and the chain rule under the asynchronous schedule, where
overlapping the two models pays."""

from __future__ import annotations

import logging

import torch

from train.decoding.async_loop import AsyncSchedule, run_asynchronous
from train.decoding.async_policy import (
    OVERLAP_CHOICES,
    acceptance_estimate,
    overlap_pays,
    overlapped_speedup,
    synchronous_speedup,
)
from train.decoding.costs import StepCosts
from train.decoding.decoders.base import Decoder
from train.decoding.decoders.speculative import SpeculativeDecoder
from train.decoding.metrics import DecodeResult
from train.decoding.model_call import TimedModel
from train.decoding.overlap_probe import together_costs
from train.decoding.proposers.model_proposer import ModelProposer
from train.decoding.sampling import SamplingParams
from train.renames import renamed_keywords

__all__ = ["AsyncSpeculativeDecoder"]

log = logging.getLogger(__name__)


@renamed_keywords(max_block="gamma")
class AsyncSpeculativeDecoder(Decoder):
    """AMUSD (:mod:`train.decoding.async_loop`): the drafter drafts in its own thread while the verifier
    verifies. Same ``generate`` as the other decoders; lossless at every temperature.

    gamma: most drafts one verification takes; max_ahead: most drafts published ahead of the
    verified sequence; min_ahead: drafts needed before verifying them, or ``"auto"``: per block, the
    count that maximises expected tokens per second under the acceptance, drafter step and verifier
    cost measured so far in the generation (:mod:`train.decoding.async_policy`; with ``idle="step"``
    among the drafts ready, none meaning a step alone); idle: ``step`` (an autoregressive
    verifier step when fewer are ready) or ``wait``; pin_cores: (verifier core, drafter core) on a CPU.
    Put the two models on two devices (``cuda:0`` / ``cuda:1``) to run them on two GPUs.

    overlap: ``"auto"`` (the default): before each generation, whether overlapping pays on this machine
    (:func:`~train.decoding.async_policy.overlap_pays`), from the pair's step costs measured alone and
    with both models computing at once (each measured once per machine and setting,
    :mod:`train.decoding.overlap_probe`) and the acceptance of the generations so far; where it does not,
    the generation runs synchronously, a chain of up to ``gamma`` drafts of cost-chosen length
    (``SpeculativeDecoder(draft_length="cost")``). Lossless either way: which schedule runs never depends
    on this generation's draws. ``"always"``: the asynchronous schedule whatever it costs.
    """

    def __init__(
        self,
        verifier: torch.nn.Module,
        drafter: torch.nn.Module,
        gamma: int = 8,
        max_ahead: int = 8,
        min_ahead: int | str = 1,
        idle: str = "step",
        pin_cores: tuple[int, int] | list[int] | None = None,
        overlap: str = "auto",
    ) -> None:
        if overlap not in OVERLAP_CHOICES:
            raise ValueError(f"overlap must be one of {list(OVERLAP_CHOICES)}, got {overlap!r}")
        self.verifier, self.drafter = verifier, drafter
        #: The schedule's settings, validated there.
        self.schedule = AsyncSchedule(
            gamma,
            max_ahead,
            min_ahead,
            idle,
            None if pin_cores is None else tuple(pin_cores),  # type: ignore[arg-type]
        )
        self.overlap = overlap
        self._verifier = TimedModel(verifier)
        self._drafter = TimedModel(drafter)
        self.vocab_size = self._verifier.vocab_size
        #: Where overlapping does not pay (``overlap="auto"``): a synchronous chain of cost-chosen length.
        self.synchronous = None
        if overlap == "auto":
            self.synchronous = SpeculativeDecoder(verifier, drafter, gamma=gamma, draft_length="cost")
        self._accepted = self._tested = 0
        self._overlapping: bool | None = None
        #: The pair's step costs alone and with both models computing at once, measured at the first call.
        self._costs: tuple[StepCosts, StepCosts] | None = None

    def models(self) -> tuple[torch.nn.Module, ...]:
        return (self.verifier, self.drafter)

    @property
    def step_costs(self) -> StepCosts | None:
        """The pair's step costs measured alone (None before the first generation, or with
        ``overlap="always"``)."""
        return self.synchronous.step_costs if self.synchronous is not None else None

    def overlaps(self) -> bool:
        """Whether the next generation runs the asynchronous schedule (class docstring)."""
        if self.synchronous is None:
            return True
        cap = self.schedule.gamma
        if self._costs is None:  # once per decoder: a cost key reads the processor and hashes the pair
            alone = self.synchronous.measure_costs()
            self.synchronous.length.costs = alone  # type: ignore[union-attr]
            together = together_costs(self._verifier, self._drafter, cap + 1, self.schedule.pin_cores)
            self._costs = (alone, together)
        alone, together = self._costs
        acceptance = acceptance_estimate(self._accepted, self._tested)
        pays = overlap_pays(acceptance, together, alone, cap)
        if pays != self._overlapping:
            log.info(
                "Asynchronous decoder: %s (acceptance %.2f; expected speedup overlapped %.2fx, "
                "synchronous %.2fx)",
                "overlapping the two models" if pays else "synchronous, overlap does not pay here",
                acceptance,
                overlapped_speedup(acceptance, together, alone, cap)[1],
                synchronous_speedup(acceptance, alone, cap)[1],
            )
        self._overlapping = pays
        return pays

    def decode(
        self,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        eos: frozenset[int],
        generator: torch.Generator | None,
    ) -> DecodeResult:
        if self.overlaps():
            proposer = ModelProposer(self._drafter, self.vocab_size)  # one per call: its own cache
            result = run_asynchronous(
                self._verifier, proposer, prompt, max_new_tokens, params, eos, generator, self.schedule
            )
        else:
            assert self.synchronous is not None
            result = self.synchronous.decode(prompt, max_new_tokens, params, eos, generator)
        self._accepted += result.stats.accepted
        self._tested += result.stats.tested
        return result
