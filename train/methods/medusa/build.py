"""How the medusa method's module and data are built from its settings and the run's pair (the
arrows run one way: build -> module -> finish -> config)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning as L

from train.config import require
from train.data.datamodule import packed_corpus
from train.data.lm import document_token_ids
from train.data.sources import load_text_dataset
from train.methods.medusa.config import MedusaConfig
from train.methods.medusa.module import MedusaModule
from train.methods.run_spec import RunSpec
from train.models.draft_vocab import frequent_tokens
from train.models.heads import MedusaHeads
from train.models.loading import ModelPair
from train.rundir import newest_artifact_of
from train.training.answer_data import answer_batches, answer_eos_ids
from train.training.answer_sources import method_answers

log = logging.getLogger(__name__)


def build(cfg: MedusaConfig, pair: ModelPair, spec: RunSpec) -> tuple[MedusaModule, L.LightningDataModule]:
    """Heads from ``init_heads`` or the pair's verifier (its lm_head), trained on packed ``spec.data``."""
    verifier, tokenizer = pair.verifier, pair.tokenizer
    answers = None
    if cfg.answers is not None:
        answers = method_answers(cfg, pair, spec, cfg.answer_prompt_len)
        data: L.LightningDataModule = answer_batches(
            answers, verifier, tokenizer, cfg.batch_size, cfg.max_len, spec.seed, cfg.prompt_loss
        )
    else:
        data = packed_corpus(spec.data, tokenizer, cfg.seq_len, cfg.batch_size, spec.seed)

    def training_documents() -> list[list[int]]:
        if answers is not None:
            return [list(a.prompt) + list(a.answer) for a in answers["train"]]
        return document_token_ids(load_text_dataset(spec.data, tokenizer)["train"], tokenizer)

    def target_tokens() -> list[list[int]]:  # what the heads learn to guess
        if answers is not None and not cfg.prompt_loss:
            return [list(a.answer) for a in answers["train"]]
        return training_documents()

    module = MedusaModule(
        verifier,
        build_heads(cfg, verifier, tokenizer, target_tokens, initial_heads(cfg, spec)),
        cfg,
        tokenizer,
        training_documents,
        seed=spec.seed,
    )
    return module, data


def initial_heads(cfg: MedusaConfig, spec: RunSpec) -> str | None:
    """``init_heads`` as a folder: ``auto`` is the newest Medusa-1 run's heads for this verifier
    (``experiment=medusa`` or ``medusa_tiny``), None (fresh heads, with a warning) when there is none."""
    if cfg.init_heads != "auto":
        return cfg.init_heads
    heads = newest_artifact_of(
        spec.paths.checkpoints_dir, ("medusa", "medusa_tiny"), spec.model.verifier, "heads"
    )
    if heads is None:
        log.warning(
            "method.init_heads=auto: no Medusa-1 run of %s under %s; the heads start fresh (run "
            "`python train.py experiment=medusa` first to start from trained heads, as the authors do)",
            spec.model.verifier,
            spec.paths.checkpoints_dir,
        )
    else:
        log.info("method.init_heads=auto: starting from %s", heads)
    return heads


def build_heads(
    cfg: MedusaConfig,
    verifier: Any,
    tokenizer: Any,
    target_tokens: Callable[[], list[list[int]]],
    init: str | None = None,
) -> MedusaHeads:
    """``init`` (a heads/ folder or Hub id) loaded, or fresh heads from the verifier's lm_head, over the
    ``draft_vocab_size`` most frequent training tokens (eos among them) when set."""
    vocab = int(verifier.get_output_embeddings().weight.shape[0])
    if init is not None:
        heads = MedusaHeads.from_pretrained(init)
        require(
            heads.num_heads == cfg.num_heads
            and heads.num_layers == cfg.num_layers
            and heads.vocab_size == vocab,
            "method.init_heads",
            f"heads with num_heads={cfg.num_heads}, num_layers={cfg.num_layers} and this verifier's "
            f"vocabulary ({vocab})",
            f"{init} (num_heads={heads.num_heads}, num_layers={heads.num_layers}, "
            f"vocab_size={heads.vocab_size})",
        )
        return heads
    ids = None
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size < vocab:
        always = answer_eos_ids(verifier, tokenizer)
        ids = frequent_tokens(target_tokens(), cfg.draft_vocab_size, always=always)
    return MedusaHeads.from_verifier(verifier, cfg.num_heads, cfg.num_layers, draft_vocab=ids)
