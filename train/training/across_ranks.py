"""Per-rank bookkeeping made whole: validation sums added over every rank, caches merged from every rank.
Each function is a collective under DDP / FSDP (every rank calls it, in the same order) and the identity
in a single process."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["merged_over_ranks", "summed_over_ranks"]

K = TypeVar("K")
V = TypeVar("V")


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _every_ranks(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (pickled through the process group)."""
    gathered: list[Any] = [None] * _world()
    dist.all_gather_object(gathered, value)
    return gathered


def summed_over_ranks(sums: Mapping[str, float], device: torch.device | str = "cpu") -> dict[str, float]:
    """``sums`` added key by key over every rank; a key some rank never saw counts 0 there. ``device``: where
    the reduction's tensor lives (the module's device: NCCL reduces on the GPU)."""
    if _world() == 1:
        return dict(sums)
    keys = sorted(set().union(*_every_ranks(sorted(sums))))
    local = torch.tensor([float(sums.get(k, 0.0)) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(local)
    return dict(zip(keys, local.tolist(), strict=True))


def merged_over_ranks(mapping: Mapping[K, V]) -> dict[K, V]:
    """One dict of every rank's entries (a key on several ranks keeps the lowest rank's value)."""
    if _world() == 1:
        return dict(mapping)
    merged: dict[K, V] = {}
    for part in reversed(_every_ranks(dict(mapping))):
        merged.update(part)
    return merged
