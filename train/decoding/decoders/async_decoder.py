"""``AsyncSpeculativeDecoder``: a drafter model and the chain rule under the asynchronous schedule."""

from __future__ import annotations

import torch

from train.decoding.async_loop import AsyncSchedule, run_asynchronous
from train.decoding.decoders.base import Decoder
from train.decoding.metrics import DecodeResult
from train.decoding.model_call import TimedModel
from train.decoding.proposers.model_proposer import ModelProposer
from train.decoding.sampling import SamplingParams

__all__ = ["AsyncSpeculativeDecoder"]


class AsyncSpeculativeDecoder(Decoder):
    """AMUSD (:mod:`train.decoding.async_loop`): the drafter drafts in its own thread while the verifier
    verifies. Same ``generate`` as the other decoders; lossless at every temperature.

    max_block: most drafts one verification takes; max_ahead: most drafts published ahead of the
    verified sequence; min_ahead: drafts needed before verifying them, or ``"auto"``: per block, the
    count that maximises expected tokens per second under the acceptance, drafter step and verifier
    cost measured so far in the generation (:mod:`train.decoding.async_policy`; with ``idle="step"``
    among the drafts ready, none meaning a step alone); idle: ``step`` (an autoregressive
    verifier step when fewer are ready) or ``wait``; pin_cores: (verifier core, drafter core) on a CPU.
    Put the two models on two devices (``cuda:0`` / ``cuda:1``) to run them on two GPUs.
    """

    def __init__(
        self,
        verifier: torch.nn.Module,
        drafter: torch.nn.Module,
        max_block: int = 8,
        max_ahead: int = 8,
        min_ahead: int | str = 1,
        idle: str = "step",
        pin_cores: tuple[int, int] | list[int] | None = None,
    ) -> None:
        self.verifier, self.drafter = verifier, drafter
        #: The schedule's settings, validated there.
        self.schedule = AsyncSchedule(
            max_block,
            max_ahead,
            min_ahead,
            idle,
            None if pin_cores is None else tuple(pin_cores),  # type: ignore[arg-type]
        )
        self._verifier = TimedModel(verifier)
        self._drafter = TimedModel(drafter)
        self.vocab_size = self._verifier.vocab_size

    def models(self) -> tuple[torch.nn.Module, ...]:
        return (self.verifier, self.drafter)

    def decode(
        self,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        eos: frozenset[int],
        generator: torch.Generator | None,
    ) -> DecodeResult:
        proposer = ModelProposer(self._drafter, self.vocab_size)  # one per call: its own cache
        return run_asynchronous(
            self._verifier, proposer, prompt, max_new_tokens, params, eos, generator, self.schedule
        )
