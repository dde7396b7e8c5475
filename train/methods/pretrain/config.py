"""The pretrain method's settings (conf/method/pretrain.yaml) and how they build its module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L

from train.config import require
from train.data.datamodule import packed_corpus
from train.training.optim import check_optimizer

if TYPE_CHECKING:
    from train.methods.pretrain.module import PretrainModule


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

    def build(self, pair: Any, spec: Any) -> tuple[PretrainModule, L.LightningDataModule]:
        """Continued pretraining of the pair's drafter on ``spec.data`` (packed blocks)."""
        from train.methods.pretrain.module import PretrainModule  # noqa: I001 -- the module imports this config (a cycle)

        data = packed_corpus(spec.data, pair.tokenizer, self.seq_len, self.batch_size, spec.seed)
        return PretrainModule(pair.drafter, self), data
