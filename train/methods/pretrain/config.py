"""The pretrain method's settings (conf/method/pretrain.yaml) and how they build its module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from train.config import require
from train.training.optim import check_optimizer


@dataclass
class PretrainConfig:
    """Hyperparameters of plain LM pretraining (``method=pretrain``)."""

    optimizer: Any
    scheduler: Any = None
    seq_len: int = 256
    batch_size: int = 16

    def __post_init__(self) -> None:
        check_optimizer("method", self.optimizer, self.scheduler)
        require(self.seq_len >= 8, "method.seq_len", ">= 8", self.seq_len)
        require(self.batch_size >= 1, "method.batch_size", ">= 1", self.batch_size)
