"""Running a job in vLLM from this environment: find a Python that has vLLM, hand it the job, read the result.

vLLM pins its own transformers (the CPU build 0.32 wants < 5.20; this project runs on 5.2x), so it lives
in its own virtual environment: ``.venv-vllm`` at the repository root (docs/serving.md gives the
commands that make it), another one named by ``DRAFTSMITH_VLLM_PYTHON``, or this interpreter when vLLM
imports here. The job runs in a subprocess (:mod:`train.vllm.worker`), whose result is JSON.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["VllmNotInstalledError", "VllmRunError", "find_vllm_python", "run_vllm_job", "vllm_available"]

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
ENV_VAR = "DRAFTSMITH_VLLM_PYTHON"
INSTALL_HINT = (
    "make the vLLM environment with `bash scripts/install_vllm.sh` (docs/serving.md; on GPUs: "
    "python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm), or name its Python in "
    f"{ENV_VAR}"
)


class VllmNotInstalledError(RuntimeError):
    """No Python with vLLM was found."""


class VllmRunError(RuntimeError):
    """vLLM ran and failed; the message ends with the tail of its output, ``reason`` is its last error line
    (what vLLM said it refused, e.g. a method its CPU build's model runner does not support)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message.splitlines()[0]


def error_line(lines: Sequence[str]) -> str:
    """The last line of ``lines`` that states an error (``...Error: ...`` or pydantic's ``Value error,
    ...``), without pydantic's ``[type=...]`` details; "" when none does."""
    for line in reversed(lines):
        text = line.strip()
        if re.search(r"(Error|Exception|error)[:,] ", text) and not text.startswith("Traceback"):
            return re.sub(r"\s*\[type=[^\]]*\]?.*$", "", text)
    return ""


def find_vllm_python(environ: Mapping[str, str] = os.environ, root: Path = REPO_ROOT) -> str | None:
    """The Python that runs vLLM jobs: ``$DRAFTSMITH_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python``,
    else this interpreter when vLLM is importable here, else None. A named Python that does not exist
    raises :class:`VllmNotInstalledError` (a typo should not fall back silently)."""
    named = environ.get(ENV_VAR)
    if named:
        if not Path(named).is_file():
            raise VllmNotInstalledError(f"{ENV_VAR}={named}: no such file")
        return named
    venv = root / ".venv-vllm" / "bin" / "python"
    if venv.is_file():
        return str(venv)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return None


def vllm_available(environ: Mapping[str, str] = os.environ) -> bool:
    try:
        return find_vllm_python(environ) is not None
    except VllmNotInstalledError:
        return False


def _worker_env(python: str, kv_cache_gb: float) -> dict[str, str]:
    env = dict(os.environ)
    # the CPU build's KV cache, in GiB (its default takes a share of this machine's 24 GiB per engine)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gb:g}")
    # vLLM's CPU build wants Intel's OpenMP preloaded for speculative decoding (it warns and runs slower
    # without); the intel-openmp wheel it depends on puts it in the environment's lib/
    iomp = (
        Path(os.path.abspath(python)).parent.parent / "lib" / "libiomp5.so"
    )  # the venv, not its base Python
    if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def run_vllm_job(
    job: Mapping[str, Any],
    python: str | None = None,
    timeout: float = 1800.0,
    kv_cache_gb: float = 2.0,
    log_file: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run one job (:mod:`train.vllm.worker`'s format) in vLLM and return its result.

    python: the interpreter (None: :func:`find_vllm_python`). log_file: where vLLM's own output goes
    (None: a temporary file, quoted in the error when the job fails)."""
    python = python or find_vllm_python()
    if python is None:
        raise VllmNotInstalledError(f"vLLM is not installed: {INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(dict(job)))
        out_path = Path(log_file) if log_file is not None else Path(tmp) / "vllm.log"
        out_path.parent.mkdir(parents=True, exist_ok=True)
        env = _worker_env(python, kv_cache_gb)
        if "cuda_device" in job:  # the job's GPU, as an index into the GPUs this process sees
            visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
            index = int(job["cuda_device"])
            env["CUDA_VISIBLE_DEVICES"] = visible[index] if index < len(visible) else str(index)
        start = time.perf_counter()
        with open(out_path, "a", encoding="utf-8") as out:
            proc = subprocess.run(
                [python, str(WORKER), str(job_path), str(result_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=timeout,
                check=False,
            )
        log.info("vLLM job (%s) took %.0f s", job.get("mode", "decode"), time.perf_counter() - start)
        if proc.returncode != 0 or not result_path.is_file():
            tail = out_path.read_text(errors="replace").splitlines()[-25:]
            raise VllmRunError(
                f"vLLM exited with code {proc.returncode} ({python}); its output ends:\n" + "\n".join(tail),
                error_line(tail),
            )
        result: dict[str, Any] = json.loads(result_path.read_text())
        return result
