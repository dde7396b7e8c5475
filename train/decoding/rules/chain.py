"""Chain verification rules: pure functions from the verifier's distributions over a draft to a verdict.

No rule draws random numbers itself: the caller passes uniforms (from
:func:`train.decoding.sampling.uniforms`), so each rule is a deterministic function that a test can
drive with millions of draws at once. Shapes: ``V`` the vocabulary, ``k`` the chain's length, ``m``
the number of sibling candidates, ``*`` any batch dimensions.

- :func:`greedy_chain`: temperature 0; keep the longest prefix equal to the verifier's argmax.
- :func:`passes` (the acceptance test of one draft) and :func:`correction` (the token after the
  accepted drafts): the two steps of rejection sampling, docs/decoding.md (Leviathan et al.; Chen et
  al.), with the lossy DistillSpec lenience f(p, eps) (eps = 1 is lossless).
- :func:`chain_rejection`: both, batched over any number of chains (what the exact-law tests drive).
- :func:`verify_chain`: both, walked along one chain from the verifier's logits, warping its rows only
  up to the first rejection (the loops call it).

The multi-round rule for trees is :mod:`train.decoding.rules.recursive`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from train.decoding.draft import Draft
from train.decoding.rules.verdict import Verdict
from train.decoding.sampling import (
    SamplingParams,
    apply_lenience,
    compact_residual_mass,
    draw_index,
    expected_acceptance_per_position,
    greedy_ids,
    residual_mass,
    sample_with_uniform,
    uniforms,
    warp,
)

__all__ = [
    "accepted_length",
    "chain_rejection",
    "correction",
    "greedy_chain",
    "passes",
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


def passes(
    u: torch.Tensor, q_x: torch.Tensor, p_x: torch.Tensor, lenience: str | None, eps: float
) -> torch.Tensor:
    """The acceptance test of a drafted token x: ``u * q(x) < f(p(x), eps)``, i.e. U < min(1, f(p)/q).

    All three any (matching) shape; computed in float64, where the product of two float32 values is
    exact, so the batched rule and the one-chain walk of :func:`verify_chain` decide alike."""
    return u.double() * q_x.double() < apply_lenience(p_x.double(), lenience, eps)


def correction(p_n: torch.Tensor, q_n: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """The token emitted after the accepted drafts: drawn from norm(max(0, p_n - q_n)) after a
    rejection, from p_n itself when every draft passed (``q_n`` None, or a zero row). (*, V) -> (*,)."""
    return sample_with_uniform(p_n if q_n is None else residual_mass(p_n, q_n), u)


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

    Draft token i is accepted while it :func:`passes`. At the first rejection n the next token is drawn
    from norm(max(0, p_n - q_n)); when all k pass, from p_k (the bonus token): :func:`correction`.
    Returns (n, next), both (*,) long. With eps = 1 every emitted token is distributed exactly as the
    verifier's p.
    """
    k = draft.shape[-1]
    idx = draft.unsqueeze(-1)
    p_x = p[..., :k, :].gather(-1, idx).squeeze(-1)
    q_x = q.gather(-1, idx).squeeze(-1)
    n = accepted_length(passes(u_accept, q_x, p_x, lenience, eps))
    row = n.view(*n.shape, 1, 1).expand(*n.shape, 1, p.shape[-1])
    p_n = p.gather(-2, row).squeeze(-2)
    if k == 0:
        return n, correction(p_n, None, u_next)
    # the rejected draft's proposal; a zero row where every draft passed (the bonus token's "residual")
    q_n = q.gather(-2, row.clamp(max=k - 1)).squeeze(-2) * (n < k).unsqueeze(-1)
    return n, correction(p_n, q_n, u_next)


def verify_chain(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    lenience: str | None = None,
    eps: float = 1.0,
) -> Verdict:
    """Apply the chain rule to the verifier's logits (k + 1, V) over a chain draft of k tokens.

    Greedy (T = 0): :func:`greedy_chain` on the argmaxes. Sampling: the decisions of
    :func:`chain_rejection` (the same arithmetic, token for token) on the warped distributions, with
    k + 1 uniforms drawn from ``generator`` (on its own device). A deterministic draft (``draft.q is
    None``) under sampling is verified against point masses; a compact q (``draft.support``) on its
    support alone.

    In the loop this runs once per block, right after a forward has left the caches cold, where every
    tensor operation costs several microseconds beyond its arithmetic: the walk warps the verifier's rows
    only as far as the first rejection, and single values are compared as Python floats (docs/decoding.md,
    "The loop's own cost").
    """
    k = len(draft)
    if params.greedy:
        n, nxt = greedy_chain(draft.tokens, greedy_ids(logits).tolist())
        # one-hot p and q: expected acceptance is 1 where the argmaxes agree (all accepted positions)
        return Verdict(list(range(n)), nxt, min(n + 1, k), float(n))
    u = uniforms(k + 1, generator).tolist()
    if k == 0:
        return Verdict([], draw_index(warp(logits[0], params), u[0]), 0, 0.0)
    tokens = draft.tokens
    if draft.q is None:  # a deterministic draft (prompt lookup): point masses, no (k, V) rows built
        return _verify_point_masses(logits, tokens, params, u, lenience, eps)
    q = draft.q.to(logits.device)
    support = None if draft.support is None else draft.support.to(logits.device)
    columns = tokens if draft.columns is None else draft.columns
    p_rows: list[torch.Tensor] = []
    n = 0
    while n <= k:
        p_rows.append(warp(logits[n], params))
        if n == k or not _passes_one(
            u[n], float(q[n, columns[n]]), float(p_rows[n][tokens[n]]), lenience, eps
        ):
            break
        n += 1
    tested = min(n + 1, k)
    expected = sum(
        float(expected_acceptance_per_position(_on(p_rows[i], support), q[i], lenience, eps))
        for i in range(tested)
    )
    if n == k:
        return Verdict(list(range(n)), draw_index(p_rows[k], u[k]), tested, expected)
    rest = (
        residual_mass(p_rows[n], q[n]) if support is None else compact_residual_mass(p_rows[n], q[n], support)
    )
    return Verdict(list(range(n)), draw_index(rest, u[k]), tested, expected)


def _on(p_row: torch.Tensor, support: torch.Tensor | None) -> torch.Tensor:
    """p restricted to a compact q's support (q is zero elsewhere, where min(q, f(p)) adds nothing)."""
    return p_row if support is None else p_row.index_select(0, support)


def _passes_one(u: float, q_x: float, p_x: float, lenience: str | None, eps: float) -> bool:
    """:func:`passes` for one draft, on Python floats: float64 arithmetic either way (a float32 value is
    exact in float64, and so is the product of two of them), so the decision is :func:`passes`'s."""
    if lenience is None or eps == 1.0:
        return u * q_x < p_x
    as_tensor = torch.tensor([u, q_x, p_x], dtype=torch.float64)
    return bool(passes(as_tensor[0], as_tensor[1], as_tensor[2], lenience, eps))


def _verify_point_masses(
    logits: torch.Tensor,
    tokens: Sequence[int],
    params: SamplingParams,
    u: list[float],
    lenience: str | None,
    eps: float,
) -> Verdict:
    """:func:`verify_chain` for a chain drafted with q = one-hot on each token, without forming q: the
    test is ``u < f(p(x))``, the expected acceptance ``min(1, f(p(x)))``, and the residual after a
    rejection ``max(0, p - onehot(x))``, i.e. p with x's mass removed (bit for bit what the dense rule
    computes: p(v) - 0 elsewhere, p(x) - 1 <= 0 clamped to 0)."""
    k = len(tokens)
    n, expected = 0, 0.0
    while True:
        p_row = warp(logits[n], params)
        if n == k:  # every draft passed: the bonus token from p_k
            return Verdict(list(range(k)), draw_index(p_row, u[k]), k, expected)
        p_x = float(p_row[tokens[n]])
        f_p = (
            p_x
            if lenience is None or eps == 1.0
            else float(apply_lenience(torch.tensor(p_x, dtype=torch.float64), lenience, eps))
        )
        expected += min(1.0, f_p)
        if not _passes_one(u[n], 1.0, p_x, lenience, eps):
            rest = p_row.clone()
            rest[tokens[n]] = 0.0
            return Verdict(
                list(range(n)), draw_index(rest if bool(rest.sum() > 0) else p_row, u[k]), n + 1, expected
            )
        n += 1
