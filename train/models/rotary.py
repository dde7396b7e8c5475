"""Rotary position embeddings kept in float32 whatever dtype the model around them moves to.

A rotary module's ``inv_freq`` is a buffer, so ``model.to(torch.bfloat16)``, ``.half()``, Lightning's
half-precision plugins and FSDP's buffer casting round it: bf16 keeps 8 bits of mantissa, a relative
error of up to 3.9e-3 in every frequency, a phase error of radians at positions in the thousands
(vLLM computes the frequencies exactly). Casting back to float32 keeps the rounded values, so the
buffers are *recomputed* from the module's config, as transformers' rotary modules compute them at
``__init__``.

:func:`keep_rotary_float32` restores them now; :func:`pin_rotary_float32` adds a forward pre-hook to
each rotary module that restores them before any forward that finds them moved, so every later dtype
move, by whatever code, is undone before the frequencies are used.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

__all__ = ["exact_inv_freq", "keep_rotary_float32", "pin_rotary_float32", "rotary_buffers"]

_PINNED = "_draftsmith_rotary_float32"


def rotary_buffers(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """Every ``(module, buffer name)`` of a rotary frequency buffer in ``model``: the buffers named
    ``inv_freq``, ``original_inv_freq`` or ``<layer type>_inv_freq`` / ``<layer type>_original_inv_freq``
    (transformers' models with per-layer-type RoPE)."""
    for module in model.modules():
        yield from rotary_buffers_of(module)


def rotary_buffers_of(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """The rotary frequency buffers held by ``module`` itself (not its children)."""
    return [
        (module, name)
        for name, buffer in module.named_buffers(recurse=False)
        if buffer is not None and name.endswith("inv_freq")
    ]


def _layer_type(name: str) -> str | None:
    """``sliding_attention`` for ``sliding_attention_inv_freq`` / ``..._original_inv_freq``; None for
    the plain names."""
    stem = name.removesuffix("inv_freq").removesuffix("original_").removesuffix("_")
    return stem or None


def exact_inv_freq(rotary: nn.Module, name: str = "inv_freq") -> torch.Tensor | None:
    """The float32 frequencies buffer ``name`` of ``rotary`` held at ``__init__``, recomputed from its
    ``config`` and ``rope_type`` (transformers' rotary modules), on the CPU; None for a module that does
    not say how it computes them."""
    config, rope_type = getattr(rotary, "config", None), getattr(rotary, "rope_type", None)
    if config is None or rope_type is None:
        return None
    layer_type = _layer_type(name)
    if isinstance(rope_type, dict):
        if layer_type is None or layer_type not in rope_type:
            return None
        rope_type = rope_type[layer_type]
    kwargs: dict[str, Any] = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "default":
        init = getattr(rotary, "compute_default_rope_parameters", None)
        if init is None:
            return None
    else:
        init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, _ = init(config, **kwargs)
    return inv_freq.to(torch.float32)


def keep_rotary_float32(model: nn.Module) -> nn.Module:
    """Put every rotary frequency buffer of ``model`` back to its exact float32 values, on the device it
    is on; returns ``model``. A buffer whose module does not say how it was computed is cast to float32
    (its values as they are now). Dynamic RoPE (``rope_type="dynamic"``) starts again from its
    original length, so its next forward recomputes the frequencies a longer input needs."""
    for module, name in rotary_buffers(model):
        current = getattr(module, name)
        exact = exact_inv_freq(module, name)
        value = current.float() if exact is None else exact.to(current.device)
        if current.dtype == torch.float32 and torch.equal(current, value):
            continue
        module.register_buffer(name, value, persistent=name not in module._non_persistent_buffers_set)
        if hasattr(module, "original_max_seq_len") and hasattr(module, "max_seq_len_cached"):
            module.max_seq_len_cached = module.original_max_seq_len
    return model


def _restore_before_forward(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a pinned rotary module: undo a dtype move made since its last forward."""
    if any(getattr(module, name).dtype != torch.float32 for _, name in rotary_buffers_of(module)):
        keep_rotary_float32(module)


def pin_rotary_float32(model: nn.Module) -> nn.Module:
    """Restore ``model``'s rotary buffers to float32 now, and before every forward of a rotary module
    that finds them in another dtype (after a ``.to(torch.bfloat16)``, a ``.half()``, a precision
    plugin); returns ``model``. Pinning twice adds one hook."""
    keep_rotary_float32(model)
    for module in {id(m): m for m, _ in rotary_buffers(model)}.values():
        if not getattr(module, _PINNED, False):
            module.register_forward_pre_hook(_restore_before_forward)
            setattr(module, _PINNED, True)
    return model
