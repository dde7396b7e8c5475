"""The verifier's features of each training row, kept in memory after its first pass (docs/eagle3.md).

EAGLE-3 trains on what the frozen verifier computes over a row: its auxiliary states (what ``fc`` fuses)
and its distribution at every position. Online training recomputes them every epoch; SpecForge's
offline mode writes them to disk once (terabytes for a real dataset). This cache sits between the two:
the first time a row is seen its features are computed online, then kept in CPU memory, up to a byte
budget, and every later epoch reads them instead of running the verifier. A row that does not fit
the budget stays online. Nothing is written to disk; a resumed run refills the cache as it goes.

What a row keeps (its real tokens only, padding dropped): ``aux`` (T, A), the concatenated auxiliary
states; ``hidden`` (T, h), the verifier's last hidden state after its final norm (Hugging Face's
``hidden_states[-1]``), from which the targets over the draft vocabulary are recomputed with the
verifier's head rows (:func:`train.models.eagle3_ttt.head_targets`); and ``argmax`` (T,), the
verifier's argmax over the full vocabulary. That is ``A + h`` values per token instead of the ``V``
logits (2,304 instead of 49,152 on the real pair).

Keys are ``(split, index)``, ``index`` the row's place in its split (:mod:`train.training.answer_data`);
under DDP / FSDP each rank caches the rows it sees.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["CachedRow", "FeatureCache", "padded_rows"]


@dataclass(frozen=True)
class CachedRow:
    """One row's verifier features, on the CPU: ``aux`` (T, A), ``hidden`` (T, h), ``argmax`` (T,) long."""

    aux: torch.Tensor
    hidden: torch.Tensor
    argmax: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.aux, self.hidden, self.argmax))


class FeatureCache:
    """Rows' features by key, at most ``max_bytes`` in all (0: nothing is kept)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.rows: dict[Hashable, CachedRow] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.rows)

    def lookup(self, keys: Sequence[Hashable]) -> list[CachedRow] | None:
        """Every key's row, or None when any is missing (the batch then runs online)."""
        rows = [self.rows.get(key) for key in keys]
        if any(row is None for row in rows):
            self.misses += 1
            return None
        self.hits += 1
        return [row for row in rows if row is not None]

    def store(
        self,
        keys: Sequence[Hashable],
        lengths: Sequence[int],
        aux: torch.Tensor,
        hidden: torch.Tensor,
        argmax: torch.Tensor,
    ) -> int:
        """Keep row i's first ``lengths[i]`` positions of ``aux`` (B, T, A), ``hidden`` (B, T, h) and
        ``argmax`` (B, T), copied to the CPU, for each key not yet kept while the budget allows.
        Returns how many rows were added."""
        added = 0
        for i, (key, n) in enumerate(zip(keys, lengths, strict=True)):
            if key in self.rows:
                continue
            size = int(n) * (
                aux.shape[-1] * aux.element_size() + hidden.shape[-1] * hidden.element_size() + 8
            )
            if self.nbytes + size > self.max_bytes:
                continue
            row = CachedRow(
                aux=aux[i, :n].detach().to("cpu", copy=True),
                hidden=hidden[i, :n].detach().to("cpu", copy=True),
                argmax=argmax[i, :n].detach().to("cpu", dtype=torch.long, copy=True),
            )
            self.rows[key] = row
            self.nbytes += row.nbytes
            added += 1
        return added


def padded_rows(
    rows: Sequence[CachedRow], width: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aux`` (B, width, A), ``hidden`` (B, width, h) and ``argmax`` (B, width) of ``rows``, right-padded
    with zeros (padding sits after every real position, so a causal reader never sees it), on ``device``."""
    first = rows[0]
    aux = first.aux.new_zeros((len(rows), width, first.aux.shape[-1]))
    hidden = first.hidden.new_zeros((len(rows), width, first.hidden.shape[-1]))
    argmax = first.argmax.new_zeros((len(rows), width))
    for i, row in enumerate(rows):
        n = row.argmax.shape[0]
        if n > width:
            raise ValueError(f"a cached row has {n} positions, more than the batch's {width}")
        aux[i, :n], hidden[i, :n], argmax[i, :n] = row.aux, row.hidden, row.argmax
    return aux.to(device), hidden.to(device), argmax.to(device)
