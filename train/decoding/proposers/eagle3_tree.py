"""The shape of an EAGLE-3 draft (:class:`Eagle3Tree`, validated once for the proposer and the decoder)
and the two pure helpers EAGLE-2's dynamic tree is built with: the ``total`` best nodes closed under
ancestors (:func:`select_nodes`) and the attention mask of a level of tree nodes fed after the committed
positions (:func:`node_mask`). :mod:`train.decoding.proposers.eagle3_proposer` drafts with them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from train.decoding.proposers.tree_proposers import check_sampled_tree
from train.renames import renamed_keywords

__all__ = ["Eagle3Tree", "node_mask", "select_nodes"]


def select_nodes(scores: Sequence[float], parents: Sequence[int], total: int) -> list[int]:
    """The ``total`` best nodes by score (ties: the lower index), closed under ancestors, in index
    order. Nodes are numbered parents first (``parents[i] < i``, -1 for the root's children)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    kept: set[int] = set()
    for i in order:
        if len(kept) >= total:
            break
        if parents[i] < 0 or parents[i] in kept:
            kept.add(i)
    return sorted(kept)


def node_mask(cached: int, width: int, seen: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """Boolean (1, 1, n, cached + width) mask of n tree nodes fed after ``cached`` committed positions
    and the tree's ``width`` expanded slots (these n included, last): node r sees every committed
    position and the slots ``seen[r]`` (its ancestors and itself), nothing else (True: attend)."""
    rows = [row for row, slots in enumerate(seen) for _ in slots]
    columns = [cached + j for slots in seen for j in slots]
    mask = torch.zeros(1, 1, len(seen), cached + width, dtype=torch.bool)
    mask[..., :cached] = True
    mask[0, 0, rows, columns] = True
    return mask.to(device)  # built on the host, one copy: not a device write per row


@renamed_keywords(top_k="branching")
@dataclass(frozen=True)
class Eagle3Tree:
    """The shape of an EAGLE-3 draft, shared by :class:`Eagle3Proposer` and the decoder that holds it
    (validated here): trees of at most ``total_tokens`` nodes and ``depth`` levels, each expanded level
    its ``branching`` best nodes, each node its ``branching`` best children (``branching=1``: a chain);
    ``sampled_chain``: at T > 0 a chain of ``depth`` tokens sampled from the drafter's logits divided by
    ``draft_temperature``; ``sampled_tree``: children per depth of a tree sampled at T > 0 without
    replacement (empty: not sampled)."""

    depth: int = 5
    branching: int = 8
    total_tokens: int = 32
    sampled_chain: bool = False
    draft_temperature: float = 1.0
    sampled_tree: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("depth", "branching", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        sampled = check_sampled_tree(self.sampled_tree) if self.sampled_tree else ()
        object.__setattr__(self, "sampled_tree", sampled)
        if sampled and self.sampled_chain:
            raise ValueError(
                "sampled_chain and sampled_tree exclude each other (a chain is sampled_tree [1, 1, ...])"
            )
        if isinstance(self.draft_temperature, bool) or not self.draft_temperature > 0:
            raise ValueError(f"draft_temperature must be > 0, got {self.draft_temperature!r}")
        object.__setattr__(self, "sampled_chain", bool(self.sampled_chain))
        object.__setattr__(self, "draft_temperature", float(self.draft_temperature))

    @classmethod
    def of(cls, sampled_tree: Sequence[int] | None, **settings: Any) -> Eagle3Tree:
        """The settings as a decoder config gives them (``sampled_tree`` None: not sampled; an empty
        list is refused)."""
        return cls(sampled_tree=check_sampled_tree(sampled_tree) or (), **settings)
