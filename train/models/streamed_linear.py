"""Linear layers over a few rows at the memory limit, on CPUs in float32 (:func:`stream_small_linears`).

Checking k drafted tokens feeds the verifier k + 1 rows. In float32 on a CPU, ``F.linear`` over 2-8 rows
may take MKL's general GEMM path, which packs the weight on every call: on the 2-core AMD EPYC with AVX2 a
forward of SmolLM2-135M over 2-8 tokens took 1.7-1.9x a one-token forward, although the forward reads
the same 540 MB of weights whatever the row count up to ~16. The same product written ``weight @ x.T``
(the weight as the left operand, the few rows as a transposed right operand) takes MKL's streaming
kernel there, which reads the weight once: 2-4 rows cost 1.03x one row. Three rows are padded to four
(MKL's 3-column kernel is slower than its 4-column one). One row, padded to two, may stream too: on the
2-core AMD EPYC with AVX-512 the library's one-row product (a matrix-vector kernel) read SmolLM2's weights
at 10 GB/s and the two-column streamed one at 14-17 GB/s (the verifier's one-token forward in float32 63.5
ms against 35 ms, MKL limited to AVX2), so plain decoding itself gains most. Which product is faster
depends on the processor: on a Xeon with AVX-512 the library's own 2-3 row product cost 1.05-1.12x one
row and the streamed one 2x (docs/decoding.md, "What a check costs"). So the choice is measured, per row
count:

- ``DRAFTSMITH_CPU_LINEAR=auto`` (the default): layers are patched, but a row count streams only once
  the cost probe (:mod:`train.decoding.cost_probe`) has timed the verifier's forwards both ways on the
  machine at hand and found the streamed one faster for that count (:func:`set_stream_rows`);
- ``stream``: every count of 1-16 rows streams; ``library``: nothing is patched.

What changes and what does not:

- more than ``MAX_ROWS`` rows (prefill, training) run ``F.linear`` as before, bit for bit, and so does
  one row (plain decoding, the drafter's steps) unless the probe measured its streamed product faster (the
  drafter's rows are not chosen: only the verifier is probed);
- only inference: a call that records gradients, a GPU tensor or any dtype but float32 runs ``F.linear``;
- the streamed product sums in another order, so a k-token check is not bitwise equal to k one-token
  steps (neither was ``F.linear``'s GEMM path): logits differ by a few 1e-5; the greedy tests check the
  argmax (tests/decoding/test_streamed_linear.py, docs/decoding.md).
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "ALL_ROWS",
    "MAX_ROWS",
    "MIN_ROWS",
    "enabled",
    "mode",
    "set_stream_rows",
    "stream_rows",
    "stream_small_linears",
    "streamed_linear",
    "unstream_linears",
]

#: The row counts that may take the streamed product (inclusive).
MIN_ROWS, MAX_ROWS = 1, 16
ALL_ROWS = frozenset(range(MIN_ROWS, MAX_ROWS + 1))
#: Row counts padded up before the product: one row would take the matrix-vector kernel the streamed
#: product avoids, and MKL's kernel for 3 columns is slower than for 4.
PAD_TO = {1: 2, 3: 4}
MODES = ("auto", "stream", "library")
#: The attribute that marks a patched layer (the forward it replaced is the class's own).
_MARK = "_draftsmith_streamed"
#: The attribute of a patched model holding the row counts that stream (one set its layers share).
_ROWS = "_draftsmith_stream_rows"


def mode() -> str:
    """``DRAFTSMITH_CPU_LINEAR``: ``auto`` (default), ``stream`` or ``library`` (module docstring)."""
    value = os.environ.get("DRAFTSMITH_CPU_LINEAR", "auto").strip().lower()
    if value not in MODES:
        raise ValueError(f"DRAFTSMITH_CPU_LINEAR must be one of {MODES}, got {value!r}")
    return value


def enabled() -> bool:
    """Whether layers are patched at all (any mode but ``library``)."""
    return mode() != "library"


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``weight @ rows.T`` (rows padded per :data:`PAD_TO`)."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    pad = PAD_TO.get(n, n) - n
    if pad:
        rows = torch.cat([rows, rows[-1:].expand(pad, -1)])
    out = torch.mm(weight, rows.T).T
    # contiguous rows, as F.linear returns them: the attention after a projection takes its fused
    # kernel only on tensors whose last dimension is contiguous
    out = (out[:n] if pad else out).contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _takes_stream(x: torch.Tensor, weight: torch.Tensor, rows: set[int]) -> bool:
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return x.numel() // max(1, x.shape[-1]) in rows


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> Any:
    # a bound method, not a closure: a deep copy of the model rebinds it to the copied layer (and the
    # copied layers share one copied set of rows)
    if _takes_stream(x, self.weight, vars(self)[_ROWS]):
        return streamed_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def stream_small_linears(model: torch.nn.Module, rows: Iterable[int] | None = None) -> int:
    """Give every ``nn.Linear`` of ``model`` (plain ones, not subclasses such as LoRA's) the streamed
    product on CPU float32 inference for the row counts in one set the layers share: ``rows``, or by
    default every count of 1-16 under ``stream`` and none yet under ``auto`` (the cost probe sets them,
    :func:`set_stream_rows`). Idempotent; a no-op under ``library``. Returns how many layers it patched."""
    if not enabled():
        return 0
    shared: set[int] | None = vars(model).get(_ROWS)
    if shared is None:
        shared = set(ALL_ROWS) if mode() == "stream" else set()
        vars(model)[_ROWS] = shared
    if rows is not None:
        set_stream_rows(model, rows)
    patched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and not getattr(module, _MARK, False):
            vars(module)[_ROWS] = shared
            module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
            setattr(module, _MARK, True)
            patched += 1
    return patched


def set_stream_rows(model: torch.nn.Module, rows: Iterable[int]) -> bool:
    """The row counts that stream in ``model``'s patched layers, from now on; False (nothing done) for a
    model :func:`stream_small_linears` did not patch."""
    shared: set[int] | None = vars(model).get(_ROWS)
    if shared is None:
        return False
    shared.clear()
    shared.update(int(n) for n in rows if MIN_ROWS <= int(n) <= MAX_ROWS)
    return True


def stream_rows(model: torch.nn.Module) -> frozenset[int] | None:
    """The row counts that stream in ``model`` (None: not patched)."""
    shared: set[int] | None = vars(model).get(_ROWS)
    return None if shared is None else frozenset(shared)


def unstream_linears(model: torch.nn.Module) -> int:
    """Undo :func:`stream_small_linears`; how many layers it restored."""
    restored = 0
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)
            vars(module).pop(_ROWS, None)
            restored += 1
    vars(model).pop(_ROWS, None)
    return restored
