"""How the pretrain method's module and data are built from its settings and the run's pair (the
arrows run one way: build -> module -> finish -> config)."""

from __future__ import annotations

import lightning as L

from train.data.datamodule import packed_corpus
from train.methods.pretrain.config import PretrainConfig
from train.methods.pretrain.module import PretrainModule
from train.methods.run_spec import RunSpec
from train.models.loading import ModelPair


def build(
    cfg: PretrainConfig, pair: ModelPair, spec: RunSpec
) -> tuple[PretrainModule, L.LightningDataModule]:
    """Continued pretraining of the pair's drafter on ``spec.data`` (packed blocks)."""
    data = packed_corpus(spec.data, pair.tokenizer, cfg.seq_len, cfg.batch_size, spec.seed)
    return PretrainModule(pair.drafter, cfg), data
