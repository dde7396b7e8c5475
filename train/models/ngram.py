"""An n-gram language model over token ids: interpolated Kneser-Ney (Chen & Goodman 1998), in numpy.

Used to rescore prediction heads' drafts (BPD, docs/bpd.md). Token ids are small integers,
so an n-gram is one int64 key (base ``vocab_size``); counts are sorted key arrays looked up with
``searchsorted``, a batch of queries at once. No maintained Python library fits token-id n-grams on
this stack (KenLM needs a compiled binary and text files; ``nltk.lm`` is pure-Python dictionaries,
orders of magnitude slower to query), hence this small one, tested against hand-computed values.

With one absolute discount D (0.75 by default) and orders 1..N::

    P_N(w | h)  = max(c(h w) - D, 0) / c(h) + D * T(h) / c(h) * P_{N-1}(w | h')
    P_n(w | h)  = same with continuation counts N1+(. h w) in place of c  (1 < n < N)
    P_1(w)      = max(N1+(. w) - D, 0) / N1+(. .) + D * T / N1+(. .) / V     (V: the vocabulary)

where h' drops h's first token, T(h) is the number of distinct words seen after h, and a context never
seen falls through to the next lower order. The uniform term keeps unseen tokens finite.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["NGramLM"]


class _Order:
    """Counts of one order: sorted n-gram keys and their counts, and per context (n - 1 tokens) the
    total count and the number of distinct next tokens."""

    def __init__(self, keys: np.ndarray, counts: np.ndarray, vocab: int) -> None:
        self.keys, self.counts = keys, counts.astype(np.float64)
        contexts = keys // vocab
        self.ctx_keys, first = np.unique(contexts, return_index=True)
        self.ctx_total = np.add.reduceat(self.counts, first) if len(keys) else np.zeros(0)
        self.ctx_types = np.diff(np.append(first, len(keys))).astype(np.float64)

    @staticmethod
    def _find(sorted_keys: np.ndarray, values: np.ndarray, data: np.ndarray) -> np.ndarray:
        if len(sorted_keys) == 0:
            return np.zeros(len(values))
        at = np.clip(np.searchsorted(sorted_keys, values), 0, len(sorted_keys) - 1)
        return np.where(sorted_keys[at] == values, data[at], 0.0)

    def count(self, keys: np.ndarray) -> np.ndarray:
        return self._find(self.keys, keys, self.counts)

    def context(self, contexts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (
            self._find(self.ctx_keys, contexts, self.ctx_total),
            self._find(self.ctx_keys, contexts, self.ctx_types),
        )


class NGramLM:
    """Interpolated Kneser-Ney over token ids (see the module docstring). ``fit`` once, then
    :meth:`logprob` answers batches of (context, token) queries."""

    def __init__(self, order: int, vocab_size: int, discount: float = 0.75) -> None:
        if not isinstance(order, int) or order < 1:
            raise ValueError(f"order must be an integer >= 1, got {order!r}")
        if not 0.0 < discount < 1.0:
            raise ValueError(f"discount must be in (0, 1), got {discount!r}")
        # every key (and a context key times vocab_size) is below vocab_size ** order: int64 holds 2**63 - 1
        if vocab_size < 2 or int(vocab_size) ** order > 2**63:
            raise ValueError(f"vocab_size {vocab_size} ** order {order} does not fit an int64 key")
        self.order, self.vocab_size, self.discount = order, int(vocab_size), float(discount)
        self._orders: list[_Order] = []

    # ------------------------------------------------------------------ estimation

    def _keys(self, sequences: Sequence[np.ndarray], n: int) -> np.ndarray:
        parts = []
        for seq in sequences:
            if len(seq) < n:
                continue
            key = np.zeros(len(seq) - n + 1, dtype=np.int64)
            for j in range(n):
                key = key * self.vocab_size + seq[j : len(seq) - n + 1 + j]
            parts.append(key)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def fit(self, sequences: Iterable[Sequence[int]]) -> NGramLM:
        """Estimate from token-id sequences (documents; n-grams never cross two of them)."""
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences]
        if any(len(s) and (s.min() < 0 or s.max() >= self.vocab_size) for s in seqs):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        top_keys, top_counts = np.unique(self._keys(seqs, self.order), return_counts=True)
        if len(top_keys) == 0:
            raise ValueError(f"no {self.order}-gram in the data: the sequences are too short")
        orders = [_Order(top_keys, top_counts, self.vocab_size)]
        higher = top_keys
        for n in range(self.order - 1, 0, -1):  # continuation counts: distinct left extensions
            suffixes = higher % (self.vocab_size**n)
            keys, counts = np.unique(suffixes, return_counts=True)
            # n-grams that only start a document have no left extension; they still exist as types
            own = np.unique(self._keys(seqs, n))
            missing = np.setdiff1d(own, keys, assume_unique=True)
            keys = np.concatenate([keys, missing])
            counts = np.concatenate([counts, np.ones(len(missing), dtype=counts.dtype)])
            sort = np.argsort(keys)
            orders.append(_Order(keys[sort], counts[sort], self.vocab_size))
            higher = own
        self._orders = orders[::-1]  # index n - 1 holds order n
        return self

    # ------------------------------------------------------------------ queries

    def logprob(
        self, contexts: np.ndarray | Sequence[Sequence[int]], tokens: np.ndarray | Sequence[int]
    ) -> np.ndarray:
        """Natural-log P(token | context) for a batch. contexts: (M, L) token ids, the most recent last
        (only the last order - 1 count; L may be 0); tokens: (M,). Returns (M,) float64."""
        if not self._orders:
            raise RuntimeError("the n-gram model is not fitted: call fit() or load() first")
        tokens = np.asarray(tokens, dtype=np.int64)
        ctx = np.asarray(contexts, dtype=np.int64).reshape(len(tokens), -1)
        ctx = ctx[:, max(ctx.shape[1] - (self.order - 1), 0) :]
        d = self.discount
        unigram = self._orders[0]
        total = unigram.counts.sum()
        prob = (
            np.maximum(unigram.count(tokens) - d, 0.0) / total
            + d * len(unigram.keys) / total / self.vocab_size
        )
        for n in range(2, min(self.order, ctx.shape[1] + 1) + 1):
            table = self._orders[n - 1]
            h = np.zeros(len(tokens), dtype=np.int64)
            for j in range(ctx.shape[1] - (n - 1), ctx.shape[1]):
                h = h * self.vocab_size + ctx[:, j]
            c_total, c_types = table.context(h)
            seen = c_total > 0
            safe = np.where(seen, c_total, 1.0)
            higher = (
                np.maximum(table.count(h * self.vocab_size + tokens) - d, 0.0) / safe
                + d * c_types / safe * prob
            )
            prob = np.where(seen, higher, prob)
        return np.log(prob)

    # ------------------------------------------------------------------ persistence

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """``ngram.json`` (order, vocabulary, discount) and ``ngram.npz`` (keys and counts per order)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "order": self.order,
            "vocab_size": self.vocab_size,
            "discount": self.discount,
            "smoothing": "interpolated Kneser-Ney",
        }
        (out / "ngram.json").write_text(json.dumps(meta, indent=2) + "\n")
        arrays: dict[str, Any] = {}
        for n, table in enumerate(self._orders, start=1):
            arrays[f"keys_{n}"], arrays[f"counts_{n}"] = table.keys, table.counts
        np.savez_compressed(out / "ngram.npz", allow_pickle=False, **arrays)
        return out

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> NGramLM:
        path = Path(folder)
        if not (path / "ngram.json").is_file() or not (path / "ngram.npz").is_file():
            raise FileNotFoundError(f"{path}: no n-gram model here (ngram.json and ngram.npz)")
        meta = json.loads((path / "ngram.json").read_text())
        lm = cls(meta["order"], meta["vocab_size"], meta["discount"])
        with np.load(path / "ngram.npz") as data:
            lm._orders = [
                _Order(data[f"keys_{n}"], data[f"counts_{n}"], lm.vocab_size) for n in range(1, lm.order + 1)
            ]
        return lm
