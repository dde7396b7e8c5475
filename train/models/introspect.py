"""What a loaded causal LM declares: its device, vocabulary sizes, and the cache keyword it speaks.

transformers renamed the cache argument and output in 5.24 (``past_key_values`` -> ``cache``; the old
name warns and goes in 5.40): :func:`cache_keyword` and :func:`returned_cache` are the one place that
knows, so every model call (the engine's, the batched rollout's, the draft vocabulary's) speaks each
version's own name.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import transformers
from packaging.version import Version

__all__ = [
    "LIBRARY_CACHE_KEYWORD",
    "cache_keyword",
    "input_vocab_size",
    "model_device",
    "output_vocab_size",
    "returned_cache",
    "supports_logits_to_keep",
]

#: What the installed transformers calls the KV cache argument: ``cache`` from 5.24 (5.23 and earlier know
#: only ``past_key_values``, which 5.24 deprecates with a FutureWarning and 5.40 removes).
LIBRARY_CACHE_KEYWORD = (
    "cache"
    if Version(Version(transformers.__version__).base_version) >= Version("5.24")
    else "past_key_values"
)


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


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword ``model.forward`` takes its KV cache by: the one its signature names (``cache`` in
    transformers >= 5.24, ``past_key_values`` before, and in stand-ins written for either). A wrapper whose
    forward takes ``**kwargs`` and passes them on (peft's models, a timing or logging wrapper) speaks its
    wrapped model's name, found through ``base_model`` / ``model``; failing that, the installed
    transformers' own (:data:`LIBRARY_CACHE_KEYWORD`)."""
    current: Any = model
    for _ in range(8):  # wrappers nest a few deep (PeftModel -> LoraModel -> the model)
        try:
            parameters = inspect.signature(current.forward).parameters
        except (TypeError, ValueError, AttributeError):
            break
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
        inner = getattr(current, "base_model", None)
        if inner is None or inner is current:
            inner = getattr(current, "model", None)
        if not isinstance(inner, torch.nn.Module) or inner is current:
            break
        current = inner
    return LIBRARY_CACHE_KEYWORD


def returned_cache(out: Any) -> Any:
    """The updated cache a forward returned: ``out.cache`` (transformers >= 5.24, where reading
    ``out.past_key_values`` warns), else ``out.past_key_values``."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)
