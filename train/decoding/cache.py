"""KV-cache handling for the decoders: crop to a length, keep a set of positions compacted.

Works on any ``transformers`` ``Cache`` whose layers hold ``keys`` / ``values`` tensors of shape
(batch, heads, positions, head_dim) (``DynamicCache`` and the caches of Llama, Qwen3, GPT-2 and most
decoder-only models), and on any object with ``get_seq_length()`` / ``crop(-n)`` for cropping (the
table-driven fakes of the tests). Recurrent layers, and Hugging Face's sliding-window layers (which drop
what falls out of the window), cannot have positions removed; they raise a clear error instead of
silently keeping stale entries. The decoders never meet the latter: :func:`decoding_cache` gives every
model whose cache Hugging Face builds from its config (sliding-window models included) one
:class:`~train.decoding.cache_layer.BufferedLayer` per attention layer, which rolls back by a length and
keeps every position, the window being applied by the attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from train.decoding.cache_layer import BufferedLayer

__all__ = [
    "SlidingLayout",
    "cache_length",
    "buffered_cache",
    "crop_cache",
    "decoding_cache",
    "keep_positions",
    "library_cache",
    "sliding_layout",
]


@dataclass(frozen=True)
class SlidingLayout:
    """A model's sliding-window attention layers, as the decoders treat them.

    window: a query attends to the keys fewer than ``window`` positions behind it (itself included), as
        Hugging Face's ``sliding_window_overlay`` says; None when the windowed layers are chunked
        (Llama 4), whose tree masks are not built here. mixed: full-attention layers sit beside them, so a
        tree mask goes to the model as one mask per layer type.
    """

    window: int | None
    mixed: bool


def library_cache(model: Any) -> Any:
    """The cache the model would build for itself (``DynamicCache(config=...)``), or None for a stand-in."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "get_text_config", None)):
        return None
    try:
        return DynamicCache(config=config)
    except (TypeError, ValueError, AttributeError, KeyError):  # a config the cache cannot read: leave it be
        return None


def sliding_layout(model: Any) -> SlidingLayout | None:
    """The model's sliding-window layers (:class:`SlidingLayout`), or None when it has none."""
    cache = library_cache(model)
    if cache is None or not any(type(layer) is DynamicSlidingWindowLayer for layer in cache.layers):
        return None
    text = model.config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None:  # Mistral: every layer shares the window (or the chunk size)
        types = ["sliding_attention" if window is not None else "chunked_attention"]
    kinds = set(types)
    return SlidingLayout(
        window=int(window) if window is not None and "chunked_attention" not in kinds else None,
        mixed=bool(kinds - {"sliding_attention", "chunked_attention"}),
    )


#: The layer types replaced by a :class:`BufferedLayer` (exactly these: a subclass may hold other state).
_REPLACEABLE = (DynamicLayer, DynamicSlidingWindowLayer)


def decoding_cache(model: Any) -> Any:
    """A fresh cache for ``model`` as the decoders use it: the model's own ``DynamicCache(config=...)``
    with every full or sliding-window attention layer a :class:`BufferedLayer` (other layer kinds, such
    as recurrent state, are left as they are); None, so that the model builds its own, for a model whose
    config the cache cannot read (a stand-in) or whose cache has other layer kinds and no sliding window.

    A ``BufferedLayer`` appends in place and rolls back by lowering a length, where a ``DynamicLayer``
    copies the whole layer at every forward (``torch.cat``) and slices it at every crop; the logits are
    the same bit for bit (tests/decoding/test_cache_layer.py). For a sliding-window layer it also
    keeps every position: a ``DynamicSlidingWindowLayer`` drops what leaves the window, so a rollback
    past it cannot be undone (transformers' ``crop`` raises). Keeping all positions costs memory (the
    cache grows with the sequence, as a full-attention model's does) but not exactness: the model applies
    the window through its attention mask, built from its config for a causal forward, and the decoders
    narrow their tree masks the same way (:func:`~train.decoding.tree_attention.sliding_window_mask`).
    """
    cache = library_cache(model)
    if cache is None:
        return None
    kinds = {type(layer) for layer in cache.layers}
    if not kinds <= set(_REPLACEABLE) and DynamicSlidingWindowLayer not in kinds:
        return None  # other layer kinds (recurrent state) and nothing to unwindow: the model's own cache
    cache.layers = [BufferedLayer() if type(layer) in _REPLACEABLE else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:  # a config that names no layer types
        cache.layer_class_to_replicate = BufferedLayer
    return cache


def buffered_cache() -> DynamicCache:
    """An empty ``DynamicCache`` whose layers, created as the model first writes them, are
    :class:`BufferedLayer` s: for a model without a Hugging Face config (the EAGLE-3 drafter's layer)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = BufferedLayer
    return cache


def cache_length(cache: Any) -> int:
    """Positions held by ``cache`` (0 for None)."""
    return 0 if cache is None else int(cache.get_seq_length())


def crop_cache(cache: Any, length: int, current: int | None = None) -> None:
    """Drop every position at or after ``length`` (an absolute length, not a count to remove).

    ``current`` is the cache's length when the caller tracks it (saves a query); a cache already at
    or below ``length`` is left alone. ``Cache.crop`` takes the (negative) number of positions to
    remove in transformers 5 and accepts it in 4.x too.
    """
    if cache is None:
        return
    if length < 0:
        raise ValueError(f"cannot crop a cache to a negative length ({length})")
    held = cache_length(cache) if current is None else current
    if length < held:
        cache.crop(length - held)


def keep_positions(cache: Any, positions: Sequence[int] | torch.Tensor, current: int | None = None) -> int:
    """Keep only ``positions`` (ascending absolute indices) of every layer, compacted contiguously.

    The accepted path of a draft tree sits at scattered positions after a tree forward; this moves
    its entries to the front, in order, so the cache again describes one contiguous sequence.
    Positions must be strictly increasing and below the cache length. Returns the new length.
    """
    held = cache_length(cache) if current is None else current
    index = torch.as_tensor(positions, dtype=torch.long)
    if index.dim() != 1:
        raise ValueError(f"positions must be 1-D, got shape {tuple(index.shape)}")
    if index.numel():
        if bool((index[1:] <= index[:-1]).any()):
            raise ValueError("positions must be strictly increasing")
        if int(index[0]) < 0 or int(index[-1]) >= held:
            raise ValueError(f"positions must lie in [0, {held}), got {index.tolist()}")
    n = int(index.numel())
    if n == 0 or int(index[-1]) == n - 1:  # a contiguous prefix: a crop does it
        crop_cache(cache, n, held)
        return n
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"{type(cache).__name__} has no per-layer key/value tensors; keep_positions needs a "
            "transformers Cache with `.layers` (transformers >= 4.56)"
        )
    for i, layer in enumerate(layers):
        if isinstance(layer, BufferedLayer):
            layer.keep(index)
            continue
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise TypeError(
                f"layer {i} of the cache ({type(layer).__name__}) cannot keep arbitrary positions "
                "(sliding-window or recurrent state)"
            )
        keys = getattr(layer, "keys", None)
        if keys is None or not isinstance(keys, torch.Tensor) or keys.numel() == 0:
            continue  # an uninitialised (shared-KV) layer holds nothing
        idx = index.to(keys.device)
        layer.keys = keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)
    return n
