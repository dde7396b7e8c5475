"""The mean divergence between verifier and drafter logits, with a gradient computed in closed form during
the forward pass, and the acceptance metric ``sum_v min(p, q)`` (conventions: :mod:`train.losses`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from train.losses.chunks import check_shapes, chunks, compute_dtype, selection
from train.losses.rows import DIVERGENCES, canonical, row_divergence, row_gradient, unknown_divergence
from train.renames import renamed_keywords

__all__ = ["DEFAULT_CHUNK_SIZE", "acceptance_from_logits", "divergence"]

DEFAULT_CHUNK_SIZE = 1024
"""Positions per chunk. At V = 152k a float32 (1024, V) intermediate is 0.62 GB and a chunk keeps several
alive at once (~5-6 GB for JSD); lower it on small accelerators (the loop's overhead is negligible)."""


def _validate(beta: float, temperature: float, chunk_size: int | None) -> None:
    if not 0.0 <= beta <= 1.0:  # also rejects NaN
        raise ValueError(f"beta must lie in [0, 1], got {beta!r}")
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")


# more than 8 parameters: what autograd.Function.forward passes on, positionally
def _mean_and_gradient(
    name: str,
    drafter_logits: Tensor,
    verifier_logits: Tensor,
    coords: Tensor | None,
    n: int,
    temperature: float,
    beta: float,
    chunk_size: int | None,
    want_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """The mean divergence over the n selected positions and, with ``want_grad``, its gradient w.r.t.
    ``drafter_logits`` (already divided by n), written chunk by chunk into one zero buffer shaped like
    ``drafter_logits``."""
    grad = torch.zeros_like(drafter_logits, memory_format=torch.contiguous_format) if want_grad else None
    total = torch.zeros(
        (), dtype=compute_dtype(drafter_logits, verifier_logits), device=drafter_logits.device
    )
    for chunk in chunks(drafter_logits, verifier_logits, coords, n, temperature, chunk_size):
        per_row = row_divergence(name, chunk.log_q, chunk.log_p, beta)
        total += per_row.sum()
        if grad is None:
            continue
        g = (row_gradient(name, chunk.log_q, chunk.log_p, beta, per_row, temperature) / n).to(grad.dtype)
        vocab = g.shape[-1]
        if chunk.index is None:
            grad.view(-1, grad.shape[-1]).narrow(0, chunk.start, chunk.length)[:, :vocab] = g
        else:
            grad[..., :vocab][tuple(i.to(grad.device) for i in chunk.index)] = g
    return total / n, grad


class _FusedDivergence(torch.autograd.Function):
    """Chunked divergence whose backward returns the gradient computed (in closed form) during forward."""

    # more than 8 parameters: autograd.Function.forward takes its inputs positionally
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        drafter_logits: Tensor,
        verifier_logits: Tensor,
        coords: Tensor | None,
        n: int,
        name: str,
        temperature: float,
        beta: float,
        chunk_size: int | None,
    ) -> Tensor:
        value, grad = _mean_and_gradient(
            name, drafter_logits, verifier_logits, coords, n, temperature, beta, chunk_size, True
        )
        # Kept as attributes, not save_for_backward, because backward scales the buffer in place.
        ctx.grad = grad
        ctx.applied = None  # the upstream factor already multiplied into ctx.grad (None: 1)
        return value

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        # Scaled in place: an out-of-place ``grad * grad_output`` would hold a second drafter-logit-sized
        # tensor at the start of the backward pass, usually a training step's memory peak. ``ctx.applied``
        # keeps a backward through a retained graph correct; ctx's reference to the returned buffer keeps
        # it safe from autograd's in-place accumulation.
        grad: Tensor = ctx.grad
        upstream = grad_output.detach()
        applied: Tensor | None = ctx.applied
        if applied is None:
            if not torch.equal(upstream, torch.ones_like(upstream)):
                grad.mul_(upstream)
                ctx.applied = upstream.clone()
        elif not torch.equal(upstream, applied):
            if torch.equal(applied, torch.zeros_like(applied)):
                raise RuntimeError(
                    "divergence: cannot backward again through a graph first run with a zero gradient"
                )
            grad.mul_(upstream / applied)
            ctx.applied = upstream.clone()
        return grad, None, None, None, None, None, None, None


@renamed_keywords(student_logits="drafter_logits", teacher_logits="verifier_logits")
def divergence(
    name: str,
    drafter_logits: Tensor,
    verifier_logits: Tensor,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    beta: float = 0.5,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Mean per-token divergence ``D(p || q)`` between verifier ``p`` and drafter ``q`` (DistillSpec eq. 1).

    Args:
        name: ``"fkl"``, ``"rkl"``, ``"jsd"`` or ``"tvd"`` (:mod:`train.losses.rows`; DistillSpec arXiv
            2310.08461 Sec. 4, GKD arXiv 2306.13649 Sec. 3).
        drafter_logits: ``(B, T, V_d)`` or ``(N, V_d)``, any float dtype; gradients flow here.
        verifier_logits: ``(B, T, V_v)`` or ``(N, V_v)``; detached. Compared over ``min(V_d, V_v)`` ids.
        mask: ``(B, T)`` / ``(N,)`` bool or 0/1; nonzero positions count. None: all positions.
        temperature: > 0; divides both logits before the softmax.
        beta: JSD's interpolation in ``[0, 1]`` (the other divergences ignore it), ``m = beta p +
            (1 - beta) q``; ``beta = 0`` is exactly FKL and ``beta = 1`` exactly RKL.
        chunk_size: selected positions processed at once (bounds the ``(chunk_size, V)`` float32
            intermediates); None: all of them in one piece.

    Returns:
        A 0-d tensor (float32, or float64 for float64 inputs): the mean over the selected tokens. An empty
        selection gives exactly 0 with an all-zero (finite) gradient w.r.t. ``drafter_logits``.

    Raises:
        ValueError: an unknown ``name`` (the message lists the allowed ones), ``beta`` outside ``[0, 1]``,
            a non-positive or non-finite ``temperature``, a bad ``chunk_size``, inconsistent shapes.
    """
    if name not in DIVERGENCES:
        raise unknown_divergence(name)
    _validate(beta, temperature, chunk_size)
    name = canonical(name, beta)
    check_shapes(drafter_logits, verifier_logits, mask)
    verifier_logits = verifier_logits.detach()
    coords, n = selection(drafter_logits, verifier_logits, mask)
    if n == 0:  # an exact 0, still attached to the drafter's graph: backward() gives an all-zero gradient
        return drafter_logits.narrow(-1, 0, 0).sum().to(compute_dtype(drafter_logits, verifier_logits))
    args = (drafter_logits, verifier_logits, coords, n, name, temperature, beta, chunk_size)
    if torch.is_grad_enabled() and drafter_logits.requires_grad:
        return _FusedDivergence.apply(*args)
    return _mean_and_gradient(
        name, drafter_logits, verifier_logits, coords, n, temperature, beta, chunk_size, False
    )[0]


@renamed_keywords(student_logits="drafter_logits", teacher_logits="verifier_logits")
@torch.no_grad()
def acceptance_from_logits(
    drafter_logits: Tensor,
    verifier_logits: Tensor,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """The mean over the selected tokens of ``sum_v min(p, q) = 1 - TVD(p, q)``: a metric, without gradient.

    The per-token acceptance probability of speculative sampling with drafter ``q`` and verifier ``p``
    (Leviathan et al. 2023, arXiv 2211.17192; DistillSpec arXiv 2310.08461). Shapes, masking, temperature
    and vocabularies as in :func:`divergence`; an empty mask gives 0. A detached 0-d tensor."""
    _validate(0.5, temperature, chunk_size)
    check_shapes(drafter_logits, verifier_logits, mask)
    coords, n = selection(drafter_logits, verifier_logits, mask)
    total = torch.zeros(
        (), dtype=compute_dtype(drafter_logits, verifier_logits), device=drafter_logits.device
    )
    if n == 0:
        return total
    for chunk in chunks(drafter_logits, verifier_logits, coords, n, temperature, chunk_size):
        total += torch.minimum(chunk.log_p.exp(), chunk.log_q.exp()).sum()
    return total / n
