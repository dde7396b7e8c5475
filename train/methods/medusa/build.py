"""How the medusa method's module and data are built from its settings and the run's pair (the
arrows run one way: build -> module -> finish -> config)."""

from __future__ import annotations

import lightning as L

from train.data.datamodule import packed_corpus
from train.data.lm import document_token_ids
from train.data.sources import load_text_dataset
from train.methods.medusa.config import MedusaConfig
from train.methods.medusa.module import MedusaModule
from train.methods.run_spec import RunSpec
from train.models.loading import ModelPair
from train.training.answer_data import answer_batches
from train.training.answer_sources import method_answers


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
        cfg.heads(verifier, tokenizer, target_tokens, cfg.initial_heads(spec)),
        cfg,
        tokenizer,
        training_documents,
        seed=spec.seed,
    )
    return module, data
