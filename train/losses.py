"""Token-level distillation divergences for training drafters (DistillSpec / GKD).

DistillSpec (Zhou et al., ICLR 2024, arXiv 2310.08461) trains a drafter q_theta to minimise

    E_{(x, y) ~ G} [ mean_t D( p(. | x, y_<t) || q_theta(. | x, y_<t) ) ]

over the continuation tokens y, where p is the (frozen) target/verifier model.  GKD (Agarwal et al.,
arXiv 2306.13649) supplies the generalised Jensen-Shannon divergence and its beta convention.  Notation
throughout: ``p`` is the **teacher** (verifier) distribution and ``q`` the **student** (drafter).

==========  ===========================================================================
name        per-token formula
==========  ===========================================================================
``"fkl"``   forward KL, ``KL(p || q) = sum_v p log(p / q)``  (mode-covering)
``"rkl"``   reverse KL, ``KL(q || p) = sum_v q log(q / p)``  (mode-seeking)
``"jsd"``   ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``;
            ``beta = 0`` is *defined* as FKL and ``beta = 1`` as RKL (GKD's convention, special-cased;
            the mixture formula itself tends to 0 at both ends, so the family is discontinuous there)
``"tvd"``   total variation, ``1/2 sum_v |p - q|``; ``1 - TVD = sum_v min(p, q)`` is the expected
            acceptance rate of speculative sampling (Leviathan et al. 2023, Thm 3.5)
==========  ===========================================================================

Conventions shared by every function here
-----------------------------------------
* **Shapes.**  Logits are ``(B, T, V)`` or ``(N, V)`` (any leading shape works); ``mask`` has the
  leading shape (``(B, T)`` or ``(N,)``), bool or 0/1, and nonzero entries select the continuation
  tokens that count.  ``mask=None`` selects every position.
* **Reduction.**  A 0-d tensor: the mean over *selected tokens* of the batch (longer continuations weigh
  more than under a per-sequence ``1/|y|`` mean; a one-token mask gives other weightings).  With an **empty mask** the result is an exact 0
  that is still connected to ``student_logits``' graph, so ``backward()`` works and yields an all-zero
  gradient (no NaN from 0/0).
* **Temperature** divides both logits before the softmax.  No ``T**2`` gradient rescaling is applied.
* **Vocabulary mismatch.**  When teacher and student vocab sizes differ (same tokenizer, embeddings padded
  to different multiples) both are compared over the common prefix ``V = min(V_s, V_t)``: the extra
  (padding) logits are dropped *before* the softmax, so each side is renormalised over the shared ids and
  the student's padding logits receive zero gradient.
* **Numerics.**  Everything is computed in log space (``log_softmax``; the JSD mixture as
  ``log m = logaddexp(log p + log beta, log q + log(1 - beta))``, the two-term ``logsumexp``) in at least
  float32 (bf16/fp16 inputs are upcast per chunk; float64 stays float64).  Log-probabilities are clamped
  below at the dtype's most negative finite value, which makes ``0 * log 0 = 0`` hold exactly and keeps
  values and gradients finite (no NaN) when probabilities underflow or logits are ``-inf``.  The only
  non-finite results are the mathematically infinite ones, e.g. RKL when the teacher gives *exactly* zero
  probability (logit ``-inf``) to a token the student supports: huge (~3e38) or ``inf`` (use ``-1e4``).
  Tiny negative values (~1e-7) for ``D(p, p)`` are rounding, left unclamped (the gradient stays exact).
* **Memory.**  Nothing is gathered or flattened up front (non-contiguous inputs such as ``logits[:, :-1]``
  are not copied): the selected positions are processed in chunks of ``chunk_size`` rows, each upcast and
  reduced on its own.  With a gradient, the closed-form gradient w.r.t. the student logits
  (:func:`_rowwise_grad`) is written chunk by chunk into one buffer shaped like ``student_logits`` during
  the forward pass; ``backward`` returns it, scaled in place by the incoming gradient.  Peak extra memory is therefore one
  student-logit-sized gradient -- which autograd needs anyway -- plus ``O(chunk_size * V)`` float32
  intermediates, regardless of ``B * T``, with no recomputation (per-chunk checkpointing without its
  copies; the price is no double backward, which distillation never needs).
* The teacher is always detached; no gradient ever flows into ``teacher_logits``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DIVERGENCES",
    "divergence",
    "acceptance_from_logits",
]

#: Names accepted by :func:`divergence`.
DIVERGENCES: tuple[str, ...] = ("fkl", "rkl", "jsd", "tvd")

#: Positions per chunk.  At V = 152k a float32 (1024, V) intermediate is 0.62 GB and a chunk keeps several
#: alive at once (~5-6 GB for JSD); lower it on small accelerators -- the loop overhead is negligible.
DEFAULT_CHUNK_SIZE = 1024


# --------------------------------------------------------------------------------------------------------
# validation and preparation
# --------------------------------------------------------------------------------------------------------


def _validate(name: str, beta: float, temperature: float, chunk_size: int | None) -> None:
    if name not in DIVERGENCES:
        raise ValueError(
            f"unknown divergence {name!r}; allowed values are {', '.join(map(repr, DIVERGENCES))}"
        )
    if not 0.0 <= beta <= 1.0:  # also rejects NaN
        raise ValueError(f"beta must lie in [0, 1], got {beta!r}")
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")


def _check_shapes(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None) -> None:
    if student_logits.dim() < 2 or teacher_logits.dim() < 2:
        raise ValueError(
            "logits must have shape (B, T, V) or (N, V); got "
            f"student {tuple(student_logits.shape)}, teacher {tuple(teacher_logits.shape)}"
        )
    if student_logits.shape[:-1] != teacher_logits.shape[:-1]:
        raise ValueError(
            "student and teacher logits disagree on the leading (position) shape: "
            f"{tuple(student_logits.shape[:-1])} vs {tuple(teacher_logits.shape[:-1])}"
        )
    if student_logits.shape[-1] < 1 or teacher_logits.shape[-1] < 1:
        raise ValueError("vocabulary size must be at least 1")
    if mask is not None and mask.shape != student_logits.shape[:-1]:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal the logits' leading shape {tuple(student_logits.shape[:-1])}"
        )


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _log_probs(logits: Tensor, temperature: float, vocab: int, dtype: torch.dtype) -> Tensor:
    """(n, V') logits -> (n, vocab) log-probabilities over the common prefix, clamped to be finite."""
    x = logits[..., :vocab].to(dtype)
    if temperature != 1.0:
        x = x / temperature
    # clamp(-inf) -> finfo.min: keeps exp() == 0 exactly while every difference of two log-probs stays
    # finite, so 0 * log(0 / q) == 0 and no NaN reaches the gradient.  The clamp passes gradient 0 only at
    # entries whose probability is exactly 0, where the true gradient is 0 anyway.
    return torch.log_softmax(x, dim=-1).clamp(min=torch.finfo(dtype).min)


def _rowwise(name: str, log_q: Tensor, log_p: Tensor, beta: float) -> Tensor:
    """Per-row divergence from log-probabilities: (..., V) x (..., V) -> (...).  ``log_q`` student, ``log_p`` teacher."""
    if name == "jsd":
        if beta == 0.0:
            name = "fkl"
        elif beta == 1.0:
            name = "rkl"
    if name == "fkl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if name == "rkl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if name == "jsd":
        # log m = logsumexp(log p + log beta, log q + log(1 - beta)); logaddexp is the two-term logsumexp
        # without materialising a stacked (2, n, V) tensor.
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
        kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
        kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
        return beta * kl_pm + (1.0 - beta) * kl_qm
    if name == "tvd":
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    raise ValueError(f"unknown divergence {name!r}; allowed values are {', '.join(map(repr, DIVERGENCES))}")


def _rowwise_grad(
    name: str, log_q: Tensor, log_p: Tensor, beta: float, rows: Tensor, temperature: float
) -> Tensor:
    """Closed-form d(row divergence)/d(student logits) for (n, V) log-probs; ``rows`` = :func:`_rowwise` output.

    With ``q = softmax(z / T)`` and ``dq_j/dz_k = q_j (delta_jk - q_k) / T`` (all verified against autograd
    in float64 by the tests):

    * FKL: ``(q - p) / T``
    * RKL: ``q (log q - log p - RKL) / T``
    * JSD(beta): ``(1 - beta) q (log q - log m - KL(q || m)) / T`` (the ``p``-terms cancel)
    * TVD: ``q (s - sum_j q_j s_j) / T`` with ``s = sign(q - p) / 2`` (sign(0) = 0, as autograd's ``abs``).
    """
    if name == "jsd":
        if beta == 0.0:
            name = "fkl"
        elif beta == 1.0:
            name = "rkl"
    q = log_q.exp()
    if name == "fkl":
        g = q - log_p.exp()
    elif name == "rkl":
        g = q * (log_q - log_p - rows.unsqueeze(-1))
    elif name == "jsd":
        log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
        kl_qm = (q * (log_q - log_m)).sum(-1, keepdim=True)
        g = (1.0 - beta) * q * (log_q - log_m - kl_qm)
    elif name == "tvd":
        sgn = 0.5 * torch.sign(q - log_p.exp())
        g = q * (sgn - (q * sgn).sum(-1, keepdim=True))
    else:
        raise ValueError(
            f"unknown divergence {name!r}; allowed values are {', '.join(map(repr, DIVERGENCES))}"
        )
    return g / temperature if temperature != 1.0 else g


def _chunks(n: int, coords: Tensor | None, step: int) -> Iterator[tuple[int, int, tuple[Tensor, ...] | None]]:
    """Yield (start, length, index tuple or None) covering the n selected positions in pieces of ``step``.

    ``coords`` is ``(n, ndim - 1)`` (``mask.nonzero()``) or None for "every position, in flat order".
    """
    for start in range(0, n, step):
        length = min(step, n - start)
        yield start, length, None if coords is None else tuple(coords[start : start + length].unbind(1))


def _take(logits: Tensor, start: int, length: int, index: tuple[Tensor, ...] | None) -> Tensor:
    """(length, V) rows of ``logits`` (..., V): a view when ``index`` is None, else a gather of those rows."""
    if index is None:
        return logits.view(-1, logits.shape[-1]).narrow(0, start, length)
    return logits[tuple(i.to(logits.device) for i in index)]


def _chunked(
    name: str,
    student: Tensor,
    teacher: Tensor,
    coords: Tensor | None,
    n: int,
    temperature: float,
    beta: float,
    chunk_size: int | None,
    want_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """Mean divergence over the selected positions of (..., V_s), (..., V_t) logits, optionally with its gradient.

    The gradient (w.r.t. ``student``, already divided by ``n``) is written chunk by chunk into one
    zero-initialised buffer shaped like ``student`` (its dtype), so peak memory is that buffer plus one
    chunk's (chunk_size, V) float32 intermediates.  Inputs are never copied as a whole, even when they
    are non-contiguous slices such as ``logits[:, :-1]``.
    """
    dtype = _compute_dtype(student, teacher)
    vocab = min(student.shape[-1], teacher.shape[-1])
    grad = torch.zeros_like(student, memory_format=torch.contiguous_format) if want_grad else None
    total = torch.zeros((), dtype=dtype, device=student.device)
    step = n if chunk_size is None else int(chunk_size)
    for start, length, index in _chunks(n, coords, step):
        log_q = _log_probs(_take(student, start, length, index), temperature, vocab, dtype)
        log_p = _log_probs(_take(teacher, start, length, index), temperature, vocab, dtype)
        per_row = _rowwise(name, log_q, log_p, beta)
        total += per_row.sum()
        if grad is not None:
            g = (_rowwise_grad(name, log_q, log_p, beta, per_row, temperature) / n).to(grad.dtype)
            if index is None:
                grad.view(-1, grad.shape[-1]).narrow(0, start, length)[:, :vocab] = g
            else:
                grad[..., :vocab][tuple(i.to(grad.device) for i in index)] = g
    return total / n, grad


class _FusedDivergence(torch.autograd.Function):
    """Chunked divergence whose backward returns a gradient computed (in closed form) during forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        student: Tensor,
        teacher: Tensor,
        coords: Tensor | None,
        n: int,
        name: str,
        temperature: float,
        beta: float,
        chunk_size: int | None,
    ) -> Tensor:
        value, grad = _chunked(
            name, student, teacher, coords, n, temperature, beta, chunk_size, want_grad=True
        )
        # Kept as attributes, not save_for_backward, because backward scales the buffer in place.
        ctx.grad = grad
        ctx.applied = None  # upstream factor already multiplied into ctx.grad (None = 1)
        return value

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        # Scale in place: an out-of-place ``grad * grad_output`` would hold a second student-logit-sized
        # tensor at the start of the backward pass, which is usually a training step's memory peak.
        # ``ctx.applied`` keeps backward through a retained graph correct.  The returned buffer is safe
        # from autograd's in-place accumulation because ctx keeps a reference to it.
        grad: Tensor = ctx.grad
        go = grad_output.detach()
        applied: Tensor | None = ctx.applied
        if applied is None:
            if not torch.equal(go, torch.ones_like(go)):
                grad.mul_(go)
                ctx.applied = go.clone()
        elif not torch.equal(go, applied):
            if torch.equal(applied, torch.zeros_like(applied)):
                raise RuntimeError(
                    "divergence: cannot backward again through a graph first run with a zero gradient"
                )
            grad.mul_(go / applied)
            ctx.applied = go.clone()
        return grad, None, None, None, None, None, None, None


def _viewable(x: Tensor) -> bool:
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return False
    return True


def _selection(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor | None
) -> tuple[Tensor | None, int]:
    """Selected positions as ``(n, ndim - 1)`` coordinates (None = all, both flat-viewable) and their count n."""
    lead = student_logits.shape[:-1]
    if mask is None:
        if _viewable(student_logits) and _viewable(teacher_logits):
            return None, math.prod(lead)
        mask = torch.ones(lead, dtype=torch.bool, device=student_logits.device)
    coords = mask.to(device=student_logits.device).nonzero()
    return coords, int(coords.shape[0])


# --------------------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------------------


def divergence(
    name: str,
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    beta: float = 0.5,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Mean per-token divergence ``D(p || q)`` between teacher ``p`` and student ``q`` (DistillSpec eq. 1).

    Args:
        name: one of ``"fkl"``, ``"rkl"``, ``"jsd"``, ``"tvd"`` (see the module docstring for formulas;
            DistillSpec arXiv 2310.08461 Sec. 4, GKD arXiv 2306.13649 Sec. 3).
        student_logits: ``(B, T, V_s)`` or ``(N, V_s)``, any float dtype; gradients flow here.
        teacher_logits: ``(B, T, V_t)`` or ``(N, V_t)``; detached.  Compared over ``min(V_s, V_t)`` ids.
        mask: ``(B, T)`` / ``(N,)`` bool or 0/1; nonzero positions count.  ``None`` = all positions.
        temperature: > 0; divides both logits before the softmax.
        beta: JSD interpolation in ``[0, 1]`` (ignored by the other divergences); ``m = beta p + (1-beta) q``,
            ``beta = 0`` is exactly FKL and ``beta = 1`` exactly RKL.
        chunk_size: selected positions processed at once (bounds the ``(chunk_size, V)`` float32
            intermediates); ``None`` processes all selected positions in one piece.

    Returns:
        0-d tensor (float32, or float64 for float64 inputs): the mean over selected tokens.  An empty
        selection gives exactly 0 with an all-zero (finite) gradient w.r.t. ``student_logits``.

    Raises:
        ValueError: unknown ``name`` (message lists the allowed values), ``beta`` outside ``[0, 1]``,
            non-positive/non-finite ``temperature``, bad ``chunk_size`` or inconsistent shapes.
    """
    _validate(name, beta, temperature, chunk_size)
    _check_shapes(student_logits, teacher_logits, mask)
    teacher_logits = teacher_logits.detach()
    dtype = _compute_dtype(student_logits, teacher_logits)
    coords, n = _selection(student_logits, teacher_logits, mask)
    if n == 0:
        # Exact 0, still attached to the student's graph: backward() gives an all-zero gradient.
        return student_logits.narrow(-1, 0, 0).sum().to(dtype)
    if torch.is_grad_enabled() and student_logits.requires_grad:
        return _FusedDivergence.apply(
            student_logits, teacher_logits, coords, n, name, temperature, beta, chunk_size
        )
    return _chunked(name, student_logits, teacher_logits, coords, n, temperature, beta, chunk_size, False)[0]


@torch.no_grad()
def acceptance_from_logits(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Mean over selected tokens of ``sum_v min(p, q) = 1 - TVD(p, q)`` -- a metric, computed without grad.

    This is the per-token acceptance probability of speculative sampling with drafter ``q`` and verifier
    ``p`` (Leviathan et al. 2023, arXiv 2211.17192; DistillSpec arXiv 2310.08461).  Shapes, masking,
    temperature and vocab handling as in :func:`divergence`; an empty mask gives 0.  Returns a detached
    0-d tensor.
    """
    _validate("tvd", 0.5, temperature, chunk_size)
    _check_shapes(student_logits, teacher_logits, mask)
    dtype = _compute_dtype(student_logits, teacher_logits)
    vocab = min(student_logits.shape[-1], teacher_logits.shape[-1])
    coords, n = _selection(student_logits, teacher_logits, mask)
    total = torch.zeros((), dtype=dtype, device=student_logits.device)
    if n == 0:
        return total
    step = n if chunk_size is None else int(chunk_size)
    for start, length, index in _chunks(n, coords, step):
        q = _log_probs(_take(student_logits, start, length, index), temperature, vocab, dtype).exp()
        p = _log_probs(_take(teacher_logits, start, length, index), temperature, vocab, dtype).exp()
        total += torch.minimum(p, q).sum()
    return total / n
