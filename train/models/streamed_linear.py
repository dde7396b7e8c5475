"""Linear layers over a few rows at the memory limit, on CPUs in float32 (:func:`stream_small_linears`).

Checking k drafted tokens feeds the verifier k + 1 rows. In float32 on a CPU, ``F.linear`` over 2-8 rows
takes MKL's general GEMM path, which packs the weight on every call: on the 2-core AVX2 machine a
forward of SmolLM2-135M over 2-8 tokens took 1.7-1.9x a one-token forward, although the forward reads
the same 540 MB of weights whatever the row count up to ~16 and the arithmetic of 8 rows is a few
milliseconds. The same product written ``weight @ x.T`` (the weight as the left operand, the few rows
as a transposed right operand) takes MKL's streaming kernel, which reads the weight once: measured over
SmolLM2-135M's 211 weight matrices, 2 and 4 rows cost less than one row through ``F.linear``
(``python scripts/bench.py verify-cost``, docs/decoding.md, "What a check costs"). Three rows are padded
to four (MKL's 3-column kernel is slower than its 4-column one).

What changes and what does not:

- one row (plain decoding, the drafter's steps) and more than ``MAX_ROWS`` rows (prefill, training) run
  ``F.linear`` as before, bit for bit;
- only inference: a call that records gradients, a GPU tensor or any dtype but float32 runs ``F.linear``;
- the streamed product sums in another order, so a k-token check is not bitwise equal to k one-token
  steps (neither was ``F.linear``'s GEMM path): logits differ by a few 1e-5; the greedy tests check the
  argmax (tests/decoding/test_streamed_linear.py, docs/decoding.md).

``DRAFTSMITH_CPU_LINEAR=library`` turns it off (every layer runs ``F.linear``).
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["MAX_ROWS", "MIN_ROWS", "enabled", "stream_small_linears", "streamed_linear", "unstream_linears"]

#: The row counts that take the streamed product (inclusive).
MIN_ROWS, MAX_ROWS = 2, 16
#: Row counts padded up before the product: MKL's kernel for 3 columns is slower than for 4.
PAD_TO = {3: 4}
#: The attribute that marks a patched layer (the forward it replaced is the class's own).
_MARK = "_draftsmith_streamed"


def enabled() -> bool:
    """Whether the streamed product is on (``DRAFTSMITH_CPU_LINEAR`` unset or ``stream``)."""
    value = os.environ.get("DRAFTSMITH_CPU_LINEAR", "stream").strip().lower()
    if value not in ("stream", "library"):
        raise ValueError(f"DRAFTSMITH_CPU_LINEAR must be 'stream' or 'library', got {value!r}")
    return value == "stream"


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


def _takes_stream(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return MIN_ROWS <= rows <= MAX_ROWS


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> Any:
    if _takes_stream(x, self.weight):
        return streamed_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def stream_small_linears(model: torch.nn.Module) -> int:
    """Give every ``nn.Linear`` of ``model`` (plain ones, not subclasses such as LoRA's) the streamed
    product for 2-16 rows on CPU float32 inference (module docstring). Idempotent; a no-op when
    :func:`enabled` is false. Returns how many layers it patched."""
    if not enabled():
        return 0
    patched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and not getattr(module, _MARK, False):
            module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
            setattr(module, _MARK, True)
            patched += 1
    return patched


def unstream_linears(model: torch.nn.Module) -> int:
    """Undo :func:`stream_small_linears`; how many layers it restored."""
    restored = 0
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)
            restored += 1
    return restored
