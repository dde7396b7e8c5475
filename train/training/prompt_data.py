"""The prompts a method trains on (DistillSpec, SD^2): the settings they share, checked, and their data
module built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from train.config import require
from train.data.datamodule import PromptDataModule
from train.data.sources import load_text_dataset
from train.losses import DIVERGENCES


def check_prompt_settings(cfg: Any) -> None:
    """Validate the prompt and continuation sizes a method config shares (``max_new_tokens``, ``prompt_len``,
    ``batch_size``, ``num_prompts``, ``num_val_prompts``); errors name ``method.<key>``."""
    require(cfg.max_new_tokens >= 1, "method.max_new_tokens", ">= 1", cfg.max_new_tokens)
    require(cfg.prompt_len >= 2, "method.prompt_len", ">= 2", cfg.prompt_len)
    require(cfg.batch_size >= 1, "method.batch_size", ">= 1", cfg.batch_size)
    require(
        cfg.num_prompts >= cfg.batch_size,
        "method.num_prompts",
        f">= method.batch_size ({cfg.batch_size})",
        cfg.num_prompts,
    )
    require(cfg.num_val_prompts >= 1, "method.num_val_prompts", ">= 1", cfg.num_val_prompts)


@dataclass(kw_only=True)
class RolloutDistillSettings:
    """What DistillSpec and SD^2 share: a drafter trained on continuations of prompts sampled during
    training (rollouts: the drafter's own or the verifier's answers), under a divergence from the verifier
    (their configs extend this)."""

    divergence: str = "fkl"
    """One of ``fkl``, ``rkl``, ``jsd``, ``tvd`` (:func:`train.losses.divergence`)."""
    beta: float = 0.5
    """JSD interpolation in [0, 1]; 0 is FKL, 1 is RKL (GKD's convention)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts, also the loss's softmax temperature; > 0."""
    max_new_tokens: int = 32
    prompt_len: int = 64
    batch_size: int = 16
    num_prompts: int = 1024
    """Training prompts cut from the corpus's train split."""
    num_val_prompts: int = 32
    """Held-out prompts (validation split) whose continuations are generated once per run."""
    gamma: int = 4
    """The chain length the drafter is meant for: DistillSpec's ``val/simulated_block_efficiency``, SD^2's
    guide staleness 1..gamma."""

    def check_rollout_settings(self) -> None:
        """Validate the shared settings; errors name ``method.<key>``."""
        require(self.divergence in DIVERGENCES, "method.divergence", f"one of {DIVERGENCES}", self.divergence)
        require(
            isinstance(self.beta, int | float) and 0.0 <= self.beta <= 1.0,
            "method.beta",
            "in [0, 1]",
            self.beta,
        )
        require(
            isinstance(self.temperature, int | float)
            and math.isfinite(self.temperature)
            and self.temperature > 0,
            "method.temperature",
            "> 0 (rollouts are sampled; greedy rollouts are not supported)",
            self.temperature,
        )
        check_prompt_settings(self)
        require(self.gamma >= 1, "method.gamma", ">= 1", self.gamma)


def prompt_data(cfg: Any, tokenizer: Any, data: Any, seed: int) -> PromptDataModule:
    """Training and held-out prompts of ``data`` (a data config) sized by ``cfg`` (see
    :func:`check_prompt_settings`), with the corpus continuations for sources that need them; its loaders use
    the data config's ``num_workers`` and ``pin_memory``."""
    return PromptDataModule(
        lambda: load_text_dataset(data, tokenizer),
        tokenizer,
        prompt_len=cfg.prompt_len,
        batch_size=cfg.batch_size,
        continuation_len=cfg.max_new_tokens,
        max_prompts=cfg.num_prompts,
        max_val_prompts=cfg.num_val_prompts,
        seed=seed,
        num_workers=data.num_workers,
        pin_memory=data.pin_memory,
    )
