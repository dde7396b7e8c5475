"""The steering method's settings (conf/method/steering.yaml) and how they build its module."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from train.config import check_model_source, require
from train.models.lora import LoraSettings
from train.training.optim import (
    check_optimizer,
)
from train.training.prompt_data import RolloutDistillSettings

__all__ = ["SteeringConfig"]

log = logging.getLogger(__name__)

MAIN_ARM = "steered"
DISTILLED_ARM = "distilled"
DISTILLSPEC_STEERED_ARM = "distillspec_steered"


@dataclass
class SteeringConfig(RolloutDistillSettings):
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
        self.check_rollout_settings()
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
