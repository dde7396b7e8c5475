"""How the eagle3 method's module and data are built from its settings and the run's pair (the
arrows run one way: build -> module -> finish -> config)."""

from __future__ import annotations

import lightning as L

from train.methods.eagle3.config import Eagle3Config
from train.methods.eagle3.module import Eagle3Module
from train.methods.run_spec import RunSpec
from train.models.loading import ModelPair
from train.training.answer_data import answer_batches, answer_eos_ids
from train.training.answer_share import answer_device
from train.training.answer_sources import method_answers, sampled_answers


def build(cfg: Eagle3Config, pair: ModelPair, spec: RunSpec) -> tuple[Eagle3Module, L.LightningDataModule]:
    """The verifier's answers (cached or generated, plus ``sampled_answers`` per training prompt), the
    draft vocabulary counted on the training answers, a fresh drafter on the pair's verifier (or
    ``init``), and the answers' batches."""
    verifier, tokenizer = pair.verifier, pair.tokenizer
    answers = method_answers(cfg, pair, spec, cfg.prompt_len)
    extra = sampled_answers(
        verifier,
        answer_eos_ids(verifier, tokenizer),
        [a.prompt for a in answers["train"]],
        cfg.sampled_answers,
        cfg.sampled_temperature,
        cfg.answer_tokens,
        cfg.answer_batch,
        spec.seed,
        cfg.sampled_answers_dir or cfg.default_sampled_dir(verifier, answers["train"], spec),
        engine=cfg.answer_engine,
        device=answer_device(spec.trainer.accelerator),
    )
    answers = {**answers, "train": answers["train"] + extra}
    drafter = cfg.drafter(verifier, tokenizer, answers["train"])
    data = answer_batches(
        answers,
        verifier,
        tokenizer,
        cfg.batch_size,
        cfg.max_len,
        spec.seed,
        cfg.prompt_loss,
        cfg.group_by_length,
    )
    comparison = pair.drafter if cfg.compare_pair_drafter else None
    return Eagle3Module(verifier, drafter, cfg, tokenizer, comparison=comparison), data
