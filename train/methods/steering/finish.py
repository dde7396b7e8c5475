"""The steering method's finish step: what it exports, which drafters the evaluator measures, what its
report adds (the ``Finishable`` side of :class:`~train.methods.steering.module.SteeringTrainingModule`)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from train.export.drafter import export_drafter
from train.methods.steering.config import BASELINE_ARM, DISTILLSPEC_ARM, MAIN_ARM
from train.models.lora import merge_lora
from train.models.steering_module import (
    SteeredDrafter,
)
from train.tables import format_value, markdown_table

if TYPE_CHECKING:
    from train.methods.steering.module import SteeringTrainingModule


def plain_drafter(module: SteeringTrainingModule, label: str) -> torch.nn.Module:
    """The arm's drafter as a plain Hugging Face model (LoRA adapters merged into a copy) in the dtype
    it was loaded in (``model.dtype``), as exported and evaluated."""
    return merge_lora(module.drafters[label], module.export_dtype)


def trained(module: SteeringTrainingModule, label: str) -> torch.nn.Module:
    """What the arm evaluates as: its drafter, with its steering module when it has one."""
    drafter = module.plain_drafter(label)
    if label in module.steering:
        return SteeredDrafter(drafter, module.steering_of(label))
    return drafter


def drafters_to_evaluate(module: SteeringTrainingModule) -> dict[str, torch.nn.Module]:
    """The pretrained drafter, the DistillSpec drafter as it was (when given) and every arm."""
    drafters = {"pretrained": module.references["pretrained"]()} if "pretrained" in module.references else {}
    for label in module.drafters:
        if label == DISTILLSPEC_ARM and "distillspec" in module.references:
            drafters["distillspec"] = module.references["distillspec"]()
        drafters[label] = module.trained(label)
    return drafters


def evaluation_verifier(module: SteeringTrainingModule, verifier: torch.nn.Module) -> torch.nn.Module:
    return verifier


def export(module: SteeringTrainingModule, out_dir: str) -> Path:
    """``steering/`` (mixin folder), ``drafter/`` beside it (save_pretrained + tokenizer), and the
    other arms: ``distilled_drafter/`` and ``distillspec_steered/{drafter,steering}``."""
    out = Path(out_dir)
    module.steering_of(MAIN_ARM).standalone_copy().save_pretrained(out)
    export_drafter(
        module.plain_drafter(MAIN_ARM), module.tokenizer, out.parent / "drafter", name="SD^2 drafter"
    )
    if BASELINE_ARM in module.drafters:
        export_drafter(module.plain_drafter(BASELINE_ARM), module.tokenizer, out.parent / "distilled_drafter")
    if DISTILLSPEC_ARM in module.drafters:
        folder = out.parent / DISTILLSPEC_ARM
        module.steering_of(DISTILLSPEC_ARM).standalone_copy().save_pretrained(folder / "steering")
        export_drafter(module.plain_drafter(DISTILLSPEC_ARM), module.tokenizer, folder / "drafter")
    return out


def report_summary(module: SteeringTrainingModule) -> dict[str, Any]:
    keys = (
        "train_drafter",
        "divergence",
        "beta",
        "temperature",
        "max_new_tokens",
        "prompt_len",
        "batch_size",
        "num_prompts",
        "gamma",
        "steering_lr_multiplier",
    )
    return {
        "method": "sd2-steering",
        **{k: getattr(module.cfg, k) for k in keys},
        "verifier_layers": module.layers,
        "arms": list(module.drafters),
        "sources": module.sources,
        "lora": asdict(module.cfg.lora),
        "validation": module.last_validation,
    }


def report_sections(module: SteeringTrainingModule) -> list[str]:
    rows = []
    for label in module.drafters:
        prefix = "val" if label == MAIN_ARM else f"val/{label}"
        rows.append(
            [
                label,
                "yes" if label in module.steering else "no",
                format_value(module.last_validation.get(f"{prefix}/expected_acceptance"), 3),
                format_value(module.last_validation.get(f"{prefix}/simulated_block_efficiency"), 2),
            ]
        )
    table = markdown_table(["arm", "steered", "expected acceptance", "simulated tau"], rows, "llrr")
    return [
        "## Arms (last validation)",
        table.rstrip(),
        f"Every arm trained on the same verifier responses (T = {module.cfg.temperature}), steps and loss "
        f"({module.cfg.divergence}). Steered arms are measured with guides 1..{module.cfg.gamma} positions "
        "stale (block position i with staleness i); the evaluation below decodes with them."
        + (
            ""
            if module.cfg.train_drafter
            else " method.train_drafter=false: only the steering modules trained, the drafters stayed "
            "as loaded, and ratios are to the untouched drafter (pretrained)."
        ),
    ]
