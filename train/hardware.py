"""What this machine computes natively (the dtype the real pair runs in by default), and how many of its
cores other processes leave free."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import psutil
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


def busy_cores_elsewhere(sample_seconds: float = 0.5) -> float:
    """How many cores the other processes of this machine kept busy over ``sample_seconds`` (CPU time
    of every process but this one, divided by the interval)."""
    others = [p for p in psutil.process_iter() if p.pid != os.getpid()]
    for p in others:
        try:
            p.cpu_percent(None)  # starts the process's interval
        except (psutil.Error, OSError):
            continue
    time.sleep(sample_seconds)
    busy = 0.0
    for p in others:
        try:
            busy += p.cpu_percent(None)
        except (psutil.Error, OSError):
            continue
    return busy / 100.0


def idle_cores(sample_seconds: float = 0.5) -> int:
    """The cores other processes leave free, at least 1: torch's intra-op threads on a core another
    process holds spin-wait for each other, which slowed the real pair's forwards by 10x and more
    (docs/evaluation.md, "Timing on a shared machine")."""
    cores = os.cpu_count() or 1
    return max(1, cores - math.ceil(busy_cores_elsewhere(sample_seconds) - 0.25))


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None
