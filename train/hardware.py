"""What this machine computes natively: the dtype the real pair runs in by default."""

from __future__ import annotations

from pathlib import Path

import torch


def best_dtype() -> str:
    """``bfloat16`` where this machine computes it natively (CUDA with bf16, or a CPU with AVX512-BF16
    or AMX), else ``float32``: the dtype the real pair runs in by default."""
    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
