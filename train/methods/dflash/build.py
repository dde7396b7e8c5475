"""How the dflash method's module and data are built from its settings and the run's pair (the arrows
run one way: build -> module -> finish -> config)."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L

from train.config import ConfigError, require
from train.methods.dflash.config import DFlashConfig
from train.methods.dflash.module import DFlashModule
from train.methods.run_spec import RunSpec
from train.models.dflash_drafter import DFlashDrafter
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.loading import ModelPair
from train.rundir import newest_artifact_of
from train.training.answer_data import answer_eos_ids
from train.training.feature_drafters import feature_drafter_data
from train.training.optim import weights_dtype

log = logging.getLogger(__name__)


def build(cfg: DFlashConfig, pair: ModelPair, spec: RunSpec) -> tuple[DFlashModule, L.LightningDataModule]:
    """The verifier's answers and their batches, a fresh drafter on the pair's verifier (or ``init``)."""
    answers, data = feature_drafter_data(cfg, pair, spec)
    drafter = dflash_drafter(cfg, pair.verifier, pair.tokenizer, answers["train"])
    comparison = pair.drafter if cfg.compare_pair_drafter else None
    eagle3 = eagle3_to_compare(cfg, pair, spec)
    return DFlashModule(
        pair.verifier, drafter, cfg, pair.tokenizer, comparison=comparison, eagle3=eagle3
    ), data


def eagle3_to_compare(cfg: DFlashConfig, pair: ModelPair, spec: RunSpec) -> Eagle3Drafter | None:
    """The EAGLE-3 drafter ``cfg.compare_eagle3`` names (``auto``: the newest finished EAGLE-3 run of
    this verifier, or None with a line saying how to add one), in the verifier's dtype."""
    source = cfg.compare_eagle3
    if source == "auto":
        source = newest_artifact_of(
            spec.paths.checkpoints_dir, ("eagle3", "eagle3_tiny"), spec.model.verifier, "eagle3"
        )
        if source is None:
            log.info(
                "method.compare_eagle3=auto: no EAGLE-3 run of this verifier under %s; the finish step "
                "measures DFlash without it (run `python train.py experiment=eagle3` first to add it)",
                spec.paths.checkpoints_dir,
            )
            return None
    if source is None:
        return None
    eagle3 = Eagle3Drafter.from_pretrained(str(source)).eval()
    require(
        eagle3.vocab_size == int(pair.verifier.config.vocab_size),
        "method.compare_eagle3",
        "an EAGLE-3 drafter of this verifier",
        f"{source} (vocab_size={eagle3.vocab_size})",
    )
    log.info("The finish step measures the EAGLE-3 drafter %s beside DFlash", source)
    return eagle3.to(weights_dtype(pair.verifier))


def dflash_drafter(
    cfg: DFlashConfig, verifier: Any, tokenizer: Any, train_answers: list[Any]
) -> DFlashDrafter:
    """``init`` loaded, or a fresh drafter over the ``draft_vocab_size`` most frequent answer tokens."""
    vocab = int(verifier.config.vocab_size)
    if cfg.init is not None:
        drafter = DFlashDrafter.from_pretrained(cfg.init)
        require(
            drafter.vocab_size == vocab,
            "method.init",
            f"a drafter for a vocabulary of {vocab}",
            f"{cfg.init} (vocab_size={drafter.vocab_size})",
        )
        require(
            drafter.markov_rank == cfg.markov_rank,
            "method.markov_rank",
            f"the Markov rank of method.init's drafter ({drafter.markov_rank})",
            cfg.markov_rank,
        )
        return drafter
    require(
        cfg.mask_token_id is None or 0 <= cfg.mask_token_id < vocab,
        "method.mask_token_id",
        f"null or an id in [0, {vocab})",
        cfg.mask_token_id,
    )
    special = [*answer_eos_ids(verifier, tokenizer), *(getattr(tokenizer, "all_special_ids", None) or [])]
    try:
        return DFlashDrafter.from_verifier(
            verifier,
            num_layers=cfg.num_layers,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            aux_layers=cfg.aux_layers,
            draft_ids=cfg.draft_ids(verifier, tokenizer, train_answers),
            special_ids=special,
            markov_rank=cfg.markov_rank,
        )
    except ValueError as err:  # the layers do not fit this verifier
        raise ConfigError(f"method.aux_layers: {err}") from None
