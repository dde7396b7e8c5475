"""The dflash method's finish step: what it exports (``dflash/`` and the speculators folder vLLM loads),
which drafters the evaluator measures, what its report adds."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from train.export.dflash_speculators import export_dflash_speculators
from train.export.model_card import write_model_card
from train.methods.dflash.config import DFlashConfig
from train.methods.eagle3.finish import SPECULATORS_SUFFIX, Eagle3Finish
from train.models.dflash_drafter import DFlashDrafter
from train.tables import format_value, markdown_table

log = logging.getLogger(__name__)


class DFlashFinish(Eagle3Finish):
    """The finish step's side of :class:`~train.methods.dflash.module.DFlashModule`: as EAGLE-3's (a copy
    of the drafter in ``model.dtype``, the pair's drafter beside it), with DFlash's export and report."""

    artifact_dir = "dflash"
    cfg: DFlashConfig  # type: ignore[assignment]
    drafter: DFlashDrafter  # type: ignore[assignment]
    eagle3: torch.nn.Module | None = None
    """The EAGLE-3 drafter measured beside DFlash (set by the build; None: none)."""

    def trained_drafter(self) -> DFlashDrafter:  # type: ignore[override]
        """A copy of the trained drafter in ``model.dtype``, on the CPU, in eval mode."""
        drafter = super().trained_drafter()
        assert isinstance(drafter, DFlashDrafter)
        return drafter

    def drafters_to_evaluate(self) -> dict[str, torch.nn.Module]:
        """``dflash`` (the trained drafter; ``dspark`` with a Markov head), ``eagle3`` (the EAGLE-3 drafter
        ``method.compare_eagle3`` names, when there is one) and, when kept, ``pair drafter``."""
        drafter = self.trained_drafter()
        drafters: dict[str, torch.nn.Module] = {"dspark" if drafter.markov_rank else "dflash": drafter}
        if self.eagle3 is not None:
            drafters["eagle3"] = self.eagle3
        if self.comparison is not None:
            drafters["pair drafter"] = self.comparison
        return drafters

    def export(self, out_dir: str) -> Path:
        """``dflash/`` (``save_pretrained``, reloaded by ``DFlashDrafter.from_pretrained``) and, unless
        ``method.vllm_export`` is false, ``dflash_speculators/`` in the layout vLLM's ``dflash`` method
        loads, with a model card."""
        out = Path(out_dir)
        drafter = self.trained_drafter()
        drafter.save_pretrained(out)
        if not self.cfg.vllm_export:
            log.info("method.vllm_export=false: no %s%s/ export", out.name, SPECULATORS_SUFFIX)
            return out
        architectures = list(getattr(getattr(self.verifier, "config", None), "architectures", None) or [])
        name = self.verifier_name(str(out))
        folder = export_dflash_speculators(
            drafter,
            out.parent / f"{out.name}{SPECULATORS_SUFFIX}",
            name,
            verifier_architectures=architectures,
        )
        write_model_card(folder, verifier=name)
        return out

    def report_summary(self) -> dict[str, Any]:
        keys = (
            "num_layers",
            "block_size",
            "num_anchors",
            "slot_decay",
            "batch_size",
            "max_len",
            "draft_vocab_size",
            "markov_rank",
        )
        return {
            "method": "dflash",
            **{k: getattr(self.cfg, k) for k in keys},
            "aux_layers": list(self.drafter.aux_layers),
            "mask_token_id": self.drafter.mask_token_id,
            "answers": self.cfg.answers or "generated",
            "validation": {k: v for k, v in self.last_validation.items() if math.isfinite(v)},
        }

    def report_sections(self) -> list[str]:
        """Per-slot accuracy of the last validation and the simulated block efficiency."""
        metrics = self.last_validation
        if not metrics:
            return []
        rows = [
            [str(k), f"anchor + {k}", format_value(metrics.get(f"val/acc_{k}"), 3)]
            for k in range(1, self.cfg.block_size)
        ]
        table = markdown_table(["slot", "predicts", "accuracy"], rows, "llr")
        tau = metrics.get("val/simulated_block_efficiency")
        return [
            "\n\n".join(
                [
                    f"## {'DSpark' if self.cfg.markov_rank else 'DFlash'} drafter (last validation)",
                    table.rstrip(),
                    "accuracy: the drafter's argmax at slot k of a block anchored on an answer token is the "
                    "verifier's argmax for that position (teacher-forced: the context, and with a Markov "
                    "head the token before the slot, are the answer's), over "
                    "positions whose verifier argmax lies in the draft vocabulary. Simulated block "
                    f"efficiency of the greedy chain: {format_value(tau, 2)}.",
                ]
            )
        ]
