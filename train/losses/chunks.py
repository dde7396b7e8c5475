"""The selected positions of a pair of logit tensors, visited a chunk of rows at a time, as log-probabilities
over the shared vocabulary: what :func:`train.losses.divergence` and
:func:`train.losses.acceptance_from_logits` both iterate over."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Chunk", "check_shapes", "chunks", "compute_dtype", "selection"]


def check_shapes(drafter_logits: Tensor, verifier_logits: Tensor, mask: Tensor | None) -> None:
    """ValueError unless the logits share their leading shape, have a vocabulary, and ``mask`` matches."""
    q_shape, p_shape = tuple(drafter_logits.shape), tuple(verifier_logits.shape)
    if len(q_shape) < 2 or len(p_shape) < 2:
        raise ValueError(
            f"logits must have shape (B, T, V) or (N, V); got drafter {q_shape}, verifier {p_shape}"
        )
    if q_shape[:-1] != p_shape[:-1]:
        raise ValueError(
            "drafter and verifier logits disagree on the leading (position) shape: "
            f"{q_shape[:-1]} vs {p_shape[:-1]}"
        )
    if q_shape[-1] < 1 or p_shape[-1] < 1:
        raise ValueError("vocabulary size must be at least 1")
    if mask is not None and tuple(mask.shape) != q_shape[:-1]:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal the logits' leading shape {q_shape[:-1]}"
        )


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float32, or wider when an input is (float64 stays float64)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _viewable(x: Tensor) -> bool:
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return False
    return True


def selection(
    drafter_logits: Tensor, verifier_logits: Tensor, mask: Tensor | None
) -> tuple[Tensor | None, int]:
    """The selected positions as ``(n, ndim - 1)`` coordinates (None: every position, both tensors
    viewable flat) and their count n."""
    lead = drafter_logits.shape[:-1]
    if mask is None:
        if _viewable(drafter_logits) and _viewable(verifier_logits):
            return None, math.prod(lead)
        mask = torch.ones(lead, dtype=torch.bool, device=drafter_logits.device)
    coords = mask.to(device=drafter_logits.device).nonzero()
    return coords, int(coords.shape[0])


def _log_probs(logits: Tensor, temperature: float, vocab: int, dtype: torch.dtype) -> Tensor:
    """(n, V') logits -> (n, vocab) log-probabilities over the common prefix, clamped to be finite."""
    x = logits[..., :vocab].to(dtype)
    if temperature != 1.0:
        x = x / temperature
    # clamp(-inf) -> finfo.min: exp() is still exactly 0 while every difference of two log-probs stays
    # finite, so 0 * log(0 / q) == 0 and no NaN reaches the gradient. The clamp passes gradient 0 only at
    # entries whose probability is exactly 0, where the true gradient is 0 anyway.
    return torch.log_softmax(x, dim=-1).clamp(min=torch.finfo(dtype).min)


def _rows(logits: Tensor, start: int, length: int, index: tuple[Tensor, ...] | None) -> Tensor:
    """(length, V) rows of ``logits`` (..., V): a view when ``index`` is None, else a gather of those rows."""
    if index is None:
        return logits.view(-1, logits.shape[-1]).narrow(0, start, length)
    return logits[tuple(i.to(logits.device) for i in index)]


@dataclass
class Chunk:
    """``length`` selected rows from ``start``: their coordinates (``index``, None in flat order) and both
    sides' log-probabilities, ``(length, vocab)`` in the compute dtype."""

    start: int
    length: int
    index: tuple[Tensor, ...] | None
    log_q: Tensor
    log_p: Tensor


def chunks(
    drafter_logits: Tensor,
    verifier_logits: Tensor,
    coords: Tensor | None,
    n: int,
    temperature: float,
    chunk_size: int | None,
) -> Iterator[Chunk]:
    """The n selected positions (:func:`selection`) in pieces of ``chunk_size`` rows (None: one piece),
    each upcast to :func:`compute_dtype` over the shared vocabulary ``min(V_d, V_v)``."""
    dtype = compute_dtype(drafter_logits, verifier_logits)
    vocab = min(drafter_logits.shape[-1], verifier_logits.shape[-1])
    step = n if chunk_size is None else int(chunk_size)
    for start in range(0, n, step):
        length = min(step, n - start)
        index = None if coords is None else tuple(coords[start : start + length].unbind(1))
        log_q = _log_probs(_rows(drafter_logits, start, length, index), temperature, vocab, dtype)
        log_p = _log_probs(_rows(verifier_logits, start, length, index), temperature, vocab, dtype)
        yield Chunk(start, length, index, log_q, log_p)
