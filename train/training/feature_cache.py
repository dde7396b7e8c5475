"""The verifier's features of each training row, kept in memory after its first pass and, optionally,
on disk for the next run (docs/eagle3.md).

EAGLE-3 trains on what the frozen verifier computes over a row: its auxiliary states (what ``fc`` fuses)
and its distribution at every position. Online training recomputes them every epoch; SpecForge's
offline mode writes them to disk once, before training (terabytes for a real dataset). This cache sits
between the two: the first time a row is seen its features are computed online, then kept in CPU
memory, up to a byte budget, and every later epoch reads them instead of running the verifier. A row
that does not fit the budget stays online. With a folder (``method.feature_cache_dir``) the kept rows
are also saved there (:meth:`FeatureCache.save`, one file per rank) and the next run with the same
verifier reads them back (:meth:`FeatureCache.load`, memory-mapped): from the second run on, training
is offline wherever the rows are the same.

What a row keeps (its real tokens only, padding dropped): ``aux`` (T, A), the concatenated auxiliary
states; ``hidden`` (T, h), the verifier's last hidden state after its final norm (Hugging Face's
``hidden_states[-1]``), from which the targets over the draft vocabulary are recomputed with the
verifier's head rows (:func:`train.models.eagle3_ttt.head_targets`); and ``argmax`` (T,), the
verifier's argmax over the full vocabulary. That is ``A + h`` values per token instead of the ``V``
logits (2,304 instead of 49,152 on the real pair).

Keys are the rows' contents (:func:`row_keys`, a digest of the real tokens): the features of a row depend
on its tokens alone, so a row keeps its features whichever split, place or run it comes in. Under
DDP / FSDP each rank caches the rows it sees. A saved file carries the :func:`fingerprint` of the
verifier that computed it; a file with another fingerprint is ignored (and replaced at the next save).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from train.models.fingerprint import model_fingerprint

__all__ = ["CachedRow", "FeatureCache", "fingerprint", "padded_rows", "row_keys"]

log = logging.getLogger(__name__)

FORMAT = 1
"""The saved file's layout; a file of another format is ignored."""


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
        self.unsaved = 0
        """Rows kept since the last :meth:`save` or :meth:`load`."""
        self.own: set[Hashable] = set()
        """The keys of the rows this rank computed (in this run, or in an earlier one whose file it read
        as its own): what :meth:`save` writes. Rows read from other ranks' files are used, never saved."""

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
            self.own.add(key)
            self.nbytes += row.nbytes
            added += 1
        self.unsaved += added
        return added

    def save(self, path: str | os.PathLike[str], stamp: dict[str, Any]) -> None:
        """Write the rows this rank computed (:attr:`own`) to ``path`` with ``stamp`` (the verifier's
        :func:`fingerprint`), atomically: a file is either the previous one or this one, never half
        written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        keys = [key for key in self.rows if key in self.own]
        payload = {
            "format": FORMAT,
            "stamp": json.dumps(stamp, sort_keys=True),
            "keys": [str(key) for key in keys],
            "rows": [(row.aux, row.hidden, row.argmax) for row in (self.rows[key] for key in keys)],
        }
        partial = path.with_name(path.name + ".partial")
        torch.save(payload, partial)
        os.replace(partial, path)
        self.unsaved = 0

    def load(self, path: str | os.PathLike[str], stamp: dict[str, Any], own: bool = True) -> int:
        """Keep the rows saved in ``path`` when its stamp is ``stamp``, within the budget. ``own``: this
        rank's file (only this rank replaces it: memory-mapped, read as batches need them, and saved
        again); another rank's is read into memory, so that rank (on another node, on a shared
        filesystem) may replace it meanwhile. Returns how many rows were added (0 for a missing or
        stale file)."""
        path = Path(path)
        if not path.is_file():
            return 0
        payload = torch.load(path, map_location="cpu", mmap=own, weights_only=True)
        if payload.get("format") != FORMAT or payload.get("stamp") != json.dumps(stamp, sort_keys=True):
            log.info("%s holds the features of another verifier or layout; ignored", path)
            return 0
        added = 0
        for key, (aux, hidden, argmax) in zip(payload["keys"], payload["rows"], strict=True):
            row = CachedRow(aux=aux, hidden=hidden, argmax=argmax)
            if key in self.rows or self.nbytes + row.nbytes > self.max_bytes:
                continue
            self.rows[key] = row
            if own:
                self.own.add(key)
            self.nbytes += row.nbytes
            added += 1
        return added


def row_keys(input_ids: torch.Tensor, lengths: Sequence[int]) -> list[str]:
    """A key per row of ``input_ids`` (B, T): a digest of its first ``lengths[i]`` tokens."""
    ids = input_ids.detach().to("cpu", torch.int64)
    return [
        hashlib.blake2b(ids[i, : int(n)].numpy().tobytes(), digest_size=16).hexdigest()
        for i, n in enumerate(lengths)
    ]


def fingerprint(
    verifier: torch.nn.Module, aux_layers: Sequence[int], precision: str, device: str
) -> dict[str, Any]:
    """What the features of a row depend on besides its tokens: the verifier
    (:func:`~train.models.fingerprint.model_fingerprint`: its configuration, dtype and a checksum of every
    parameter), the fused layers, the training precision (autocast) and the device kind."""
    return {
        **model_fingerprint(verifier),
        "aux_layers": [int(i) for i in aux_layers],
        "precision": precision,
        "device": device,
    }


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
