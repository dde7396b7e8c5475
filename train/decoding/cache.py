"""KV-cache handling for the decoders: crop to a length, keep a set of positions compacted.

Works on any ``transformers`` ``Cache`` whose layers hold ``keys`` / ``values`` tensors of shape
(batch, heads, positions, head_dim) (``DynamicCache`` and the caches of Llama, Qwen3, GPT-2 and most
decoder-only models), and on any object with ``get_seq_length()`` / ``crop(-n)`` for cropping (the
table-driven fakes of the tests). Sliding-window and recurrent layers cannot have arbitrary positions
removed; they raise a clear error instead of silently keeping stale entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["cache_length", "crop_cache", "keep_positions"]


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
