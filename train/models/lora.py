"""LoRA adapters on a drafter (peft): the settings every method's ``method.lora`` node holds.

``enabled: false`` (the default) is a full fine-tune. :func:`apply_lora` wraps a causal LM so only
the adapters train; :func:`merge_lora` turns a wrapped model back into a plain Hugging Face model
(adapters merged into a copy), which is what export and evaluation use.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from train.config import require

__all__ = ["LoraSettings", "apply_lora", "merge_lora"]


@dataclass
class LoraSettings:
    """peft LoRA on the drafter (``method.lora.*``); ``enabled: false`` is a full fine-tune."""

    enabled: bool = False
    r: int = 8
    """Adapter rank."""
    alpha: int = 16
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters."""

    def __post_init__(self) -> None:
        require(isinstance(self.r, int) and self.r >= 1, "method.lora.r", "an integer >= 1", self.r)
        require(self.alpha > 0, "method.lora.alpha", "> 0", self.alpha)
        require(0.0 <= self.dropout < 1.0, "method.lora.dropout", "in [0, 1)", self.dropout)
        require(
            bool(self.target_modules), "method.lora.target_modules", "a non-empty list", self.target_modules
        )

    @classmethod
    def coerce(cls, value: Any, key: str = "method.lora") -> LoraSettings:
        """``value`` as settings: None (the defaults), a mapping of fields, or settings already."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        require(isinstance(value, dict), key, "a mapping", value)
        unknown = sorted(set(value) - set(cls.__dataclass_fields__) - {"_target_"})
        require(not unknown, key, f"keys among {sorted(cls.__dataclass_fields__)}", unknown)
        return cls(**{k: v for k, v in value.items() if k != "_target_"})


def apply_lora(model: torch.nn.Module, cfg: LoraSettings) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters (only they train)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def merge_lora(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A plain model: a peft model's adapters merged into a copy (``model`` is left as it is);
    any other model is returned as it is, or as a copy when ``dtype`` asks for a cast.

    ``dtype``: the dtype of the result's floating-point parameters (the run's ``model.dtype``, what
    export writes): weights trained in float32 are cast in a copy, never in place; buffers are left
    as they are (a reloaded model rebuilds them the same way). None: as trained.
    """
    if hasattr(model, "merge_and_unload"):
        merged: Any = copy.deepcopy(model)
        model = merged.merge_and_unload()  # merged weights take their base layer's dtype
    elif dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        model = copy.deepcopy(model)
    if dtype is not None:
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    return model
