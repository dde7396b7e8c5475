"""Which build step a method's settings go through: ``method._target_`` names the settings class, this
table names its build (``train/methods/<name>/build.py``). A settings class of one's own (a new method
outside this package) can bring a ``build(pair, spec)`` method instead."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L

from train.config import ConfigError
from train.methods.dflash import build as dflash
from train.methods.dflash.config import DFlashConfig
from train.methods.distillspec import build as distillspec
from train.methods.distillspec.config import DistillSpecConfig
from train.methods.eagle3 import build as eagle3
from train.methods.eagle3.config import Eagle3Config
from train.methods.medusa import build as medusa
from train.methods.medusa.config import MedusaConfig
from train.methods.pretrain import build as pretrain
from train.methods.pretrain.config import PretrainConfig
from train.methods.run_spec import RunSpec
from train.methods.steering import build as steering
from train.methods.steering.config import SteeringConfig
from train.models.loading import ModelPair

__all__ = ["BUILDS", "build_method"]

Build = Callable[[Any, ModelPair, RunSpec], tuple[L.LightningModule, L.LightningDataModule]]

BUILDS: dict[type, Build] = {
    DFlashConfig: dflash.build,
    DistillSpecConfig: distillspec.build,
    Eagle3Config: eagle3.build,
    MedusaConfig: medusa.build,
    PretrainConfig: pretrain.build,
    SteeringConfig: steering.build,
}


def build_method(cfg: Any, pair: ModelPair, spec: RunSpec) -> tuple[L.LightningModule, L.LightningDataModule]:
    """The method's LightningModule and data for this run's settings ``cfg`` (the ``method`` group)."""
    build = BUILDS.get(type(cfg))
    if build is not None:
        return build(cfg, pair, spec)
    if callable(getattr(cfg, "build", None)):
        return cfg.build(pair, spec)  # type: ignore[no-any-return]
    known = ", ".join(sorted(c.__name__ for c in BUILDS))
    raise ConfigError(
        f"method._target_: {type(cfg).__name__} is not a method's settings ({known}), and has no build()"
    )
