"""The pairs draftsmith builds itself on first use: ``model=tiny`` and ``model=smollm2``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock, Timeout

from train.config import ModelConfig, TrainerConfig
from train.pairs.smollm2_pair import ensure_smol_pair
from train.pairs.tiny import ensure_tiny_pair

log = logging.getLogger(__name__)

T = TypeVar("T")


def ensure_built_pair(cfg: ModelConfig, trainer_cfg: TrainerConfig | None = None) -> dict[str, Any] | None:
    """Build the model config's pair when it is one of ours and is not cached yet; its manifest (None for
    a pair of existing models). One process builds at a time (:func:`alone`)."""
    if cfg.tiny is not None:
        tiny = cfg.tiny
        return alone(tiny.out_dir, lambda: ensure_tiny_pair(tiny, trainer_cfg))
    if cfg.smollm2 is not None:
        smol = cfg.smollm2
        return alone(smol.out_dir, lambda: ensure_smol_pair(smol))
    return None


def alone(out_dir: str, ensure: Callable[[], T]) -> T:
    """``ensure()`` while holding ``<out_dir>.lock``: a second run started while the first builds the pair
    waits (saying so), then finds the pair built and reuses it instead of building it again over it.

    The lock is a ``flock`` (the ``filelock`` package), as good as the filesystem's: on a shared mount
    without cluster-wide locks (NFS without lockd, Lustre with ``localflock``) it holds on one node only
    (docs/scale.md, "The pairs we build")."""
    folder = os.path.normpath(out_dir)
    Path(folder).parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(f"{folder}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.warning(
            "Another run is building the pair under %s; waiting for it (lock: %s).", folder, lock.lock_file
        )
        lock.acquire()
    try:
        return ensure()
    finally:
        lock.release()
