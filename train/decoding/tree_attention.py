"""Draft trees in one forward pass: tree attention masks and position ids (docs/trees.md).

Tree attention: the nodes of a :class:`~train.decoding.draft.Draft` are fed after the tokens a model's
cache already holds; node i sits at position ``prefix + depth(i) - 1`` (its depth below the context)
and attends to the cached prefix, to the context tokens fed in the same call, to its ancestors and to
itself (:func:`tree_attention_mask`, :func:`tree_position_ids`). One forward scores every root-to-leaf
path; after verification :func:`~train.decoding.cache.keep_positions` compacts the accepted path's
entries into a contiguous cache.

Verifying the scored tree is a rule: :func:`~train.decoding.rules.tree_walk.verify_tree`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "ancestors",
    "sliding_window_mask",
    "tree_attention_mask",
    "tree_position_ids",
]


def ancestors(parents: Sequence[int]) -> list[list[int]]:
    """For every node, its ancestors from the top (the node itself excluded)."""
    out: list[list[int]] = []
    for parent in parents:
        out.append([] if parent < 0 else [*out[parent], parent])
    return out


def tree_attention_mask(
    cached: int, context: int, parents: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive (1, 1, context + n, cached + context + n) mask for one forward of ``context`` committed
    tokens (causal among themselves) followed by the n tree nodes, after ``cached`` cached positions.

    0.0 where a query may attend, the dtype's minimum elsewhere. ``dtype`` should be the model's
    (attention adds the mask to its scores).
    """
    n = len(parents)
    rows = context + n
    allowed = torch.zeros(rows, cached + rows, dtype=torch.bool)
    allowed[:, :cached] = True
    allowed[:context, cached : cached + context] = torch.ones(context, context, dtype=torch.bool).tril()
    allowed[context:, cached : cached + context] = True
    for i, line in enumerate(ancestors(parents)):
        row = context + i
        allowed[row, cached + context + i] = True
        for a in line:
            allowed[row, cached + context + a] = True
    mask = torch.zeros(1, 1, rows, cached + rows, dtype=dtype)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


def tree_position_ids(cached: int, context: int, depths: Sequence[int]) -> torch.Tensor:
    """(1, context + n) positions: the context tokens continue the cache, node i sits at depth(i)
    below the last context token."""
    last = cached + context - 1
    return torch.tensor([[*range(cached, cached + context), *(last + d for d in depths)]], dtype=torch.long)


def sliding_window_mask(
    mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, window: int
) -> torch.Tensor:
    """``mask`` (1, 1, T, K) narrowed to a sliding window: the query at position i keeps the key at
    position j only when ``i - j < window`` (Hugging Face's ``sliding_window_overlay``, Mistral's window).

    Positions are the sequence positions the model sees (``tree_position_ids`` for tree nodes), so a node
    sees what it would see at the end of its own path. ``mask`` is additive (0.0 / the dtype's minimum)
    or boolean (True = attend); the result has the same kind. query_positions: (T,); key_positions: (K,).
    """
    near = (query_positions.reshape(-1, 1) - key_positions.reshape(1, -1)) < window
    if mask.dtype == torch.bool:
        return mask & near
    return mask.masked_fill(~near, torch.finfo(mask.dtype).min)
