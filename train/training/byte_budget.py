"""A memory budget shared by the caches that keep a frozen model's outputs during a run."""

from __future__ import annotations

import torch

__all__ = ["ByteBudget"]


class ByteBudget:
    """Bytes that caches of a frozen model's outputs may still take (one budget, several caches)."""

    def __init__(self, megabytes: float) -> None:
        self.left = int(megabytes * 2**20)

    def take(self, tensors: list[torch.Tensor]) -> bool:
        """Reserve the bytes of ``tensors``; False (nothing reserved) when they do not fit."""
        size = sum(t.numel() * t.element_size() for t in tensors)
        if size > self.left:
            return False
        self.left -= size
        return True
