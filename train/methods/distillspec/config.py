"""The distillspec method's settings (conf/method/distillspec.yaml) and how they build its module."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L

from train.config import require
from train.models.loading import load_model
from train.models.lora import LoraSettings
from train.training.optim import (
    check_optimizer,
)
from train.training.prompt_data import ResponseDistillSettings, prompt_data

log = logging.getLogger(__name__)

DATA_SOURCES: tuple[str, ...] = ("fixed", "teacher", "student", "mixed_fixed", "mixed_teacher")

if TYPE_CHECKING:
    from train.methods.distillspec.module import DistillSpecModule


@dataclass
class DistillSpecConfig(ResponseDistillSettings):
    """Hyperparameters of DistillSpec (``method=distillspec``); validated before any model loads. The
    divergence, sampling and prompt settings are :class:`~train.training.prompt_data.ResponseDistillSettings`."""

    optimizer: Any
    scheduler: Any = None
    lmbda: float = 0.5
    """Probability of an on-policy batch for the ``mixed_*`` data sources."""
    data_source: str = "teacher"
    """Where continuations come from: see the module docstring."""
    ce_weight: float = 0.0
    """Weight of an extra cross-entropy on the ground-truth continuation (0 = off)."""
    cache_teacher: bool = True
    """Generate each training prompt's teacher continuation once and reuse it in later epochs."""
    teacher_temperature: float | None = None
    """Temperature of the teacher's training continuations (0 = greedy); None: ``temperature``. The loss
    and the student's rollouts keep ``temperature``: one drafter for greedy and sampled decoding can
    see greedy contexts from the teacher and sampled ones from itself."""
    lora: Any = None
    """LoRA on the drafter (:class:`train.models.lora.LoraSettings`); None: a full fine-tune."""
    validate_before: bool = False
    """Also validate the starting drafter before the first step (not on resume): the report then
    compares the same held-out measurements before and after training. The teacher's validation
    continuations are generated then and reused at the end, so this costs one scoring pass."""

    def __post_init__(self) -> None:
        check_optimizer("method", self.optimizer, self.scheduler)
        self.check_response_settings()
        require(
            isinstance(self.validate_before, bool),
            "method.validate_before",
            "true or false",
            self.validate_before,
        )
        require(_in_unit(self.lmbda), "method.lmbda", "in [0, 1]", self.lmbda)
        require(
            self.data_source in DATA_SOURCES, "method.data_source", f"one of {DATA_SOURCES}", self.data_source
        )
        require(self.ce_weight >= 0, "method.ce_weight", ">= 0", self.ce_weight)
        t = self.teacher_temperature
        require(
            t is None
            or (isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t) and t >= 0),
            "method.teacher_temperature",
            "null or a finite number >= 0 (0: greedy)",
            t,
        )
        self.lora = LoraSettings.coerce(self.lora, "method.lora")

    @property
    def on_policy_probability(self) -> float:
        """lambda as the data source implies it."""
        return {"student": 1.0, "fixed": 0.0, "teacher": 0.0}.get(self.data_source, self.lmbda)

    @property
    def teacher_rollout_temperature(self) -> float:
        """The temperature the teacher's training continuations are generated at."""
        return float(self.temperature if self.teacher_temperature is None else self.teacher_temperature)

    @property
    def off_policy_source(self) -> str:
        """What a batch that is not on-policy trains on: ``fixed`` or ``teacher``."""
        return "fixed" if self.data_source in ("fixed", "mixed_fixed") else "teacher"

    def build(self, pair: Any, spec: Any) -> tuple[DistillSpecModule, L.LightningDataModule]:
        """Student = the pair's drafter (LoRA-wrapped if asked), teacher = the frozen verifier; the
        pretrained drafter is reloaded from ``model.drafter`` for the finish step's ``before``."""
        from train.methods.distillspec.module import DistillSpecModule  # noqa: I001 -- the module imports this config (a cycle)

        data = prompt_data(self, pair.tokenizer, spec.data, spec.seed)
        m = spec.model
        pretrained = functools.partial(
            load_model, m.drafter, m.dtype, m.attn_implementation, m.trust_remote_code
        )
        module = DistillSpecModule(
            pair.drafter, pair.verifier, pair.tokenizer, self, seed=spec.seed, pretrained=pretrained
        )
        return module, data


def _in_unit(x: Any) -> bool:
    return isinstance(x, int | float) and 0.0 <= x <= 1.0
