"""How the eagle3 method's module and data are built from its settings and the run's pair (the
arrows run one way: build -> module -> finish -> config)."""

from __future__ import annotations

from typing import Any

import lightning as L

from train.config import ConfigError, require
from train.methods.eagle3.config import Eagle3Config
from train.methods.eagle3.module import Eagle3Module
from train.methods.run_spec import RunSpec
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.loading import ModelPair
from train.training.feature_drafters import feature_drafter_data


def build(cfg: Eagle3Config, pair: ModelPair, spec: RunSpec) -> tuple[Eagle3Module, L.LightningDataModule]:
    """The verifier's answers (cached or generated, plus ``sampled_answers`` per training prompt), the
    draft vocabulary counted on the training answers, a fresh drafter on the pair's verifier (or
    ``init``), and the answers' batches."""
    answers, data = feature_drafter_data(cfg, pair, spec)
    drafter = eagle3_drafter(cfg, pair.verifier, pair.tokenizer, answers["train"])
    comparison = pair.drafter if cfg.compare_pair_drafter else None
    return Eagle3Module(pair.verifier, drafter, cfg, pair.tokenizer, comparison=comparison), data


def eagle3_drafter(
    cfg: Eagle3Config, verifier: Any, tokenizer: Any, train_answers: list[Any]
) -> Eagle3Drafter:
    """``init`` loaded, or a fresh drafter over the ``draft_vocab_size`` most frequent answer tokens
    (the eos ids always among them)."""
    if cfg.init is not None:
        drafter = Eagle3Drafter.from_pretrained(cfg.init)
        require(
            drafter.vocab_size == int(verifier.config.vocab_size),
            "method.init",
            f"a drafter for a vocabulary of {verifier.config.vocab_size}",
            f"{cfg.init} (vocab_size={drafter.vocab_size})",
        )
        return drafter
    ids = cfg.draft_ids(verifier, tokenizer, train_answers)
    try:
        return Eagle3Drafter.from_verifier(verifier, aux_layers=cfg.aux_layers, draft_ids=ids)
    except ValueError as err:  # the layers do not fit this verifier
        raise ConfigError(f"method.aux_layers: {err}") from None
