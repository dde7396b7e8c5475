"""The medusa method's finish step: what it exports, which drafters the evaluator measures, what its
report adds (the ``Finishable`` side of :class:`~train.methods.medusa.module.MedusaModule`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from train.decoding.proposers.heads_proposer import tree_from_accuracies
from train.export.drafter import export_drafter
from train.export.medusa_layout import export_vllm_medusa
from train.export.model_card import write_model_card
from train.methods.medusa.heads_report import heads_section
from train.models.heads import MedusaHeads
from train.models.lora import merge_lora
from train.models.ngram import NGramLM

if TYPE_CHECKING:
    from train.methods.medusa.module import MedusaModule


def measured_tree(module: MedusaModule) -> list[list[int]] | None:
    """The tree built from the last validation's per-rank accuracies (None before any validation)."""
    if not module.rank_accuracy:
        return None
    return [list(p) for p in tree_from_accuracies(module.rank_accuracy, module.cfg.tree_nodes)]


def trained_heads(module: MedusaModule) -> MedusaHeads:
    """A copy of the heads in the verifier's dtype (``model.dtype``, what is exported and evaluated),
    recording the measured tree and per-rank accuracies in their config."""
    heads = module.heads.with_tree(module.measured_tree(), module.rank_accuracy or None)
    return heads.to(module.export_dtype).eval()


def evaluation_verifier(module: MedusaModule, verifier: torch.nn.Module) -> torch.nn.Module:
    """Medusa-1: the pair's verifier; Medusa-2: the fine-tuned one (adapters merged into a copy)."""
    if not module.cfg.joint:
        return verifier
    merged = merge_lora(module.verifier, module.export_dtype)
    merged.eval()
    return merged


def drafters_to_evaluate(module: MedusaModule) -> dict[str, torch.nn.Module]:
    return {"medusa-2" if module.cfg.joint else "medusa-1": module.trained_heads()}


def export(module: MedusaModule, out_dir: str) -> Path:
    """``heads/`` (mixin folder with the measured tree), ``heads_vllm/`` beside it (with its model card)
    and, for Medusa-2, the merged ``verifier/`` (safetensors + tokenizer): the outputs follow that verifier."""
    out = Path(out_dir)
    heads = module.trained_heads()
    heads.save_pretrained(out)
    write_model_card(
        export_vllm_medusa(heads, out.parent / f"{out.name}_vllm")
    )  # rewritten by the finish step
    if module.cfg.joint:
        export_drafter(module.verifier, module.tokenizer, out.parent / "verifier", name="Medusa-2 verifier")
    if module.cfg.ngram_orders:
        if module.training_documents is None:
            raise ValueError("method.ngram_orders needs the training split, which this module was not given")
        documents = module.training_documents()
        vocab = max(heads.vocab_size, max((max(d) for d in documents if d), default=0) + 1)
        for order in module.cfg.ngram_orders:
            NGramLM(order, vocab).fit(documents).save(out / f"ngram_{order}")
    return out


def report_summary(module: MedusaModule) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "method": "medusa-2" if module.cfg.joint else "medusa-1",
        "num_heads": module.cfg.num_heads,
        "num_layers": module.cfg.num_layers,
        "decay": module.cfg.decay,
        "seq_len": module.cfg.seq_len,
        "self_distill": module.cfg.self_distill,
        "tree": module.measured_tree(),
        "validation": {k: v for k, v in module.last_validation.items() if math.isfinite(v)},
        "rank_accuracy": module.rank_accuracy,
    }
    if module.cfg.joint:
        lora = module.cfg.lora
        summary.update(
            lora={"r": lora.r, "alpha": lora.alpha, "target_modules": list(lora.target_modules)},
            heads_weight=module.cfg.heads_weight,
            heads_lr_multiplier=module.cfg.heads_lr_multiplier,
            backbone_frozen_steps=module.cfg.backbone_frozen_steps,
        )
    return summary


def report_sections(module: MedusaModule) -> list[str]:
    lossy_note = (
        "Medusa-2 fine-tunes the verifier: decoding is exact for the merged verifier exported to "
        "`verifier/`, not for the original one."
        if module.cfg.joint
        else None
    )
    return [heads_section(module.last_validation, module.measured_tree(), module.rank_accuracy, lossy_note)]
