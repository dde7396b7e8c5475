"""How the distillspec method's module and data are built from its settings and the run's pair (the
arrows run one way: build -> module -> finish -> config)."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L

from train.config import ConfigError
from train.methods.distillspec.config import DistillSpecConfig
from train.methods.distillspec.module import DistillSpecModule
from train.methods.run_spec import RunSpec
from train.models.loading import ModelPair, load_model
from train.training.answer_data import cached_answers
from train.training.answer_share import answer_device
from train.training.pair_answers import pair_answers
from train.training.prompt_data import prompt_data


def build(
    cfg: DistillSpecConfig, pair: ModelPair, spec: RunSpec
) -> tuple[DistillSpecModule, L.LightningDataModule]:
    """The pair's drafter (LoRA-wrapped if asked) distilled towards its frozen verifier; the
    pretrained drafter is reloaded from ``model.drafter`` for the finish step's ``before``."""
    data = prompt_data(cfg, pair.tokenizer, spec.data, spec.seed)
    m = spec.model
    pretrained = functools.partial(load_model, m.drafter, m.dtype, m.attn_implementation, m.trust_remote_code)
    module = DistillSpecModule(
        pair.drafter, pair.verifier, pair.tokenizer, cfg, seed=spec.seed, pretrained=pretrained
    )
    if cfg.answers is not None and cfg.on_policy_probability < 1.0:
        module.preload_answers(offline_answers(cfg, pair, spec))
    return module, data


def offline_answers(cfg: DistillSpecConfig, pair: ModelPair, spec: RunSpec) -> list[Any]:
    """The training answers ``cfg.answers`` names: the real pair's to this run's ``num_prompts``
    training prompts (generated on first use, cached), or a folder's."""
    if cfg.answers != "pair":
        return cached_answers(str(cfg.answers), key="method.answers")["train"]
    device = answer_device(spec.trainer.accelerator)
    answers = pair_answers(
        spec.model, pair.verifier, pair.tokenizer, train_prompts=cfg.num_prompts, device=device
    )
    if answers is None:
        raise ConfigError(
            "method.answers=pair: "
            "only the real pair (model=smollm2) keeps the verifier's answers; "
            "give a folder of answers, or null to generate them in the run"
        )
    return answers["train"]
