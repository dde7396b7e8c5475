"""Autoregressive baseline decoder: one verifier forward per new token, with a KV cache.

The synchronous schedule with no proposer (:func:`train.decoding.loop.run_synchronous` at gamma 0):
the same model call, the same sampling and the same statistics as the speculative decoders, so the
two are timed and compared like for like.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._common import eos_set, validate_request
from .loop import run_synchronous
from .metrics import DecodeResult
from .model_call import TimedModel
from .sampling import SamplingParams

_DEFAULT_PARAMS = SamplingParams()


class AutoregressiveDecoder:
    """Plain decoding of ``model`` (any Hugging Face causal LM with a cache).

    ``stats.verifier_calls`` counts forward passes (the prompt prefill included), ``drafted`` is 0.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._model = TimedModel(model)
        self.vocab_size = self._model.vocab_size

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams = _DEFAULT_PARAMS,
        eos_token_id: int | Iterable[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (1, T).

        Stops after the first EOS (any id of ``eos_token_id``; included in ``tokens``).
        ``max_new_tokens == 0`` returns an empty ``tokens`` tensor and zero counts without running the
        model.
        """
        prompt = validate_request(input_ids, max_new_tokens, params, (self.model,))
        return run_synchronous(
            self._model, None, prompt, max_new_tokens, 0, params, eos_set(eos_token_id), generator
        )
