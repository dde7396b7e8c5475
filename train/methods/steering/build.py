"""How the steering method's module and data are built from its settings and the run's pair (the
arrows run one way: build -> module -> finish -> config)."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from train.config import require
from train.methods.run_spec import RunSpec
from train.methods.steering.config import DISTILLED_ARM, DISTILLSPEC_STEERED_ARM, MAIN_ARM, SteeringConfig
from train.methods.steering.module import SteeringTrainingModule
from train.models.loading import ModelPair, load_drafter
from train.models.steering_module import (
    SteeringModule,
)
from train.rundir import newest_artifact_of
from train.training.prompt_data import prompt_data

log = logging.getLogger(__name__)


def steering_for(cfg: SteeringConfig, verifier: Any, drafter: torch.nn.Module) -> SteeringModule:
    """A zero-initialised steering module for this drafter, reading ``cfg.layers`` of the verifier."""
    depth = int(verifier.config.num_hidden_layers)
    require(
        cfg.layers is None or max(int(i) for i in cfg.layers) <= depth,
        "method.layers",
        f"indices into the verifier's hidden_states (0..{depth})",
        cfg.layers,
    )
    return SteeringModule.for_pair(verifier, drafter, cfg.layers).float()


def build(
    cfg: SteeringConfig, pair: ModelPair, spec: RunSpec
) -> tuple[SteeringTrainingModule, L.LightningDataModule]:
    """The arms (see the module docstring) on the pair's verifier, trained on ``spec.data`` prompts."""
    data = prompt_data(cfg, pair.tokenizer, spec.data, spec.seed)
    m = spec.model
    load = functools.partial(load_drafter, m, tokenizer=pair.tokenizer, verifier=pair.verifier)
    source = cfg.drafter or m.drafter
    drafter = pair.drafter if cfg.drafter is None else load(source, key="method.drafter")
    arms: dict[str, tuple[torch.nn.Module, SteeringModule | None]] = {}
    if cfg.distilled_baseline and cfg.train_drafter:  # frozen, it would be the pretrained drafter
        arms[DISTILLED_ARM] = (copy.deepcopy(drafter), None)
    arms[MAIN_ARM] = (drafter, steering_for(cfg, pair.verifier, drafter))
    references: dict[str, Callable[[], torch.nn.Module]] = {
        "pretrained": functools.partial(load, source, key="method.drafter")
    }
    distillspec = cfg.distillspec_drafter
    if distillspec == "auto":
        # the main job's recipe or its tiny-pair twin: whichever trained a drafter for this verifier
        distillspec = newest_artifact_of(
            spec.paths.checkpoints_dir, ("distillspec", "distillspec_tiny"), m.verifier, "drafter"
        )
        if distillspec is None:
            log.warning(
                "method.distillspec_drafter=auto: no DistillSpec run of %s under %s; the %s arm is "
                "skipped (run `python train.py experiment=distillspec` first to add it)",
                m.verifier,
                spec.paths.checkpoints_dir,
                DISTILLSPEC_STEERED_ARM,
            )
    if distillspec is not None:
        ds = load(distillspec, key="method.distillspec_drafter")
        arms[DISTILLSPEC_STEERED_ARM] = (ds, steering_for(cfg, pair.verifier, ds))
        references["distillspec"] = functools.partial(load, distillspec, key="method.distillspec_drafter")
    module = SteeringTrainingModule(
        pair.verifier, arms, pair.tokenizer, cfg, seed=spec.seed, references=references
    )
    module.sources = {"drafter": source, "distillspec_drafter": distillspec}
    return module, data
