"""The medusa method's finish step: what it exports, which drafters the evaluator measures, what its
report adds (the ``Finishable`` side of :class:`~train.methods.medusa.module.MedusaModule`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from train.decoding.proposers.heads_proposer import tree_from_accuracies
from train.export.drafter import export_drafter
from train.export.medusa_layout import export_vllm_medusa
from train.export.model_card import write_model_card
from train.methods.medusa.config import MedusaConfig
from train.methods.medusa.heads_report import heads_section
from train.models.heads import MedusaHeads
from train.models.lora import merge_lora
from train.models.ngram import NGramLM


class MedusaFinish:
    """The finish step's side of :class:`~train.methods.medusa.module.MedusaModule` (what
    :class:`train.report.Finishable` asks for): what the run exports, which drafters the evaluator
    measures, what its report adds."""

    reference_drafter: str | None = None
    artifact_dir = "heads"
    card_base = "verifier"

    # what the module holds
    cfg: MedusaConfig
    heads: MedusaHeads
    verifier: torch.nn.Module
    tokenizer: Any
    training_documents: Callable[[], list[list[int]]] | None
    export_dtype: torch.dtype
    last_validation: dict[str, float]
    rank_accuracy: list[list[float]]

    def measured_tree(self) -> list[list[int]] | None:
        """The tree built from the last validation's per-rank accuracies (None before any validation)."""
        if not self.rank_accuracy:
            return None
        return [list(p) for p in tree_from_accuracies(self.rank_accuracy, self.cfg.tree_nodes)]

    def trained_heads(self) -> MedusaHeads:
        """A copy of the heads in the verifier's dtype (``model.dtype``, what is exported and evaluated),
        recording the measured tree and per-rank accuracies in their config."""
        heads = self.heads.with_tree(self.measured_tree(), self.rank_accuracy or None)
        return heads.to(self.export_dtype).eval()

    def evaluation_verifier(self, verifier: torch.nn.Module) -> torch.nn.Module:
        """Medusa-1: the pair's verifier; Medusa-2: the fine-tuned one (adapters merged into a copy)."""
        if not self.cfg.joint:
            return verifier
        merged = merge_lora(self.verifier, self.export_dtype)
        merged.eval()
        return merged

    def drafters_to_evaluate(self) -> dict[str, torch.nn.Module]:
        return {"medusa-2" if self.cfg.joint else "medusa-1": self.trained_heads()}

    def export(self, out_dir: str) -> Path:
        """``heads/`` (mixin folder with the measured tree), ``heads_vllm/`` beside it (with its model card)
        and, for Medusa-2, the merged ``verifier/`` (safetensors + tokenizer):
        the outputs follow that verifier."""
        out = Path(out_dir)
        heads = self.trained_heads()
        heads.save_pretrained(out)
        write_model_card(
            export_vllm_medusa(heads, out.parent / f"{out.name}_vllm")
        )  # rewritten by the finish step
        if self.cfg.joint:
            export_drafter(self.verifier, self.tokenizer, out.parent / "verifier", name="Medusa-2 verifier")
        if self.cfg.ngram_orders:
            if self.training_documents is None:
                raise ValueError(
                    "method.ngram_orders needs the training split, which this module was not given"
                )
            documents = self.training_documents()
            vocab = max(heads.vocab_size, max((max(d) for d in documents if d), default=0) + 1)
            for order in self.cfg.ngram_orders:
                NGramLM(order, vocab).fit(documents).save(out / f"ngram_{order}")
        return out

    def report_summary(self) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "method": "medusa-2" if self.cfg.joint else "medusa-1",
            "num_heads": self.cfg.num_heads,
            "num_layers": self.cfg.num_layers,
            "decay": self.cfg.decay,
            "seq_len": self.cfg.seq_len,
            "self_distill": self.cfg.self_distill,
            "tree": self.measured_tree(),
            "validation": {k: v for k, v in self.last_validation.items() if math.isfinite(v)},
            "rank_accuracy": self.rank_accuracy,
        }
        if self.cfg.joint:
            lora = self.cfg.lora
            summary.update(
                lora={"r": lora.r, "alpha": lora.alpha, "target_modules": list(lora.target_modules)},
                heads_weight=self.cfg.heads_weight,
                heads_lr_multiplier=self.cfg.heads_lr_multiplier,
                backbone_frozen_steps=self.cfg.backbone_frozen_steps,
            )
        return summary

    def report_sections(self) -> list[str]:
        lossy_note = (
            "Medusa-2 fine-tunes the verifier: decoding is exact for the merged verifier exported to "
            "`verifier/`, not for the original one."
            if self.cfg.joint
            else None
        )
        return [heads_section(self.last_validation, self.measured_tree(), self.rank_accuracy, lossy_note)]
