"""What a method's build step receives: the validated configuration of one run (``train.py``'s config,
each group already built and checked by :mod:`train.cli.train_command`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig

from train.config import LoggerConfig, ModelConfig, PathsConfig, TrainerConfig
from train.data.sources import DataSourceConfig
from train.evaluation import EvalConfig

__all__ = ["RunSpec"]


@dataclass
class RunSpec:
    """The validated configuration of one run."""

    name: str
    seed: int
    paths: PathsConfig
    model: ModelConfig
    data: DataSourceConfig
    method: Any
    """The method's settings (its own dataclass, ``train/methods/<name>/config.py``)."""
    trainer: TrainerConfig
    logger: LoggerConfig
    callbacks: tuple[L.Callback, ...]
    """The ``callbacks`` group's callbacks, built once at start-up."""
    ckpt_path: str | None
    cfg: DictConfig
    eval: EvalConfig | None = None
    """The finish step's evaluation (the ``eval`` node); None when the config has none."""
    devices: tuple[torch.device | None, torch.device | None] = (None, None)
    """Where the finish step evaluates (``device``, ``drafter_device``); None: the device training ran on
    (``trainer.strategy.root_device``) and the verifier's."""

    @property
    def run_dir(self) -> str:
        return self.paths.run_dir

    @property
    def experiment_dir(self) -> str:
        return os.path.join(self.paths.checkpoints_dir, self.name)
