"""The steering method's settings (conf/method/steering.yaml) and how they build its module."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L
import torch

from train.config import check_model_source, require
from train.models.loading import load_drafter
from train.models.lora import LoraSettings
from train.models.steering_module import (
    SteeringModule,
)
from train.rundir import newest_artifact_of
from train.training.optim import (
    check_optimizer,
)
from train.training.prompt_data import ResponseDistillSettings, prompt_data

__all__ = ["SteeringConfig"]

log = logging.getLogger(__name__)

MAIN_ARM = "steered"
BASELINE_ARM = "distilled"
DISTILLSPEC_ARM = "distillspec_steered"

if TYPE_CHECKING:
    from train.methods.steering.module import SteeringTrainingModule


@dataclass
class SteeringConfig(ResponseDistillSettings):
    """Hyperparameters of SD^2 training (``method=steering``); validated before any model loads."""

    optimizer: Any
    scheduler: Any = None
    drafter: str | None = None
    """The drafter to steer: any exported drafter (a folder) or Hub id; None: the pair's ``model.drafter``."""
    train_drafter: bool = True
    """False: only the steering module trains (the drafter stays as loaded)."""
    lora: Any = None
    """LoRA on the drafters (:class:`train.models.lora.LoraSettings`); None or disabled: full fine-tune."""
    layers: list[int] | None = None
    """Verifier layers the guide reads (indices into ``hidden_states``); None: early/middle/late."""
    steering_lr_multiplier: float = 1.0
    """The steering modules learn at this multiple of the optimizer's rate (they start from zero)."""
    distilled_baseline: bool = True
    """Also train the drafter without steering on the same batches (the ``distilled`` arm)."""
    distillspec_drafter: str | None = None
    """Also steer this exported drafter (``distillspec_steered``); ``auto``: the newest DistillSpec run's."""

    def __post_init__(self) -> None:
        check_optimizer("method", self.optimizer, self.scheduler)
        self.check_response_settings()
        require(
            self.steering_lr_multiplier > 0,
            "method.steering_lr_multiplier",
            "> 0",
            self.steering_lr_multiplier,
        )
        require(
            self.layers is None or (len(self.layers) >= 1 and all(int(i) >= 0 for i in self.layers)),
            "method.layers",
            "null or a list of verifier layer indices >= 0",
            self.layers,
        )
        self.lora = LoraSettings.coerce(self.lora, "method.lora")
        require(
            self.train_drafter or not self.lora.enabled,
            "method.lora.enabled",
            "false when method.train_drafter is false (nothing of the drafter trains)",
            self.lora.enabled,
        )
        if self.drafter is not None:
            check_model_source("method.drafter", str(self.drafter))
        if self.distillspec_drafter not in (None, "auto"):
            check_model_source("method.distillspec_drafter", str(self.distillspec_drafter))

    def build(self, pair: Any, spec: Any) -> tuple[SteeringTrainingModule, L.LightningDataModule]:
        """The arms (see the module docstring) on the pair's verifier, trained on ``spec.data`` prompts."""
        from train.methods.steering.module import SteeringTrainingModule  # noqa: I001 -- the module imports this config (a cycle)

        data = prompt_data(self, pair.tokenizer, spec.data, spec.seed)
        m = spec.model
        load = functools.partial(load_drafter, m, tokenizer=pair.tokenizer, verifier=pair.verifier)
        source = self.drafter or m.drafter
        drafter = pair.drafter if self.drafter is None else load(source, key="method.drafter")
        arms: dict[str, tuple[torch.nn.Module, SteeringModule | None]] = {}
        if self.distilled_baseline and self.train_drafter:  # frozen, it would be the pretrained drafter
            arms[BASELINE_ARM] = (copy.deepcopy(drafter), None)
        arms[MAIN_ARM] = (drafter, self.steering_for(pair.verifier, drafter))
        references: dict[str, Callable[[], torch.nn.Module]] = {
            "pretrained": functools.partial(load, source, key="method.drafter")
        }
        distillspec = self.distillspec_drafter
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
                    DISTILLSPEC_ARM,
                )
        if distillspec is not None:
            ds = load(distillspec, key="method.distillspec_drafter")
            arms[DISTILLSPEC_ARM] = (ds, self.steering_for(pair.verifier, ds))
            references["distillspec"] = functools.partial(load, distillspec, key="method.distillspec_drafter")
        module = SteeringTrainingModule(
            pair.verifier, arms, pair.tokenizer, self, seed=spec.seed, references=references
        )
        module.sources = {"drafter": source, "distillspec_drafter": distillspec}
        return module, data

    def steering_for(self, verifier: Any, drafter: torch.nn.Module) -> SteeringModule:
        """A zero-initialised steering module for this drafter, reading ``layers`` of the verifier."""
        depth = int(verifier.config.num_hidden_layers)
        require(
            self.layers is None or max(int(i) for i in self.layers) <= depth,
            "method.layers",
            f"indices into the verifier's hidden_states (0..{depth})",
            self.layers,
        )
        return SteeringModule.for_pair(verifier, drafter, self.layers).float()
