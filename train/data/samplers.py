"""A shuffling sampler whose order is a pure function of (seed, epoch), so resume is exact.

A ``RandomSampler`` with a shared generator draws each epoch's permutation from wherever the generator
happens to be, and ``DataLoader.__iter__`` draws from it too: how many times the loader was iterated
before (a resumed run iterates it once more to restore its state) changes every later epoch's order.
:class:`EpochShuffleSampler` instead seeds a fresh generator from ``(seed, epoch)`` for each epoch.
Lightning calls :meth:`set_epoch` at the start of every epoch (as for a ``DistributedSampler``) and
``torchdata``'s ``StatefulDataLoader`` skips the batches already yielded when a run resumes mid-epoch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

__all__ = ["EpochShuffleSampler"]


class EpochShuffleSampler(Sampler[int]):
    """A permutation of ``range(num_samples)`` per epoch, seeded by ``(seed, epoch)``.

    Its state (``state_dict`` / ``load_state_dict``, saved in Lightning checkpoints through the
    ``StatefulDataLoader``) is the epoch and how many indices of it were handed out, so a resumed
    iteration continues the interrupted epoch's permutation where it stopped.
    """

    def __init__(self, num_samples: int, seed: int = 0) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = num_samples
        self.seed = int(seed)
        self.epoch = 0
        self.yielded = 0
        self._resume_at = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        # A generator: the permutation is drawn when the first index is asked for, after Lightning's
        # set_epoch and after a checkpoint's state was loaded.
        start, self._resume_at = self._resume_at, 0
        self.yielded = start
        for index in self.permutation(self.epoch)[start:]:
            self.yielded += 1
            yield index

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._resume_at = int(state["yielded"])
