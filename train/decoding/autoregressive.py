"""Autoregressive baseline decoder: one forward pass per new token, with a KV cache."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from ._common import eos_set, model_device, output_vocab_size, supports_logits_to_keep, validate_request
from .metrics import DecodeResult, DecodeStats
from .sampling import SamplingParams, warp

_DEFAULT_PARAMS = SamplingParams()


class AutoregressiveDecoder:
    """Plain decoding of ``model`` (any Hugging Face causal LM with a cache).

    ``stats.verifier_calls`` counts forward passes (the prompt prefill included), ``drafted`` is 0.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.vocab_size = output_vocab_size(model)
        self._keep = supports_logits_to_keep(model)

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

        Stops after the first EOS (which is included in ``tokens``). ``max_new_tokens == 0`` returns an
        empty ``tokens`` tensor and zero counts without running the model.
        """
        t_start = time.perf_counter()
        prompt = validate_request(input_ids, max_new_tokens, params, (self.model,))
        stats = DecodeStats()
        model = self.model
        device = model_device(model)
        sync = device.type == "cuda"
        eos = eos_set(eos_token_id)
        greedy = params.temperature == 0.0
        kw = {"logits_to_keep": 1} if self._keep else {}
        vocab = self.vocab_size
        perf = time.perf_counter

        out_tokens: list[int] = []
        feed = torch.tensor([prompt], dtype=torch.long, device=device)
        cache = None
        calls = 0
        fwd_time = 0.0
        while len(out_tokens) < max_new_tokens:
            t0 = perf()
            out = model(input_ids=feed, past_key_values=cache, use_cache=True, **kw)
            if sync:
                torch.cuda.synchronize(device)
            fwd_time += perf() - t0
            calls += 1
            cache = out.past_key_values
            logits = out.logits[0, -1, :vocab]
            if greedy:
                x = int(logits.argmax())
            else:
                x = int(torch.multinomial(warp(logits, params), 1, generator=generator))
            out_tokens.append(x)
            if x in eos:
                break
            feed = torch.tensor([[x]], dtype=torch.long, device=device)

        stats.verifier_calls = calls
        stats.verifier_time = fwd_time
        stats.new_tokens = len(out_tokens)
        stats.wall_time = time.perf_counter() - t_start
        return DecodeResult(torch.tensor(out_tokens, dtype=torch.long), stats)
