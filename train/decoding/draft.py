"""What a proposer hands the verifier: a chain or a tree of draft tokens.

Nodes are numbered in the order a verifier scores them (every parent before its children). Node
``i`` continues the committed context when ``parents[i] == -1`` and node ``parents[i]`` otherwise.
``q[i]`` is the proposal distribution node ``i`` was drawn from (for siblings drawn without
replacement: the parent's distribution before any sibling was removed; the verification rule does the
removal). ``q is None`` means the tokens are deterministic choices (greedy drafting, top-k heads):
the rule then treats each node's proposal as a point mass on its token. ``rank[i]`` is node ``i``'s
place in the draw order among its siblings (0 = drawn first), which the recursive rule follows.
``kind`` says how siblings were drawn from their q: ``iid`` (SpecInfer) or ``without_replacement``
(RSD); a chain has no siblings and ignores it.

A chain drafted over a reduced draft vocabulary (train/models/draft_vocab.py) may keep q *compact*:
``support`` holds the N verifier ids q's columns stand for (q is then (n, N), zero on every other id)
and ``columns[i]`` the column of token ``i``. The chain rule works on the compact rows directly (a
sixth of the vocabulary for 8,192 of 49,152 ids, and no (n, V) rows to fill); anything else asks for
:meth:`Draft.dense_q`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

__all__ = ["Draft"]


@dataclass
class Draft:
    """tokens: n ids; parents: n indices (-1 = the context); q: (n, V), (n, N) over ``support``, or None;
    rank: n ints."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None
    rank: list[int] = field(default_factory=list)
    kind: str = "iid"
    support: torch.Tensor | None = None
    columns: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n or (self.rank and len(self.rank) != n):
            raise ValueError(
                f"a draft needs one parent (and one rank) per token: {n} tokens, "
                f"{len(self.parents)} parents, {len(self.rank)} ranks"
            )
        if self.q is not None and self.q.shape[0] != n:
            raise ValueError(f"q has {self.q.shape[0]} rows for {n} draft tokens")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} must be -1 or an earlier node")
        if not self.rank:
            self.rank = [0] * n
        _check_support(self)

    @classmethod
    def chain(
        cls,
        tokens: list[int],
        q: torch.Tensor | None = None,
        support: torch.Tensor | None = None,
        columns: list[int] | None = None,
    ) -> Draft:
        """A chain: node i continues node i - 1 (valid by construction, so built without re-checking:
        this runs once per block in the decoding loop). ``support``/``columns``: a compact q (above)."""
        draft = cls.__new__(cls)
        draft.tokens, draft.parents, draft.q = list(tokens), list(range(-1, len(tokens) - 1)), q
        draft.rank = [0] * len(tokens)
        draft.kind = "iid"
        draft.support, draft.columns = support, columns
        draft.__dict__["is_chain"] = True  # by construction: nothing to check
        if q is not None and q.shape[0] != len(tokens):
            raise ValueError(f"q has {q.shape[0]} rows for {len(tokens)} draft tokens")
        _check_support(draft)
        return draft

    def dense_q(self, vocab_size: int) -> torch.Tensor | None:
        """q over the verifier's ``vocab_size`` ids, (n, V): a compact q placed (zero off its support)."""
        if self.q is None or self.support is None:
            return self.q
        full = self.q.new_zeros(self.q.shape[0], vocab_size)
        return full.index_copy_(1, self.support.to(self.q.device), self.q)

    def __len__(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def is_chain(self) -> bool:
        """Whether node i continues node i - 1 for every i (the block step, the rule and the statistics
        all ask; the parents never change after construction)."""
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of every node (1 for the children of the context)."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return out

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (-1: of the context), in draw order."""
        kids = [i for i, parent in enumerate(self.parents) if parent == node]
        return sorted(kids, key=lambda i: self.rank[i])


def _check_support(draft: Draft) -> None:
    """A compact q names its support and each token's column (cheap checks: this runs once per block)."""
    if draft.support is None:
        if draft.columns is not None:
            raise ValueError("columns describe a compact q: give its support too")
        return
    if draft.q is None or draft.columns is None or len(draft.columns) != len(draft.tokens):
        raise ValueError("a compact q needs q, its support and one column per draft token")
    if draft.q.shape[-1] != draft.support.shape[0]:
        raise ValueError(f"q has {draft.q.shape[-1]} columns for a support of {draft.support.shape[0]} ids")
