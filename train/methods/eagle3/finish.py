"""The eagle3 method's finish step: what it exports, which drafters the evaluator measures, what its
report adds (the ``Finishable`` side of :class:`~train.methods.eagle3.module.Eagle3Module`)."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from train.export.model_card import write_model_card
from train.export.redaction import path_roots, portable_path
from train.export.speculators import check_vllm_aux_layers, export_speculators
from train.models.eagle3_drafter import Eagle3Drafter
from train.tables import format_value, markdown_table

if TYPE_CHECKING:
    from train.methods.eagle3.module import Eagle3Module

SPECULATORS_SUFFIX = "_speculators"

log = logging.getLogger(__name__)


def trained_drafter(module: Eagle3Module) -> Eagle3Drafter:
    """A copy of the trained drafter in the verifier's dtype (``model.dtype``), on the CPU, in eval mode:
    what is exported and evaluated."""
    drafter = copy.deepcopy(module.drafter).to("cpu")
    return drafter.to(module.export_dtype).eval()


def evaluation_verifier(module: Eagle3Module, verifier: torch.nn.Module) -> torch.nn.Module:
    """The pair's verifier, unchanged by training."""
    return verifier


def drafters_to_evaluate(module: Eagle3Module) -> dict[str, torch.nn.Module]:
    """``eagle3`` (the trained drafter) and, when kept, ``pair drafter`` (the pair's own, for chain SD)."""
    drafters: dict[str, torch.nn.Module] = {"eagle3": module.trained_drafter()}
    if module.comparison is not None:
        drafters["pair drafter"] = module.comparison
    return drafters


def verifier_name(module: Eagle3Module, out_dir: str | None = None) -> str:
    """The verifier as the export names it: its Hub id, or its local folder made portable (relative to
    the project, ``checkpoints/smollm2/verifier``): no absolute path of this machine leaves it."""
    config = getattr(module.verifier, "config", None)
    name = str(getattr(config, "_name_or_path", "") or module.drafter.verifier_name or "verifier")
    return portable_path(name, path_roots(None, out_dir))


def export(module: Eagle3Module, out_dir: str) -> Path:
    """``eagle3/`` (``save_pretrained``: config.json + model.safetensors, reloaded by
    ``Eagle3Drafter.from_pretrained``) and, beside it, ``eagle3_speculators/`` in the format vLLM loads
    natively, with a model card saying how vLLM serves it (license front matter included). vLLM's EAGLE-3
    fuses exactly three verifier layers: a drafter trained with another ``method.aux_layers`` count gets
    ``eagle3/`` only, and a warning saying why (:func:`~train.export.speculators.check_vllm_aux_layers`)."""
    out = Path(out_dir)
    drafter = module.trained_drafter()
    drafter.save_pretrained(out)
    architectures = list(getattr(getattr(module.verifier, "config", None), "architectures", None) or [])
    name = verifier_name(module, str(out))
    try:
        check_vllm_aux_layers(drafter.aux_layers)
    except ValueError as err:
        log.warning("No %s%s/ export: %s", out.name, SPECULATORS_SUFFIX, err)
        return out
    speculators = export_speculators(
        drafter,
        out.parent / f"{out.name}{SPECULATORS_SUFFIX}",
        name,
        speculative_tokens=module.cfg.speculative_tokens,
        verifier_architectures=architectures,
    )
    write_model_card(speculators, verifier=name)  # the finish step rewrites it with the run config
    return out


def report_summary(module: Eagle3Module) -> dict[str, Any]:
    keys = ("ttt_steps", "decay", "batch_size", "max_len", "draft_vocab_size", "speculative_tokens")
    return {
        "method": "eagle3",
        **{k: getattr(module.cfg, k) for k in keys},
        "aux_layers": list(module.drafter.aux_layers),
        "answers": module.cfg.answers or "generated",
        "validation": {k: v for k, v in module.last_validation.items() if math.isfinite(v)},
    }


def report_sections(module: Eagle3Module) -> list[str]:
    """Per-step accuracy of the last validation and the simulated block efficiency."""
    metrics = module.last_validation
    if not metrics:
        return []
    rows = [
        [
            str(k),
            f"t+{k + 2}",
            format_value(metrics.get(f"val/acc_{k}"), 3),
            format_value(metrics.get(f"val/cond_acc_{k}"), 3),
        ]
        for k in range(module.cfg.ttt_steps)
    ]
    table = markdown_table(["step", "predicts", "accuracy", "conditional accuracy"], rows, "llrr")
    tau = metrics.get("val/simulated_block_efficiency")
    return [
        "\n\n".join(
            [
                "## EAGLE-3 drafter (last validation)",
                table.rstrip(),
                "accuracy: the drafter's argmax at step k (teacher-forced on the verifier's answers, its own "
                "states fed back as in decoding) is the verifier's argmax, over positions whose verifier "
                "argmax lies in the draft vocabulary; conditional: the same among the chains whose steps "
                "0..k-1 all hit. Simulated block efficiency of the greedy chain over "
                f"{module.cfg.ttt_steps} steps: {format_value(tau, 2)}.",
            ]
        )
    ]
