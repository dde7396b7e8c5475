"""The distillspec method's finish step: what it exports, which drafters the evaluator measures, what its
report adds (the ``Finishable`` side of :class:`~train.methods.distillspec.module.DistillSpecModule`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from train.export.drafter import export_drafter
from train.methods.distillspec.config import DistillSpecConfig
from train.models.lora import merge_lora


def validation_table(history: list[dict[str, float]], num_prompts: int) -> str:
    """A markdown section comparing the first validation (step 0: the starting drafter) with the last;
    empty unless both exist."""
    if len(history) < 2 or history[0]["step"] != 0:
        return ""
    first, last = history[0], history[-1]
    rows = [
        ("expected acceptance, the verifier's sampled continuations (T = 1 contexts)", "expected_acceptance"),
        ("greedy agreement, the verifier's greedy continuations (T = 0 contexts)", "greedy_agreement"),
        ("loss", "loss"),
    ]
    lines = [
        "## Validation before and after training",
        "",
        f"Teacher-forced on the same {num_prompts} held-out prompts' continuations at every validation.",
        "",
        f"| metric | step 0 | step {int(last['step'])} | ratio |",
        "|---|---:|---:|---:|",
    ]
    for label, key in rows:
        if key in first and key in last:
            ratio = last[key] / first[key] if first[key] else float("nan")
            lines.append(f"| {label} | {first[key]:.4f} | {last[key]:.4f} | {ratio:.3f} |")
    return "\n".join(lines)


class DistillSpecFinish:
    """The finish step's side of :class:`~train.methods.distillspec.module.DistillSpecModule` (what
    :class:`train.report.Finishable` asks for): what the run exports, which drafters the evaluator
    measures, what its report adds."""

    reference_drafter: str | None = "before"
    artifact_dir = "drafter"
    card_base = "drafter"

    # what the module holds
    cfg: DistillSpecConfig
    drafter: torch.nn.Module
    tokenizer: Any
    export_dtype: torch.dtype
    pretrained: Callable[[], torch.nn.Module] | None
    validation_history: list[dict[str, float]]

    def distilled_drafter(self) -> torch.nn.Module:
        """The drafter as a plain Hugging Face model (LoRA adapters merged into a copy) in the dtype it
        was loaded in (``model.dtype``): what is exported and evaluated as ``after``."""
        return merge_lora(self.drafter, self.export_dtype)

    def drafters_to_evaluate(self) -> dict[str, torch.nn.Module]:
        """``before`` (the pretrained drafter, reloaded) and ``after`` (the distilled one)."""
        drafters = {"after": self.distilled_drafter()}
        if self.pretrained is not None:
            drafters = {"before": self.pretrained(), **drafters}
        return drafters

    def evaluation_verifier(self, verifier: torch.nn.Module) -> torch.nn.Module:
        """The pair's verifier, unchanged by distillation."""
        return verifier

    def report_sections(self) -> list[str]:
        """The validation before and after training, when the run validated the starting drafter."""
        table = validation_table(self.validation_history, self.cfg.num_val_prompts)
        return [table] if table else []

    def export(self, out_dir: str) -> Path:
        """The distilled drafter as a Hugging Face folder (safetensors + tokenizer)."""
        return export_drafter(self.distilled_drafter(), self.tokenizer, out_dir)

    def report_summary(self) -> dict[str, Any]:
        """The settings that define this distillation run, for ``report.json``."""
        keys = (
            "divergence",
            "beta",
            "lmbda",
            "data_source",
            "temperature",
            "max_new_tokens",
            "prompt_len",
            "batch_size",
            "num_prompts",
            "ce_weight",
            "gamma",
        )
        return {
            "method": "distillspec",
            **{k: getattr(self.cfg, k) for k in keys},
            "lora": asdict(self.cfg.lora),
            "validation": list(self.validation_history),
        }
