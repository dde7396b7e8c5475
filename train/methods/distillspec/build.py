"""How the distillspec method's module and data are built from its settings and the run's pair (the
arrows run one way: build -> module -> finish -> config)."""

from __future__ import annotations

import functools

import lightning as L

from train.methods.distillspec.config import DistillSpecConfig
from train.methods.distillspec.module import DistillSpecModule
from train.methods.run_spec import RunSpec
from train.models.loading import ModelPair, load_model
from train.training.prompt_data import prompt_data


def build(
    cfg: DistillSpecConfig, pair: ModelPair, spec: RunSpec
) -> tuple[DistillSpecModule, L.LightningDataModule]:
    """Student = the pair's drafter (LoRA-wrapped if asked), teacher = the frozen verifier; the
    pretrained drafter is reloaded from ``model.drafter`` for the finish step's ``before``."""
    data = prompt_data(cfg, pair.tokenizer, spec.data, spec.seed)
    m = spec.model
    pretrained = functools.partial(load_model, m.drafter, m.dtype, m.attn_implementation, m.trust_remote_code)
    module = DistillSpecModule(
        pair.drafter, pair.verifier, pair.tokenizer, cfg, seed=spec.seed, pretrained=pretrained
    )
    if cfg.teacher_answers is not None and cfg.on_policy_probability < 1.0:
        module.preload_teacher(cfg.offline_teacher_answers(pair, spec))
    return module, data
