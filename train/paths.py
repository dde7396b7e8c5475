"""Where the project's default paths resolve, whatever the working directory.

``paths.root_dir`` (conf/paths/default.yaml) is ``${draftsmith_root:}``: the ``DRAFTSMITH_ROOT``
environment variable when set, else the checkout that holds this package (the folder with
``train.py`` and ``conf/``). Data, the tiny pair and run directories live under it, so
``python /path/to/draftsmith/scripts/evaluate.py`` from any directory finds the cached pair instead of
rebuilding it under the current directory. Paths given on the command line (``model.drafter=./x``)
keep their usual meaning, relative to the current directory.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from omegaconf import OmegaConf

from train.hardware import best_dtype

__all__ = ["PROJECT_ROOT", "fitting_dirname", "project_root", "register_resolvers"]

PROJECT_ROOT = Path(__file__).resolve().parents[1]
ROOT_VARIABLE = "DRAFTSMITH_ROOT"


def project_root() -> str:
    """``$DRAFTSMITH_ROOT`` if set, else the checkout holding the ``train`` package."""
    return os.environ.get(ROOT_VARIABLE) or str(PROJECT_ROOT)


MAX_DIRNAME = 120
"""Characters of a sweep point's folder name (file systems allow 255 bytes per name)."""


def fitting_dirname(name: str, limit: int = MAX_DIRNAME) -> str:
    """A sweep point's folder name (its overrides) cut to ``limit`` characters: a long one keeps its
    start and ends with a hash of the whole, so points stay distinct. The point's ``config.yaml`` has
    every override in full."""
    name = str(name)
    if len(name) <= limit:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[: limit - len(digest) - 1]}-{digest}"


def register_resolvers() -> None:
    """Make ``${draftsmith_root:}``, ``${fitting_dirname:...}``, ``${best_dtype:}`` and ``${best_precision:}``
    available to every config (idempotent)."""
    if not OmegaConf.has_resolver("draftsmith_root"):
        OmegaConf.register_new_resolver("draftsmith_root", project_root)
    if not OmegaConf.has_resolver("fitting_dirname"):
        OmegaConf.register_new_resolver("fitting_dirname", fitting_dirname)
    if not OmegaConf.has_resolver("best_dtype"):
        OmegaConf.register_new_resolver("best_dtype", _best_dtype)
    if not OmegaConf.has_resolver("best_precision"):
        OmegaConf.register_new_resolver("best_precision", _best_precision)


def _best_dtype() -> str:
    """``${best_dtype:}``: bfloat16 where the machine computes it natively, else float32."""
    return best_dtype()


def _best_precision() -> str:
    """``${best_precision:}``: Lightning's ``bf16-mixed`` where bfloat16 is native (float32 weights, bf16
    matrix products), else ``32-true``."""
    return "bf16-mixed" if best_dtype() == "bfloat16" else "32-true"


register_resolvers()
