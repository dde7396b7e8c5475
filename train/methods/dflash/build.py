"""How the dflash method's module and data are built from its settings and the run's pair (the arrows
run one way: build -> module -> finish -> config)."""

from __future__ import annotations

import lightning as L

from train.methods.dflash.config import DFlashConfig
from train.methods.dflash.module import DFlashModule
from train.methods.run_spec import RunSpec
from train.models.loading import ModelPair
from train.training.feature_drafters import feature_drafter_data


def build(cfg: DFlashConfig, pair: ModelPair, spec: RunSpec) -> tuple[DFlashModule, L.LightningDataModule]:
    """The verifier's answers and their batches, a fresh drafter on the pair's verifier (or ``init``)."""
    answers, data = feature_drafter_data(cfg, pair, spec)
    drafter = cfg.drafter(pair.verifier, pair.tokenizer, answers["train"])
    comparison = pair.drafter if cfg.compare_pair_drafter else None
    return DFlashModule(pair.verifier, drafter, cfg, pair.tokenizer, comparison=comparison), data
