"""The pairs draftsmith builds itself on first use: ``model=tiny`` and ``model=smollm2``."""

from __future__ import annotations

from typing import Any

from train.config import ModelConfig, TrainerConfig
from train.pairs.smollm2_pair import ensure_smol_pair
from train.pairs.tiny import ensure_tiny_pair


def ensure_built_pair(cfg: ModelConfig, trainer_cfg: TrainerConfig | None = None) -> dict[str, Any] | None:
    """Build the model config's pair when it is one of ours and is not cached yet; its manifest (None for
    a pair of existing models)."""
    if cfg.tiny is not None:
        return ensure_tiny_pair(cfg.tiny, trainer_cfg)
    if cfg.smollm2 is not None:
        return ensure_smol_pair(cfg.smollm2)
    return None
