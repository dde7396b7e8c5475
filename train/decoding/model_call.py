"""One timed forward pass of a causal LM over new tokens, on top of its KV cache.

:class:`TimedModel` wraps a Hugging Face causal LM (or anything with the same call signature) for the
decoders: it knows the model's device, its output vocabulary and how many ids it can embed, and runs
``model(input_ids, past_key_values, ...)`` with optional explicit ``position_ids``, an optional 4-D
attention mask (tree attention), ``logits_to_keep`` and the capture of chosen layers' hidden states.
The clock stops after the model's *own* device has finished (``torch.cuda.synchronize(device)``), so
two models on two GPUs are each timed on the GPU that ran them.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CallResult",
    "TimedModel",
    "input_vocab_size",
    "model_device",
    "output_vocab_size",
    "supports_logits_to_keep",
]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a parameter-free stand-in)."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def output_vocab_size(model: torch.nn.Module) -> int:
    """Size of the model's logits' last dimension (output embedding rows, else config.vocab_size)."""
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        weight = getattr(get(), "weight", None)
        if isinstance(weight, torch.Tensor):
            return int(weight.shape[0])
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(
            "cannot determine the model's output vocabulary size (no output embeddings, no config.vocab_size)"
        )
    return vocab


def input_vocab_size(model: torch.nn.Module) -> int:
    """How many token ids the model can embed (input embedding rows, else its output size)."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        weight = getattr(get(), "weight", None)
        if isinstance(weight, torch.Tensor):
            return int(weight.shape[0])
    return output_vocab_size(model)


def supports_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` (most transformers causal LMs do)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class CallResult:
    """What one forward returned.

    logits: (n, V) for the last ``n`` positions (``logits_to_keep``; all positions when None), on the
        model's device, in the model's dtype. cache: the updated cache. seconds: wall time of the call,
        device work included. hidden: {layer index: (T, d) hidden states entering that layer}, for the
        layers asked for (``hidden_states[i]`` in Hugging Face's convention), else None.
    """

    logits: torch.Tensor
    cache: Any
    seconds: float
    hidden: dict[int, torch.Tensor] | None = None


class TimedModel:
    """A causal LM as the decoders call it: ``timed(tokens, cache) -> CallResult``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = model_device(model)
        self.vocab_size = output_vocab_size(model)
        self.embed_size = input_vocab_size(model)
        self.supports_logits_to_keep = supports_logits_to_keep(model)
        dtype = getattr(model, "dtype", None)
        #: The dtype of additive attention masks for this model (its floating dtype; float32 for fakes).
        self.mask_dtype = (
            dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
        )
        self._sync = self.device.type == "cuda"

    def synchronize(self) -> None:
        """Wait for this model's device (only its own: the other model may sit on another GPU)."""
        if self._sync:
            torch.cuda.synchronize(self.device)

    def __call__(
        self,
        tokens: Sequence[int] | torch.Tensor,
        cache: Any = None,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int | None = 1,
        hidden_layers: Sequence[int] | None = None,
    ) -> CallResult:
        """Forward ``tokens`` (T new ids, or a (1, T) tensor) after what ``cache`` holds.

        position_ids: (1, T), default the positions following the cache. attention_mask: a 4-D
        (1, 1, T, cache + T) mask for tree attention (True / 0.0 = attend), default causal.
        logits_to_keep: logits of the last n positions only (None: all T). hidden_layers: indices into
        Hugging Face's ``hidden_states`` tuple (0 = embeddings, i = input of layer i) to capture.
        """
        if isinstance(tokens, torch.Tensor):
            ids = tokens.reshape(1, -1).to(self.device)
        else:
            ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        keep = logits_to_keep is not None and self.supports_logits_to_keep
        if position_ids is None and attention_mask is None and not hidden_layers:  # the hot path
            start = time.perf_counter()
            if keep:
                out = self.model(
                    input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep
                )
            else:
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        else:
            kwargs: dict[str, Any] = {"past_key_values": cache, "use_cache": True}
            if position_ids is not None:
                kwargs["position_ids"] = position_ids.to(self.device)
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask.to(self.device)
            if keep:
                kwargs["logits_to_keep"] = logits_to_keep
            if hidden_layers:
                kwargs["output_hidden_states"] = True
            start = time.perf_counter()
            out = self.model(input_ids=ids, **kwargs)
        if self._sync:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        logits = out.logits[0]
        if logits_to_keep is not None and not keep:
            logits = logits[-logits_to_keep:]
        hidden = None
        if hidden_layers:
            states = out.hidden_states
            hidden = {int(i): states[i][0] for i in hidden_layers}
        return CallResult(logits=logits, cache=out.past_key_values, seconds=seconds, hidden=hidden)
