"""Shuffling samplers whose order is a pure function of (seed, epoch), so resume is exact.

A ``RandomSampler`` with a shared generator draws each epoch's permutation from wherever the generator
happens to be, and ``DataLoader.__iter__`` draws from it too: how many times the loader was iterated
before (a resumed run iterates it once more to restore its state) changes every later epoch's order.
:class:`EpochShuffleSampler` instead seeds a fresh generator from ``(seed, epoch)`` for each epoch.
Lightning calls :meth:`set_epoch` at the start of every epoch (as for a ``DistributedSampler``) and
``torchdata``'s ``StatefulDataLoader`` skips the batches already yielded when a run resumes mid-epoch.

:class:`PinnedShardSampler` does the same under DDP / FSDP with each row pinned to one rank for the whole
run (rank r always reads rows r, r + world, ...), where Lightning's ``DistributedSampler`` would deal the
rows out afresh every epoch: a rank's per-row cache (EAGLE-3's verifier features) then serves every
epoch after the first. It can also group rows of similar length into batches (transformers'
``get_length_grouped_indices``, seeded the same way).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices

__all__ = ["EpochShuffleSampler", "PinnedShardSampler"]


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A fresh CPU generator for ``(seed, epoch)``."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))


class _ResumableOrder:
    """Hands out ``permutation(epoch)`` (a subclass's) and remembers how much of it went out, so a
    checkpoint's state resumes the interrupted epoch where it stopped."""

    epoch: int
    yielded: int
    _resume_at: int

    def permutation(self, epoch: int) -> list[int]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        # A generator: the permutation is drawn when the first index is asked for, after Lightning's
        # set_epoch and after a checkpoint's state was loaded.
        start, self._resume_at = self._resume_at, 0
        self.yielded = start
        for index in self.permutation(self.epoch)[start:]:
            self.yielded += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self._resume_at = int(state["yielded"])


class EpochShuffleSampler(_ResumableOrder, Sampler[int]):
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
        return torch.randperm(self.num_samples, generator=epoch_generator(self.seed, epoch)).tolist()

    def __len__(self) -> int:
        return self.num_samples


class PinnedShardSampler(_ResumableOrder, DistributedSampler):
    """This rank's share of ``num_rows`` rows, the same rows every epoch, in an order seeded by
    ``(seed, epoch)``: shuffled, or with ``lengths`` grouped by length for batches of ``batch_size``.

    Rank r of ``num_replicas`` reads rows r, r + world, ...; a share shorter than the longest repeats its
    first rows so every rank runs the same number of batches (as ``DistributedSampler`` pads). The ranks
    default to the process group's (one process: everything). A ``DistributedSampler``, so Lightning keeps
    it instead of putting its own in its place; stateful, for a mid-epoch resume."""

    def __init__(
        self,
        num_rows: int,
        seed: int = 0,
        lengths: Sequence[int] | None = None,
        batch_size: int = 1,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        world = num_replicas if num_replicas is not None else (dist.get_world_size() if distributed else 1)
        this = rank if rank is not None else (dist.get_rank() if distributed else 0)
        super().__init__(
            range(num_rows),  # type: ignore[arg-type]
            num_replicas=world,
            rank=this,
            shuffle=True,
            seed=seed,
        )
        if lengths is not None and len(lengths) != num_rows:
            raise ValueError(f"lengths has {len(lengths)} entries for {num_rows} rows")
        self.num_rows = num_rows
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.batch_size = batch_size
        self.yielded = 0
        self._resume_at = 0

    def share(self) -> list[int]:
        """This rank's rows, padded to the common share size (``num_samples``)."""
        rows = list(range(self.rank, self.num_rows, self.num_replicas)) or [self.rank % max(self.num_rows, 1)]
        return (rows * (self.num_samples // len(rows) + 1))[: self.num_samples] if self.num_rows else []

    def permutation(self, epoch: int) -> list[int]:
        rows = self.share()
        generator = epoch_generator(self.seed, epoch)
        if self.lengths is None:
            order = torch.randperm(len(rows), generator=generator).tolist()
        else:
            order = get_length_grouped_indices(
                [self.lengths[i] for i in rows], self.batch_size, generator=generator
            )
        return [rows[i] for i in order]
