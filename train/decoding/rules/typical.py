"""Medusa's typical acceptance: a lossy tree rule (Cai et al. 2024, docs/medusa.md).

At temperature T > 0 a drafted token x after a node whose verifier distribution is p is kept when
``p(x) > min(threshold, alpha * exp(-H(p)))`` (the authors' ``posterior_threshold`` 0.09 and
``posterior_alpha`` 0.3); the longest path of kept tokens wins (the first in node order on a tie,
i.e. the heads' top ranks), and the token after it is drawn from p restricted to the tokens above that
same bound. The output no longer follows the verifier's distribution: a report must say so
(``lossless`` is False on a decoder that uses it). At T = 0 decoders use the greedy rule instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.decoding.draft import Draft
from train.decoding.rules.rejection import LOSSLESS
from train.decoding.rules.verdict import Verdict
from train.decoding.sampling import SamplingParams, sample_with_uniform, uniforms, warp

__all__ = ["TypicalAcceptance", "typical_bound", "verify_typical"]


@dataclass(frozen=True)
class TypicalAcceptance:
    """The lossy rule with its settings: ``threshold`` (epsilon) and ``alpha`` (delta)."""

    threshold: float = 0.09
    alpha: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"posterior_threshold must be in (0, 1], got {self.threshold!r}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"posterior_alpha must be in (0, 1), got {self.alpha!r}")

    @property
    def lossless(self) -> bool:
        return False

    def verify(
        self,
        logits: torch.Tensor,
        draft: Draft,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
    ) -> Verdict:
        """The rule as the loops call it: typical acceptance at T > 0 over a non-empty draft; greedy
        verification and a block without drafts are the lossless rule's."""
        if params.greedy or not len(draft):
            return LOSSLESS.verify(logits, draft, params, generator, eos)
        return verify_typical(logits, draft, params, generator, eos, self)


def typical_bound(p: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """``min(threshold, alpha * exp(-H(p)))`` per row. p: (*, V) probabilities. Returns (*,).

    The argmax of p always clears it (max p >= exp(-H(p)) > alpha * exp(-H(p)))."""
    entropy = -(p * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(dim=-1)
    return torch.clamp(alpha * torch.exp(-entropy), max=threshold)


def verify_typical(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    eos: frozenset[int],
    rule: TypicalAcceptance,
) -> Verdict:
    """The typical rule over a chain or tree ``draft`` against the verifier's logits (n + 1, V): row 0
    after the context, row i + 1 after node i. ``tested`` counts the depths examined along the chosen
    path; ``expected`` sums p of the kept tokens (a lossy rule has no acceptance probability to report)."""
    p = warp(logits, params)  # (n + 1, V)
    bound = typical_bound(p, rule.threshold, rule.alpha)
    n = len(draft)
    kept_depth = [0] * n  # depth of node i when it and all its ancestors are kept, else 0
    best = -1
    if n:
        rows = torch.tensor([parent + 1 for parent in draft.parents], device=p.device)
        tokens = torch.tensor(draft.tokens, device=p.device)
        prob = p[rows, tokens]
        kept = (prob > bound[rows]).tolist()
        for i, parent in enumerate(draft.parents):
            if not kept[i]:
                continue
            if parent >= 0 and (kept_depth[parent] == 0 or draft.tokens[parent] in eos):
                continue
            kept_depth[i] = 1 if parent < 0 else kept_depth[parent] + 1
            if best < 0 or kept_depth[i] > kept_depth[best]:
                best = i
    path: list[int] = []
    node = best
    while node >= 0:
        path.append(node)
        node = draft.parents[node]
    path.reverse()
    has_children = set(draft.parents)
    tested = len(path) + (1 if (path[-1] if path else -1) in has_children else 0)
    expected = float(sum(float(p[draft.parents[i] + 1, draft.tokens[i]]) for i in path))
    row = p[path[-1] + 1] if path else p[0]
    truncated = torch.where(row > typical_bound(row, rule.threshold, rule.alpha), row, torch.zeros_like(row))
    truncated = truncated / truncated.sum()
    token = int(sample_with_uniform(truncated, uniforms((), generator, p.device)))
    return Verdict(path, token, tested, expected)
