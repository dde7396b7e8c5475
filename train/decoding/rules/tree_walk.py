"""Verifying a draft tree: walk it from the context, one node's children at a time (docs/trees.md).

:func:`verify_tree` checks the children of each node with the greedy rule (T = 0: the child equal to
the verifier's argmax, if any) or the multi-round rule
(:func:`~train.decoding.rules.recursive.recursive_rejection`, with the children's candidate kind:
i.i.d., without replacement or deterministic); an accepted child is descended into, a rejection emits
the correction token, a leaf emits a bonus token from p, and an accepted EOS ends the block.
"""

from __future__ import annotations

import torch

from train.decoding.draft import Draft
from train.decoding.rules.recursive import recursive_rejection
from train.decoding.rules.verdict import Verdict
from train.decoding.sampling import (
    SamplingParams,
    expected_acceptance_per_position,
    greedy_ids,
    sample_with_uniform,
    uniforms,
    warp,
)


def verify_tree(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    eos: frozenset[int],
) -> Verdict:
    """Verify ``draft`` against the verifier's logits (n + 1, V): row 0 after the context, row i + 1
    after node i. Siblings are checked as ``draft.kind`` says they were drawn (point masses when
    ``draft.q`` is None; ignored at T = 0). Uniforms come from ``generator`` on its own device."""
    draft_q = draft.dense_q(logits.shape[-1])  # a compact q (a chain's) placed over the vocabulary
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
            target = int(greedy_ids(row))
            match = next((c for c in kids if draft.tokens[c] == target), None)
            if match is None:
                return Verdict(path, target, len(path) + (1 if kids else 0), expected)
            path.append(match)
            expected += 1.0
        else:
            p = warp(row, params)
            if not kids:
                return Verdict(
                    path, int(sample_with_uniform(p, uniforms((), generator, p.device))), len(path), expected
                )
            u = uniforms(len(kids) + 1, generator, p.device)
            candidates = torch.tensor([draft.tokens[c] for c in kids], dtype=torch.long, device=p.device)
            q = None if draft_q is None else draft_q[kids[0]].to(p.device)
            rule = "deterministic" if q is None else draft.kind
            if q is not None:
                expected += float(expected_acceptance_per_position(p[None], q[None]).sum())
            else:  # a point-mass candidate is accepted with probability p(x)
                expected += float(p[candidates[0]])
            choice, token = recursive_rejection(p, candidates, q, rule, u[: len(kids)], u[len(kids)])
            if int(choice) < 0:
                return Verdict(path, int(token), len(path) + 1, expected)
            path.append(kids[int(choice)])
        node = path[-1]
        if draft.tokens[node] in eos:
            return Verdict(path, None, len(path), expected)
