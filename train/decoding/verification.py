"""Verification rules: pure functions from the verifier's distributions over a draft to a verdict.

No rule draws random numbers itself: the caller passes uniforms (from
:func:`train.decoding.sampling.uniforms`), so each rule is a deterministic function that a test can
drive with millions of draws at once. Shapes: ``V`` the vocabulary, ``k`` the chain's length, ``m``
the number of sibling candidates, ``*`` any batch dimensions.

- :func:`greedy_chain`: temperature 0; keep the longest prefix equal to the verifier's argmax.
- :func:`chain_rejection`: ALGORITHMS.md section 1 (Leviathan et al.; Chen et al.), with the lossy
  DistillSpec lenience f(p, eps) (eps = 1 is lossless).
- :func:`recursive_rejection`: ALGORITHMS.md section 5, the multi-round rule at one tree node over
  sibling candidates drawn i.i.d. (SpecInfer), without replacement (RSD), or chosen deterministically
  (Medusa/BPD top-k candidates: it then samples from p without replacement over the candidates).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampling import apply_lenience, residual, sample_with_uniform

__all__ = [
    "CANDIDATE_KINDS",
    "accepted_length",
    "chain_rejection",
    "greedy_chain",
    "recursive_rejection",
    "sibling_proposal",
]

#: How a node's sibling candidates were produced (the proposal each was drawn from).
CANDIDATE_KINDS: tuple[str, ...] = ("iid", "without_replacement", "deterministic")


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


def sibling_proposal(q: torch.Tensor, earlier: torch.Tensor, kind: str) -> torch.Tensor:
    """The proposal Q_j the j-th sibling was drawn from, given the tokens of earlier siblings.

    q: (*, V) the parent's proposal distribution; earlier: (*, j) long, the siblings drawn before.
    ``iid``: q. ``without_replacement``: q with the earlier siblings removed, renormalised.
    ``deterministic`` is handled by the caller (a point mass on the candidate). Returns (*, V).
    """
    if kind == "iid" or earlier.shape[-1] == 0:
        return q
    if kind != "without_replacement":
        raise ValueError(f"sibling_proposal: kind must be 'iid' or 'without_replacement', got {kind!r}")
    removed = q.scatter(-1, earlier, 0.0)
    total = removed.sum(dim=-1, keepdim=True)
    return removed / torch.where(total > 0, total, torch.ones_like(total))


def recursive_rejection(
    p: torch.Tensor,
    candidates: torch.Tensor,
    q: torch.Tensor | None,
    kind: str,
    u_accept: torch.Tensor,
    u_next: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-round (recursive) rejection sampling at one tree node.

    p: (*, V) the verifier's warped distribution at the node; candidates: (*, m) long, the children in
    draw order; q: (*, V) the proposal they were drawn from (ignored, may be None, when
    ``kind == "deterministic"``); u_accept: (*, m), u_next: (*,) uniforms.

    r = p; for j = 1..m: accept x_j when ``u_j * Q_j(x_j) < r(x_j)``, else r = norm(max(0, r - Q_j)),
    with Q_j from :func:`sibling_proposal` (a point mass on x_j for deterministic candidates, where the
    residual is r with x_j removed). Returns (choice, token): choice (*,) long, the accepted child's
    index in ``candidates`` or -1 when every child was rejected; token (*,) long, the accepted
    candidate or a draw from the final residual. The emitted token is distributed exactly as p.
    """
    if kind not in CANDIDATE_KINDS:
        raise ValueError(f"recursive_rejection: kind must be one of {CANDIDATE_KINDS}, got {kind!r}")
    if kind != "deterministic" and q is None:
        raise ValueError(f"recursive_rejection: kind {kind!r} needs the proposal q")
    m = candidates.shape[-1]
    r = p
    batch = p.shape[:-1]
    choice = torch.full(batch, -1, dtype=torch.long, device=p.device)
    for j in range(m):
        x = candidates[..., j : j + 1]
        if kind == "deterministic":
            big_q = torch.zeros_like(p).scatter(-1, x, 1.0)
        else:
            assert q is not None
            big_q = sibling_proposal(q, candidates[..., :j], kind)
        r_x = r.gather(-1, x).squeeze(-1)
        q_x = big_q.gather(-1, x).squeeze(-1)
        open_ = choice < 0
        accept = open_ & (u_accept[..., j].to(r_x.dtype) * q_x < r_x)
        choice = torch.where(accept, torch.full_like(choice, j), choice)
        still_open = (open_ & ~accept).unsqueeze(-1)
        r = torch.where(still_open, residual(r, big_q), r)
    drawn = sample_with_uniform(r, u_next)
    picked = candidates.gather(-1, choice.clamp_min(0).unsqueeze(-1)).squeeze(-1) if m else drawn
    return choice, torch.where(choice >= 0, picked, drawn)
