"""The steering method's finish step: what it exports, which drafters the evaluator measures, what its
report adds (the ``Finishable`` side of :class:`~train.methods.steering.module.SteeringTrainingModule`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch

from train.export.drafter import export_drafter
from train.methods.steering.config import DISTILLED_ARM, DISTILLSPEC_STEERED_ARM, MAIN_ARM, SteeringConfig
from train.models.lora import merge_lora
from train.models.steering_module import SteeredDrafter, SteeringModule
from train.tables import format_value, markdown_table


class SteeringFinish:
    """The finish step's side of :class:`~train.methods.steering.module.SteeringTrainingModule` (what
    :class:`train.report.Finishable` asks for): what the run exports, which drafters the evaluator
    measures, what its report adds."""

    reference_drafter: str | None
    artifact_dir = "steering"
    card_base = "drafter"

    # what the module holds
    cfg: SteeringConfig
    drafters: torch.nn.ModuleDict
    steering: torch.nn.ModuleDict
    references: dict[str, Callable[[], torch.nn.Module]]
    sources: dict[str, Any]
    layers: list[int]
    tokenizer: Any
    export_dtype: torch.dtype
    last_validation: dict[str, float]

    def steering_of(self, label: str) -> SteeringModule:
        return cast(SteeringModule, self.steering[label])

    def plain_drafter(self, label: str) -> torch.nn.Module:
        """The arm's drafter as a plain Hugging Face model (LoRA adapters merged into a copy) in the dtype
        it was loaded in (``model.dtype``), as exported and evaluated."""
        return merge_lora(self.drafters[label], self.export_dtype)

    def trained(self, label: str) -> torch.nn.Module:
        """What the arm evaluates as: its drafter, with its steering module when it has one."""
        drafter = self.plain_drafter(label)
        if label in self.steering:
            return SteeredDrafter(drafter, self.steering_of(label))
        return drafter

    def drafters_to_evaluate(self) -> dict[str, torch.nn.Module]:
        """The pretrained drafter, the DistillSpec drafter as it was (when given) and every arm."""
        drafters = {"pretrained": self.references["pretrained"]()} if "pretrained" in self.references else {}
        for label in self.drafters:
            if label == DISTILLSPEC_STEERED_ARM and "distillspec" in self.references:
                drafters["distillspec"] = self.references["distillspec"]()
            drafters[label] = self.trained(label)
        return drafters

    def evaluation_verifier(self, verifier: torch.nn.Module) -> torch.nn.Module:
        return verifier

    def export(self, out_dir: str) -> Path:
        """``steering/`` (mixin folder), ``drafter/`` beside it (save_pretrained + tokenizer), and the
        other arms: ``distilled_drafter/`` and ``distillspec_steered/{drafter,steering}``."""
        out = Path(out_dir)
        self.steering_of(MAIN_ARM).standalone_copy().save_pretrained(out)
        export_drafter(
            self.plain_drafter(MAIN_ARM), self.tokenizer, out.parent / "drafter", name="SD^2 drafter"
        )
        if DISTILLED_ARM in self.drafters:
            export_drafter(
                self.plain_drafter(DISTILLED_ARM), self.tokenizer, out.parent / "distilled_drafter"
            )
        if DISTILLSPEC_STEERED_ARM in self.drafters:
            folder = out.parent / DISTILLSPEC_STEERED_ARM
            self.steering_of(DISTILLSPEC_STEERED_ARM).standalone_copy().save_pretrained(folder / "steering")
            export_drafter(self.plain_drafter(DISTILLSPEC_STEERED_ARM), self.tokenizer, folder / "drafter")
        return out

    def report_summary(self) -> dict[str, Any]:
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
            **{k: getattr(self.cfg, k) for k in keys},
            "verifier_layers": self.layers,
            "arms": list(self.drafters),
            "sources": self.sources,
            "lora": asdict(self.cfg.lora),
            "validation": self.last_validation,
        }

    def report_sections(self) -> list[str]:
        rows = []
        for label in self.drafters:
            prefix = "val" if label == MAIN_ARM else f"val/{label}"
            rows.append(
                [
                    label,
                    "yes" if label in self.steering else "no",
                    format_value(self.last_validation.get(f"{prefix}/expected_acceptance"), 3),
                    format_value(self.last_validation.get(f"{prefix}/simulated_block_efficiency"), 2),
                ]
            )
        table = markdown_table(["arm", "steered", "expected acceptance", "simulated tau"], rows, "llrr")
        return [
            "## Arms (last validation)",
            table.rstrip(),
            f"Every arm trained on the same verifier answers (T = {self.cfg.temperature}), steps and loss "
            f"({self.cfg.divergence}). Steered arms are measured with guides 1..{self.cfg.gamma} positions "
            "stale (block position i with staleness i); the evaluation below decodes with them."
            + (
                ""
                if self.cfg.train_drafter
                else " method.train_drafter=false: only the steering modules trained, the drafters stayed "
                "as loaded, and ratios are to the untouched drafter (pretrained)."
            ),
        ]
