"""The answer-distillation settings (the SmolLM2 pair's drafter recipe, train/pairs/smollm2_pair.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AnswerDistillConfig:
    lr: float = 2e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    max_steps: int = 1000
