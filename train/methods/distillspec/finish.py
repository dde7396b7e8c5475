"""The distillspec method's finish step: what it exports, which drafters the evaluator measures, what its
report adds (the ``Finishable`` side of :class:`~train.methods.distillspec.module.DistillSpecModule`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from train.export.drafter import export_drafter
from train.models.lora import merge_lora

if TYPE_CHECKING:
    from train.methods.distillspec.module import DistillSpecModule


def distilled_drafter(module: DistillSpecModule) -> torch.nn.Module:
    """The student as a plain Hugging Face model (LoRA adapters merged into a copy) in the dtype it
    was loaded in (``model.dtype``): what is exported and evaluated as ``after``."""
    return merge_lora(module.student, module.export_dtype)


def drafters_to_evaluate(module: DistillSpecModule) -> dict[str, torch.nn.Module]:
    """``before`` (the pretrained drafter, reloaded) and ``after`` (the distilled one)."""
    drafters = {"after": module.distilled_drafter()}
    if module.pretrained is not None:
        drafters = {"before": module.pretrained(), **drafters}
    return drafters


def evaluation_verifier(module: DistillSpecModule, verifier: torch.nn.Module) -> torch.nn.Module:
    """The pair's verifier, unchanged by distillation."""
    return verifier


def report_sections(module: DistillSpecModule) -> list[str]:
    """The validation before and after training, when the run validated the starting drafter."""
    table = validation_table(module.validation_history, module.cfg.num_val_prompts)
    return [table] if table else []


def validation_table(history: list[dict[str, float]], num_prompts: int) -> str:
    """A markdown section comparing the first validation (step 0: the starting drafter) with the last;
    empty unless both exist."""
    if len(history) < 2 or history[0]["step"] != 0:
        return ""
    first, last = history[0], history[-1]
    rows = [
        ("expected acceptance, the teacher's sampled continuations (T = 1 contexts)", "expected_acceptance"),
        ("greedy agreement, the teacher's greedy continuations (T = 0 contexts)", "greedy_agreement"),
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


def export(module: DistillSpecModule, out_dir: str) -> Path:
    """The distilled drafter as a Hugging Face folder (safetensors + tokenizer)."""
    return export_drafter(module.distilled_drafter(), module.tokenizer, out_dir)


def report_summary(module: DistillSpecModule) -> dict[str, Any]:
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
        **{k: getattr(module.cfg, k) for k in keys},
        "lora": asdict(module.cfg.lora),
        "validation": list(module.validation_history),
    }
