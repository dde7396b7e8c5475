"""Autoregressive baseline decoder: one verifier forward per new token, with a KV cache.

The synchronous schedule with no proposer (:func:`train.decoding.loop.run_synchronous` at gamma 0):
the same model call, the same sampling and the same statistics as the speculative decoders, so the
two are timed and compared like for like.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from train.decoding.decoders.base import Decoder
from train.decoding.loop import run_synchronous
from train.decoding.metrics import DecodeResult
from train.decoding.model_call import TimedModel
from train.decoding.sampling import SamplingParams


class AutoregressiveDecoder(Decoder):
    """Plain decoding of ``model`` (any Hugging Face causal LM with a cache).

    ``stats.verifier_calls`` counts forward passes (the prompt prefill included), ``drafted`` is 0.
    """

    accepts: ClassVar[tuple[str, ...]] = ()  # no drafter

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._model = TimedModel(model)
        self.vocab_size = self._model.vocab_size

    def models(self) -> tuple[torch.nn.Module, ...]:
        return (self.model,)

    def decode(
        self,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        eos: frozenset[int],
        generator: torch.Generator | None,
    ) -> DecodeResult:
        return run_synchronous(self._model, None, prompt, max_new_tokens, 0, params, eos, generator)
