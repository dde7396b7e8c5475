"""The multi-round rule at one tree node (SpecInfer; Recursive Speculative Decoding), docs/trees.md.

Siblings drawn i.i.d. from the drafter (SpecInfer), without replacement (RSD), or chosen
deterministically (Medusa/BPD top-k candidates: the rule then samples from p without replacement over
the candidates). Pure: the caller passes the uniforms, as for the chain rules
(:mod:`train.decoding.rules.chain`).
"""

from __future__ import annotations

import torch

from train.decoding.sampling import residual, sample_with_uniform

#: How a node's sibling candidates were produced (the proposal each was drawn from).
CANDIDATE_KINDS: tuple[str, ...] = ("iid", "without_replacement", "deterministic")


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
