"""How the eagle3 method's module and data are built from its settings and the run's pair (the
arrows run one way: build -> module -> finish -> config)."""

from __future__ import annotations

import lightning as L

from train.methods.eagle3.config import Eagle3Config
from train.methods.eagle3.module import Eagle3Module
from train.methods.run_spec import RunSpec
from train.models.loading import ModelPair
from train.training.feature_drafters import feature_drafter_data


def build(cfg: Eagle3Config, pair: ModelPair, spec: RunSpec) -> tuple[Eagle3Module, L.LightningDataModule]:
    """The verifier's answers (cached or generated, plus ``sampled_answers`` per training prompt), the
    draft vocabulary counted on the training answers, a fresh drafter on the pair's verifier (or
    ``init``), and the answers' batches."""
    answers, data = feature_drafter_data(cfg, pair, spec)
    drafter = cfg.drafter(pair.verifier, pair.tokenizer, answers["train"])
    comparison = pair.drafter if cfg.compare_pair_drafter else None
    return Eagle3Module(pair.verifier, drafter, cfg, pair.tokenizer, comparison=comparison), data
