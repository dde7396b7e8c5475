"""Seeds that do not depend on the device or on what ran before: one stream per (run seed, step, salt)."""

from __future__ import annotations

import torch


def mix_seed(*values: int) -> int:
    """A seed from integers (run seed, step, rank, ...), stable across processes, unlike ``hash``:
    a resumed run draws the same rollouts the killed one would have."""
    seed = 0
    for v in values:
        seed = (seed * 1_000_003 + int(v)) % (2**61 - 1)
    return seed


def seeded_generator(device: torch.device | str, *values: int) -> torch.Generator:
    """A generator on ``device`` seeded by :func:`mix_seed` of (run seed, step, rank, ...): a resumed run
    draws what the killed one would have, and each rank its own."""
    gen = torch.Generator(device=device)
    gen.manual_seed(mix_seed(*values))
    return gen
