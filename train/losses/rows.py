"""The divergences row by row, from log-probabilities, and their closed-form gradients w.r.t. the drafter's
logits. ``log_q`` is the drafter's, ``log_p`` the verifier's; both ``(n, V)``.

==========  ===========================================================================================
name        per-row formula
==========  ===========================================================================================
``fkl``     forward KL, ``KL(p || q) = sum_v p log(p / q)`` (mode-covering)
``rkl``     reverse KL, ``KL(q || p) = sum_v q log(q / p)`` (mode-seeking)
``jsd``     ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``; ``beta = 0`` is
            *defined* as FKL and ``beta = 1`` as RKL (GKD's convention: the mixture formula tends to 0 at
            both ends, so the family is discontinuous there; :func:`canonical` resolves the ends)
``tvd``     total variation, ``1/2 sum_v |p - q|``; ``1 - TVD = sum_v min(p, q)`` is the expected
            acceptance of speculative sampling (Leviathan et al. 2023, Thm 3.5)
==========  ===========================================================================================
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["DIVERGENCES", "canonical", "row_divergence", "row_gradient", "unknown_divergence"]

DIVERGENCES: tuple[str, ...] = ("fkl", "rkl", "jsd", "tvd")
"""Names accepted by :func:`train.losses.divergence`."""


def unknown_divergence(name: str) -> ValueError:
    """The error for a name that is not one of :data:`DIVERGENCES`."""
    return ValueError(f"unknown divergence {name!r}; allowed values are {', '.join(map(repr, DIVERGENCES))}")


def canonical(name: str, beta: float) -> str:
    """``name`` with JSD's ends resolved: ``jsd`` at beta 0 is ``fkl``, at beta 1 ``rkl``."""
    if name == "jsd" and beta in (0.0, 1.0):
        return "fkl" if beta == 0.0 else "rkl"
    return name


def _log_mixture(log_p: Tensor, log_q: Tensor, beta: float) -> Tensor:
    """``log m`` for ``m = beta p + (1 - beta) q``: the two-term logsumexp, without stacking a (2, n, V)
    tensor."""
    return torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """``KL(a || b)`` per row."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def row_divergence(name: str, log_q: Tensor, log_p: Tensor, beta: float) -> Tensor:
    """(..., V) x (..., V) -> (...): the divergence of each row; ``name`` as :func:`canonical` gives it."""
    if name == "fkl":
        return _kl(log_p, log_q)
    if name == "rkl":
        return _kl(log_q, log_p)
    if name == "jsd":
        log_m = _log_mixture(log_p, log_q, beta)
        return beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
    if name == "tvd":
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    raise unknown_divergence(name)


def row_gradient(
    name: str, log_q: Tensor, log_p: Tensor, beta: float, rows: Tensor, temperature: float
) -> Tensor:
    """d(row divergence) / d(drafter logits) for (n, V) log-probabilities; ``rows`` is
    :func:`row_divergence`'s output. With ``q = softmax(z / T)`` and ``dq_j/dz_k = q_j (delta_jk - q_k) / T``
    (each checked against autograd in float64 by the tests):

    * FKL: ``(q - p) / T``
    * RKL: ``q (log q - log p - RKL) / T``
    * JSD(beta): ``(1 - beta) q (log q - log m - KL(q || m)) / T`` (the ``p`` terms cancel)
    * TVD: ``q (s - sum_j q_j s_j) / T`` with ``s = sign(q - p) / 2`` (sign(0) = 0, as autograd's ``abs``)
    """
    q = log_q.exp()
    if name == "fkl":
        g = q - log_p.exp()
    elif name == "rkl":
        g = q * (log_q - log_p - rows.unsqueeze(-1))
    elif name == "jsd":
        log_m = _log_mixture(log_p, log_q, beta)
        g = (1.0 - beta) * q * (log_q - log_m - _kl(log_q, log_m).unsqueeze(-1))
    elif name == "tvd":
        sign = 0.5 * torch.sign(q - log_p.exp())
        g = q * (sign - (q * sign).sum(-1, keepdim=True))
    else:
        raise unknown_divergence(name)
    return g / temperature if temperature != 1.0 else g
