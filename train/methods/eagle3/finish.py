"""The eagle3 method's finish step: what it exports, which drafters the evaluator measures, what its
report adds (the ``Finishable`` side of :class:`~train.methods.eagle3.module.Eagle3Module`)."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import torch

from train.export.model_card import write_model_card
from train.export.redaction import path_roots, portable_path
from train.export.speculators import check_vllm_aux_layers, export_speculators
from train.methods.eagle3.config import Eagle3Config
from train.models.eagle3_drafter import Eagle3Drafter
from train.tables import format_value, markdown_table

SPECULATORS_SUFFIX = "_speculators"

log = logging.getLogger(__name__)


class Eagle3Finish:
    """The finish step's side of :class:`~train.methods.eagle3.module.Eagle3Module` (what
    :class:`train.report.Finishable` asks for): what the run exports, which drafters the evaluator
    measures, what its report adds."""

    reference_drafter: str | None = None
    artifact_dir = "eagle3"
    card_base = "verifier"

    # what the module holds
    cfg: Eagle3Config
    drafter: Eagle3Drafter
    verifier: torch.nn.Module
    comparison: torch.nn.Module | None
    export_dtype: torch.dtype
    last_validation: dict[str, float]

    def trained_drafter(self) -> Eagle3Drafter:
        """A copy of the trained drafter in the verifier's dtype (``model.dtype``), on the CPU, in eval mode:
        what is exported and evaluated."""
        drafter = copy.deepcopy(self.drafter).to("cpu")
        return drafter.to(self.export_dtype).eval()

    def evaluation_verifier(self, verifier: torch.nn.Module) -> torch.nn.Module:
        """The pair's verifier, unchanged by training."""
        return verifier

    def drafters_to_evaluate(self) -> dict[str, torch.nn.Module]:
        """``eagle3`` (the trained drafter) and, when kept, ``pair drafter``
        (the pair's own, for chain SD)."""
        drafters: dict[str, torch.nn.Module] = {"eagle3": self.trained_drafter()}
        if self.comparison is not None:
            drafters["pair drafter"] = self.comparison
        return drafters

    def verifier_name(self, out_dir: str | None = None) -> str:
        """The verifier as the export names it: its Hub id, or its local folder made portable (relative to
        the project, ``checkpoints/smollm2/verifier``): no absolute path of this machine leaves it."""
        config = getattr(self.verifier, "config", None)
        name = str(getattr(config, "_name_or_path", "") or self.drafter.verifier_name or "verifier")
        return portable_path(name, path_roots(None, out_dir))

    def export(self, out_dir: str) -> Path:
        """``eagle3/`` (``save_pretrained``: config.json + model.safetensors, reloaded by
        ``Eagle3Drafter.from_pretrained``) and, beside it, ``eagle3_speculators/`` in the format vLLM loads
        natively, with a model card saying how vLLM serves it (license front matter included), unless
        ``method.vllm_export`` is false. vLLM's EAGLE-3 fuses exactly three verifier layers (checked at
        start-up; a drafter given here with another count gets ``eagle3/`` only, and a warning saying why,
        :func:`~train.export.speculators.check_vllm_aux_layers`)."""
        out = Path(out_dir)
        drafter = self.trained_drafter()
        drafter.save_pretrained(out)
        architectures = list(getattr(getattr(self.verifier, "config", None), "architectures", None) or [])
        name = self.verifier_name(str(out))
        if not self.cfg.vllm_export:
            log.info("method.vllm_export=false: no %s%s/ export", out.name, SPECULATORS_SUFFIX)
            return out
        try:
            check_vllm_aux_layers(drafter.aux_layers)
        except ValueError as err:
            log.warning("No %s%s/ export: %s", out.name, SPECULATORS_SUFFIX, err)
            return out
        speculators = export_speculators(
            drafter,
            out.parent / f"{out.name}{SPECULATORS_SUFFIX}",
            name,
            speculative_tokens=self.cfg.speculative_tokens,
            verifier_architectures=architectures,
        )
        write_model_card(speculators, verifier=name)  # the finish step rewrites it with the run config
        return out

    def report_summary(self) -> dict[str, Any]:
        keys = ("ttt_steps", "decay", "batch_size", "max_len", "draft_vocab_size", "speculative_tokens")
        return {
            "method": "eagle3",
            **{k: getattr(self.cfg, k) for k in keys},
            "aux_layers": list(self.drafter.aux_layers),
            "answers": self.cfg.answers or "generated",
            "validation": {k: v for k, v in self.last_validation.items() if math.isfinite(v)},
        }

    def report_sections(self) -> list[str]:
        """Per-step accuracy of the last validation and the simulated block efficiency."""
        metrics = self.last_validation
        if not metrics:
            return []
        rows = [
            [
                str(k),
                f"t+{k + 2}",
                format_value(metrics.get(f"val/acc_{k}"), 3),
                format_value(metrics.get(f"val/cond_acc_{k}"), 3),
            ]
            for k in range(self.cfg.ttt_steps)
        ]
        table = markdown_table(["step", "predicts", "accuracy", "conditional accuracy"], rows, "llrr")
        tau = metrics.get("val/simulated_block_efficiency")
        return [
            "\n\n".join(
                [
                    "## EAGLE-3 drafter (last validation)",
                    table.rstrip(),
                    "accuracy: the drafter's argmax at step k (teacher-forced on the verifier's answers, "
                    "its own states fed back as in decoding) is the verifier's argmax, over positions whose "
                    "verifier argmax lies in the draft vocabulary; conditional: the same among the chains "
                    "whose steps 0..k-1 all hit. Simulated block efficiency of the greedy chain over "
                    f"{self.cfg.ttt_steps} steps: {format_value(tau, 2)}.",
                ]
            )
        ]
