"""The distillspec method's settings (conf/method/distillspec.yaml) and how they build its module."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning as L

from train.config import require
from train.losses import DIVERGENCES
from train.models.loading import load_model
from train.models.lora import LoraSettings
from train.training.optim import (
    check_optimizer,
)
from train.training.prompt_data import check_prompt_settings, prompt_data

log = logging.getLogger(__name__)

DATA_SOURCES: tuple[str, ...] = ("fixed", "teacher", "student", "mixed_fixed", "mixed_teacher")

if TYPE_CHECKING:
    from train.methods.distillspec.module import DistillSpecModule


@dataclass
class DistillSpecConfig:
    """Hyperparameters of DistillSpec (``method=distillspec``); validated before any model loads."""

    optimizer: Any
    scheduler: Any = None
    divergence: str = "fkl"
    """One of ``fkl``, ``rkl``, ``jsd``, ``tvd`` (:func:`train.losses.divergence`)."""
    beta: float = 0.5
    """JSD interpolation in [0, 1]; 0 is FKL, 1 is RKL (GKD's convention)."""
    lmbda: float = 0.5
    """Probability of an on-policy batch for the ``mixed_*`` data sources."""
    data_source: str = "teacher"
    """Where continuations come from: see the module docstring."""
    temperature: float = 1.0
    """Sampling temperature of rollouts, also the softmax temperature of the loss; > 0."""
    max_new_tokens: int = 32
    prompt_len: int = 64
    batch_size: int = 16
    num_prompts: int = 1024
    """Training prompts cut from the corpus's train split."""
    num_val_prompts: int = 32
    """Held-out prompts (validation split) whose teacher continuations are generated once per run."""
    ce_weight: float = 0.0
    """Weight of an extra cross-entropy on the ground-truth continuation (0 = off)."""
    gamma: int = 4
    """Draft length for ``val/simulated_block_efficiency``."""
    cache_teacher: bool = True
    """Generate each training prompt's teacher continuation once and reuse it in later epochs."""
    lora: Any = None
    """LoRA on the drafter (:class:`train.models.lora.LoraSettings`); None: a full fine-tune."""

    def __post_init__(self) -> None:
        check_optimizer("method", self.optimizer, self.scheduler)
        require(self.divergence in DIVERGENCES, "method.divergence", f"one of {DIVERGENCES}", self.divergence)
        require(_in_unit(self.beta), "method.beta", "in [0, 1]", self.beta)
        require(_in_unit(self.lmbda), "method.lmbda", "in [0, 1]", self.lmbda)
        require(
            self.data_source in DATA_SOURCES, "method.data_source", f"one of {DATA_SOURCES}", self.data_source
        )
        require(
            isinstance(self.temperature, int | float)
            and math.isfinite(self.temperature)
            and self.temperature > 0,
            "method.temperature",
            "> 0 (rollouts sample; greedy rollouts are not supported)",
            self.temperature,
        )
        check_prompt_settings(self)
        require(self.ce_weight >= 0, "method.ce_weight", ">= 0", self.ce_weight)
        require(self.gamma >= 1, "method.gamma", ">= 1", self.gamma)
        self.lora = LoraSettings.coerce(self.lora, "method.lora")

    @property
    def on_policy_probability(self) -> float:
        """lambda as the data source implies it."""
        return {"student": 1.0, "fixed": 0.0, "teacher": 0.0}.get(self.data_source, self.lmbda)

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
