"""Draft trees in one forward pass, and the tree verification step (ALGORITHMS.md section 5).

Tree attention: the nodes of a :class:`~train.decoding.draft.Draft` are fed after the tokens a model's
cache already holds; node i sits at position ``prefix + depth(i) - 1`` (its depth below the context)
and attends to the cached prefix, to the context tokens fed in the same call, to its ancestors and to
itself (:func:`tree_attention_mask`, :func:`tree_position_ids`). One forward scores every root-to-leaf
path; after verification :func:`~train.decoding.cache.keep_positions` compacts the accepted path's
entries into a contiguous cache.

:func:`verify_tree` walks the tree from the context: at each node the children are checked with the
greedy rule (T = 0: the child equal to the verifier's argmax, if any) or the multi-round rule
(:func:`~train.decoding.verification.recursive_rejection`, with the children's candidate kind:
i.i.d., without replacement or deterministic); an accepted child is descended into, a rejection emits
the correction token, a leaf emits a bonus token from p, and an accepted EOS ends the block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .draft import Draft
from .sampling import SamplingParams, expected_acceptance_per_position, sample_with_uniform, uniforms, warp
from .verification import recursive_rejection

__all__ = [
    "TreeVerdict",
    "ancestors",
    "sliding_window_mask",
    "tree_attention_mask",
    "tree_position_ids",
    "verify_tree",
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


class TreeVerdict:
    """The outcome of verifying one tree: the accepted ``path`` (node indices from the top), the
    ``next`` token (correction or bonus; None after an accepted EOS), ``tested`` depths and the sum of
    the expected acceptance of the first candidate at each tested node."""

    __slots__ = ("expected", "next", "path", "tested")

    def __init__(self, path: list[int], next_token: int | None, tested: int, expected: float) -> None:
        self.path, self.next, self.tested, self.expected = path, next_token, tested, expected


def verify_tree(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    eos: frozenset[int],
) -> TreeVerdict:
    """Verify ``draft`` against the verifier's logits (n + 1, V): row 0 after the context, row i + 1
    after node i. Siblings are checked as ``draft.kind`` says they were drawn (point masses when
    ``draft.q`` is None; ignored at T = 0). Uniforms come from ``generator`` on its own device."""
    children: dict[int, list[int]] = {}
    for i in sorted(range(len(draft)), key=lambda j: (draft.parents[j], draft.rank[j])):
        children.setdefault(draft.parents[i], []).append(i)
    path: list[int] = []
    node = -1
    expected = 0.0
    while True:
        kids = children.get(node, [])
        row = logits[node + 1]
        if params.greedy:
            target = int(row.argmax())
            match = next((c for c in kids if draft.tokens[c] == target), None)
            if match is None:
                return TreeVerdict(path, target, len(path) + (1 if kids else 0), expected)
            path.append(match)
            expected += 1.0
        else:
            p = warp(row, params)
            if not kids:
                return TreeVerdict(
                    path, int(sample_with_uniform(p, uniforms((), generator, p.device))), len(path), expected
                )
            u = uniforms(len(kids) + 1, generator, p.device)
            candidates = torch.tensor([draft.tokens[c] for c in kids], dtype=torch.long, device=p.device)
            q = None if draft.q is None else draft.q[kids[0]].to(p.device)
            rule = "deterministic" if q is None else draft.kind
            if q is not None:
                expected += float(expected_acceptance_per_position(p[None], q[None]).sum())
            else:  # a point-mass candidate is accepted with probability p(x)
                expected += float(p[candidates[0]])
            choice, token = recursive_rejection(p, candidates, q, rule, u[: len(kids)], u[len(kids)])
            if int(choice) < 0:
                return TreeVerdict(path, int(token), len(path) + 1, expected)
            path.append(kids[int(choice)])
        node = path[-1]
        if draft.tokens[node] in eos:
            return TreeVerdict(path, None, len(path), expected)
