"""Chain verification rules: pure functions from the verifier's distributions over a draft to a verdict.

No rule draws random numbers itself: the caller passes uniforms (from
:func:`train.decoding.sampling.uniforms`), so each rule is a deterministic function that a test can
drive with millions of draws at once. Shapes: ``V`` the vocabulary, ``k`` the chain's length, ``m``
the number of sibling candidates, ``*`` any batch dimensions.

- :func:`greedy_chain`: temperature 0; keep the longest prefix equal to the verifier's argmax.
- :func:`chain_rejection`: docs/decoding.md (Leviathan et al.; Chen et al.), with the lossy
  DistillSpec lenience f(p, eps) (eps = 1 is lossless).
- :func:`verify_chain`: applies them to the verifier's logits over a chain draft (the loops call it).

The multi-round rule for trees is :mod:`train.decoding.rules.recursive`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from train.decoding.draft import Draft
from train.decoding.sampling import (
    SamplingParams,
    apply_lenience,
    expected_acceptance_per_position,
    greedy_ids,
    residual,
    sample_with_uniform,
    uniforms,
    warp,
)

__all__ = [
    "ChainVerdict",
    "accepted_length",
    "chain_rejection",
    "greedy_chain",
    "verify_chain",
]


def accepted_length(accept: torch.Tensor) -> torch.Tensor:
    """Leading True values per row. accept: (*, k) bool. Returns (*,) long (k when all pass)."""
    if accept.shape[-1] == 0:
        return torch.zeros(accept.shape[:-1], dtype=torch.long, device=accept.device)
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def greedy_chain(draft: Sequence[int], verifier_argmax: Sequence[int]) -> tuple[int, int]:
    """Longest match at temperature 0.

    draft: k token ids; verifier_argmax: k + 1 ids, the verifier's argmax after the context and after
    each draft token. Returns (n, next): n accepted draft tokens and the verifier's token after them
    (its correction at the first mismatch, its bonus token when all match). Plain Python on purpose:
    k is small and this runs once per block, where tensor ops would cost more than the comparison.
    """
    n = 0
    k = len(draft)
    while n < k and draft[n] == verifier_argmax[n]:
        n += 1
    return n, int(verifier_argmax[n])


def chain_rejection(
    p: torch.Tensor,
    q: torch.Tensor,
    draft: torch.Tensor,
    u_accept: torch.Tensor,
    u_next: torch.Tensor,
    lenience: str | None = None,
    eps: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain rejection sampling over a drafted chain.

    p: (*, k + 1, V) warped verifier distributions (after the context and after each draft token);
    q: (*, k, V) the proposals the draft tokens were drawn from; draft: (*, k) long;
    u_accept: (*, k) and u_next: (*,) uniforms in [0, 1).

    Draft token i is accepted while ``u_i * q_i(x_i) < f(p_i(x_i), eps)`` (i.e. U < min(1, f(p)/q)).
    At the first rejection n the next token is drawn from norm(max(0, p_n - q_n)); when all k pass,
    from p_k (the bonus token). Returns (n, next), both (*,) long. With eps = 1 every emitted token is
    distributed exactly as the verifier's p.
    """
    k = draft.shape[-1]
    idx = draft.unsqueeze(-1)
    p_x = p[..., :k, :].gather(-1, idx).squeeze(-1)
    q_x = q.gather(-1, idx).squeeze(-1)
    n = accepted_length(u_accept.to(p_x.dtype) * q_x < apply_lenience(p_x, lenience, eps))
    # q padded with a zero row: at n == k the "residual" of p_k against nothing is p_k itself.
    q_pad = torch.cat([q, torch.zeros_like(p[..., :1, :])], dim=-2)
    pick = n.view(*n.shape, 1, 1).expand(*n.shape, 1, p.shape[-1])
    p_n = p.gather(-2, pick).squeeze(-2)
    q_n = q_pad.gather(-2, pick).squeeze(-2)
    return n, sample_with_uniform(residual(p_n, q_n), u_next)


class ChainVerdict:
    """The outcome of verifying one chain: ``accepted`` drafts, the ``next`` token, ``tested``
    positions and the sum of their expected acceptance."""

    __slots__ = ("accepted", "expected", "next", "tested")

    def __init__(self, accepted: int, next_token: int, tested: int, expected: float) -> None:
        self.accepted, self.next, self.tested, self.expected = accepted, next_token, tested, expected


def verify_chain(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    lenience: str | None = None,
    eps: float = 1.0,
) -> ChainVerdict:
    """Apply the chain rule to the verifier's logits (k + 1, V) over a chain draft of k tokens.

    Greedy (T = 0): :func:`greedy_chain` on the argmaxes. Sampling: :func:`chain_rejection` on the
    warped distributions, with k + 1 uniforms drawn from ``generator`` (on its own device). A
    deterministic draft (``draft.q is None``) under sampling is verified against point masses.
    """
    k = len(draft)
    if params.greedy:
        n, nxt = greedy_chain(draft.tokens, greedy_ids(logits).tolist())
        # one-hot p and q: expected acceptance is 1 where the argmaxes agree (all accepted positions)
        return ChainVerdict(n, nxt, min(n + 1, k), float(n))
    p = warp(logits, params)
    u = uniforms(k + 1, generator, p.device)
    if k == 0:
        return ChainVerdict(0, int(sample_with_uniform(p[0], u[0])), 0, 0.0)
    drafted = torch.tensor(draft.tokens, dtype=torch.long, device=p.device)
    if draft.q is None:
        q = torch.zeros(k, p.shape[-1], dtype=p.dtype, device=p.device).scatter_(1, drafted[:, None], 1.0)
    else:
        q = draft.q.to(p.device)
    n_t, next_t = chain_rejection(p, q, drafted, u[:k], u[k], lenience, eps)
    n = int(n_t)
    tested = min(n + 1, k)
    expected = float(expected_acceptance_per_position(p[:tested], q[:tested], lenience, eps).sum())
    return ChainVerdict(n, int(next_t), tested, expected)
