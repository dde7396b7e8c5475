"""The finish step every training method shares: export first, then evaluate, then report.

A method's LightningModule says only *what* to evaluate and *how* to save its artifact (the
:class:`Finishable` protocol); :func:`finish` does the rest, in an order chosen so that a failure
late in the step never loses the trained drafter:

1. **export**: ``module.export(<run_dir>/drafter)`` writes the artifact, and its model card is
   written at once with the run's config (no figures yet);
2. **evaluation**: every drafter of ``module.drafters_to_evaluate()`` against the verifier with
   :func:`train.evaluation.evaluate_drafters` under the run's ``eval`` config (decoders, gammas,
   temperatures, seeds), on prompts from the run's data config; the evaluator's own outputs go to
   ``<run_dir>/eval/``. If it raises, :class:`EvaluationError` says where the exported drafter is;
3. **report**: ``report.json`` and ``report.md`` in the run directory: the metric contract per
   drafter, decoder and temperature, the decoder (gamma) with the best measured speedup, and each
   drafter's ratios to the reference drafter (block efficiency, speedup) at equal decoder and
   temperature;
4. **card**: the exported card is rewritten with the evaluation table (the weights are already on disk).

``train.cli.train_command`` calls :func:`finish` on rank 0 after ``Trainer.fit`` for any module that
implements the protocol. Every figure is rendered by :mod:`train.tables` or
:func:`train.evaluation.results_table`; nothing here formats a number itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from train.evaluation import (
    EvalConfig,
    build_prompts,
    by_temperature,
    evaluate_drafters,
    results_table,
    to_jsonable,
)
from train.evaluation.decoder_build import drafter_kind
from train.evaluation.intervals import interval_sections, paired_figures
from train.export.model_card import write_model_card
from train.models.loading import eos_token_ids
from train.tables import format_metric, format_value, markdown_table

log = logging.getLogger(__name__)

__all__ = [
    "REPORT_SCHEMA",
    "EvaluationError",
    "Finishable",
    "RunContext",
    "build_report",
    "finish",
    "report_markdown",
]

REPORT_SCHEMA = "draftsmith.report/1"
RATIO_METRICS: tuple[str, ...] = ("block_efficiency", "accepted_per_block", "speedup")


class EvaluationError(RuntimeError):
    """The evaluation of the finish step failed; the message names the exported drafter's folder."""


@runtime_checkable
class Finishable(Protocol):
    """What a method's LightningModule supplies to the shared finish step."""

    reference_drafter: str | None
    """The label in :meth:`drafters_to_evaluate` that ratios are taken against (e.g. ``"before"``);
    None: no ratios."""

    artifact_dir: str
    """The run-directory folder the artifact is exported to (``drafter``, ``heads``)."""

    card_base: str
    """Which model of the run's ``model`` config the artifact is built on (``drafter`` or ``verifier``):
    the model card's ``base_model``."""

    def drafters_to_evaluate(self) -> Mapping[str, torch.nn.Module]:
        """``{label: drafter}`` to measure against the verifier, e.g. ``{"before": d0, "after": d1}``;
        empty: nothing is evaluated."""
        ...

    def evaluation_verifier(self, verifier: torch.nn.Module) -> torch.nn.Module:
        """The verifier the drafters are measured against: the run's own ``verifier``, or one the method
        trained (Medusa-2)."""
        ...

    def export(self, out_dir: str) -> str | os.PathLike[str]:
        """Save the trained artifact into ``out_dir`` (created if missing); return the folder."""
        ...

    def report_summary(self) -> dict[str, Any]:
        """The method's settings as they should appear in ``report.json`` (plain values)."""
        ...

    def report_sections(self) -> list[str]:
        """Markdown sections of the method's own (e.g. per-head accuracy) for ``report.md`` and the
        terminal summary; may be empty."""
        ...


@dataclass(frozen=True)
class RunContext:
    """The run being finished, as the finish step needs it: ``run_dir`` (where the artifact, the
    evaluation and the report go), ``eval`` (the run's ``eval`` config; None: no evaluation), ``data`` and
    ``seed`` (the run's data config and the prompt cut's seed, for :func:`train.evaluation.build_prompts`),
    ``name`` (the report's title), ``config`` (the resolved run config, for the model card), ``loggers``
    and ``step`` (the evaluation logs ``eval/...`` scalars there), ``device`` (where the evaluation runs;
    None: where the verifier is) and ``drafter_device`` (where drafter models run; None: the same device;
    prediction heads always sit with the verifier, whose states they read)."""

    run_dir: str | os.PathLike[str]
    eval: EvalConfig | None = None
    data: Any = None
    seed: int = 0
    name: str = "run"
    config: Mapping[str, Any] | None = None
    loggers: Sequence[Any] | None = None
    step: int | None = None
    device: torch.device | str | None = None
    drafter_device: torch.device | str | None = None


def finish(
    module: Finishable, verifier: torch.nn.Module, tokenizer: Any, context: RunContext
) -> dict[str, Any]:
    """Export, evaluate and report one finished run (call it on rank 0 only); return the report.

    verifier / tokenizer: the run's pair; context: the run (:class:`RunContext`). Raises
    :class:`EvaluationError` (chained to the cause) when the evaluation fails; the drafter is exported by
    then and ``report.json`` records the error.
    """
    run_dir, eval_cfg, config = context.run_dir, context.eval, context.config
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    drafter_dir = Path(module.export(str(run / module.artifact_dir)))
    model_section = (config or {}).get("model") if isinstance(config, Mapping) else None
    base_model = model_section.get(module.card_base) if isinstance(model_section, Mapping) else None
    write_model_card(drafter_dir, config=config, base_model=base_model)
    log.info("Exported the trained %s to %s", module.artifact_dir, drafter_dir)
    report: dict[str, Any] = {
        "schema": REPORT_SCHEMA,
        "name": context.name,
        "method": module.report_summary(),
        "drafter_dir": str(drafter_dir),
    }
    sections = module.report_sections()
    drafters = dict(module.drafters_to_evaluate()) if eval_cfg is not None else {}
    results = None
    if drafters:
        assert eval_cfg is not None
        try:
            target = module.evaluation_verifier(verifier)
            results = _evaluate(target, tokenizer, drafters, eval_cfg, context)
        except Exception as err:
            report["evaluation_error"] = f"{type(err).__name__}: {err}"
            _write_json(run / "report.json", report)
            raise EvaluationError(
                f"the evaluation failed ({type(err).__name__}: {err}); "
                f"the trained drafter was exported before it and is at {drafter_dir}"
            ) from err
        report.update(build_report(results, module.reference_drafter))
        report["evaluation_dir"] = str(run / "eval")
    _write_json(run / "report.json", report)
    text = report_markdown(report, results, sections)
    (run / "report.md").write_text(text, encoding="utf-8")
    if results is not None:
        write_model_card(drafter_dir, config=config, results=results, base_model=base_model)
    print(terminal_summary(report, run.resolve(), sections), flush=True)
    return report


def _evaluate(
    verifier: torch.nn.Module,
    tokenizer: Any,
    drafters: dict[str, torch.nn.Module],
    cfg: EvalConfig,
    context: RunContext,
) -> dict[str, Any]:
    device, drafter_device = context.device, context.drafter_device
    if device is not None:
        verifier.to(device)
    device = next(verifier.parameters()).device
    for drafter in drafters.values():  # reloaded or merged copies are on the CPU until placed here
        drafter.to(device if drafter_kind(drafter) == "heads" else (drafter_device or device))
    prompts = build_prompts(tokenizer, context.data, cfg.num_prompts, cfg.prompt_len, seed=context.seed)
    return evaluate_drafters(
        verifier,
        drafters,
        prompts,
        cfg,
        eos_token_id=eos_token_ids(tokenizer, verifier, *drafters.values()),
        out_dir=Path(context.run_dir) / "eval",
        loggers=context.loggers,
        step=context.step,
    )


# ----------------------------------------------------------------------------- the report


def _mean(entry: Any) -> float | None:
    """The mean of an aggregated metric, None when missing or not finite."""
    value = entry.get("mean") if isinstance(entry, Mapping) else entry
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _ratio(a: Any, b: Any) -> float | None:
    num, den = _mean(a), _mean(b)
    return num / den if num is not None and den else None


def build_report(results: Mapping[str, Any], reference: str | None = None) -> dict[str, Any]:
    """The evaluation part of ``report.json`` from :func:`train.evaluation.evaluate_drafters`' results.

    Keys: ``reference``; ``decoders`` (labels, e.g. ``sd@g2``); ``drafters``: {drafter: {decoder:
    {temperature: metric contract}}} (:func:`train.evaluation.by_temperature`); ``best``: {drafter:
    {temperature: {"decoder", "gamma", "speedup", "block_efficiency"}}}, the decoder with the highest
    mean speedup; ``ratios``: {drafter: {decoder: {temperature: {metric: mean / reference mean}}}} for
    every drafter but the reference (the metrics of ``RATIO_METRICS``); ``evaluation_seconds``.
    """
    runs = results["runs"]
    names = list(dict.fromkeys(r["drafter"] for r in runs))
    labels = list(dict.fromkeys(r["decoder"] for r in runs))
    ran = {name: list(dict.fromkeys(r["decoder"] for r in runs if r["drafter"] == name)) for name in names}
    # a drafter runs the decoders that take its kind (an EAGLE-3 drafter and a drafter model share none)
    per: dict[str, dict[str, dict[str, Any]]] = {
        name: {label: by_temperature(results, name, decoder=label) for label in ran[name]} for name in names
    }
    best: dict[str, dict[str, Any]] = {}
    for name, by_decoder in per.items():
        temps = list(dict.fromkeys(t for per_t in by_decoder.values() for t in per_t))
        for t in temps:
            scored = [
                (score, label)
                for label, per_t in by_decoder.items()
                if (score := _mean(per_t.get(t, {}).get("speedup"))) is not None
            ]
            if not scored:
                continue
            label = max(scored, key=lambda item: item[0])[1]
            entry = by_decoder[label][t]
            best.setdefault(name, {})[t] = {
                "decoder": label,
                "gamma": entry.get("gamma"),
                "speedup": entry.get("speedup"),
                "block_efficiency": entry.get("block_efficiency"),
            }
    ratios: dict[str, Any] = {}
    if reference is not None and reference in per:
        for name in names:
            if name == reference:
                continue
            ratios[name] = {
                label: {
                    t: {
                        m: _ratio(metrics.get(m), per[reference][label].get(t, {}).get(m))
                        for m in RATIO_METRICS
                    }
                    for t, metrics in per[name][label].items()
                }
                for label in ran[name]
                if label in per[reference]
            }
    return {
        "reference": reference,
        "decoders": labels,
        "drafters": per,
        "best": best,
        "ratios": ratios,
        **paired_figures(runs, reference),
        "evaluation_seconds": results.get("elapsed_seconds"),
    }


def report_markdown(
    report: Mapping[str, Any], results: Mapping[str, Any] | None = None, sections: Sequence[str] = ()
) -> str:
    """``report.md``: where the artifact is, the method's own sections, the evaluation table, the best
    decoders and the ratios."""
    summary = report.get("method") or {}
    title = f"# {report.get('name', 'run')}: {summary.get('method', 'training run')}"
    parts = [title, f"The trained artifact is exported to `{report['drafter_dir']}`.", *sections]
    if results is None:
        parts.append("No evaluation was run (no `eval` config, or the method names no drafter to evaluate).")
        return "\n\n".join(parts) + "\n"
    parts += ["## Evaluation", results_table(results).rstrip(), *summary_sections(report)]
    return "\n\n".join(parts) + "\n"


def summary_sections(report: Mapping[str, Any]) -> list[str]:
    """The best decoder per drafter and temperature, and the ratios to the reference drafter: the end
    of ``report.md`` and what the terminal shows after a run."""
    parts: list[str] = []
    best_rows = [
        [
            name,
            t,
            b["decoder"],
            format_value(b["gamma"], 0),
            format_metric(b["speedup"], 2),
            format_metric(b["block_efficiency"], 2),
        ]
        for name, per_t in report.get("best", {}).items()
        for t, b in per_t.items()
    ]
    if best_rows:
        parts += [
            "## Best measured speedup",
            markdown_table(
                ["drafter", "T", "decoder", "gamma", "speedup", "block_efficiency"], best_rows, "llllrr"
            ).rstrip(),
        ]
    parts += interval_sections(report)
    ratio_rows = [
        [name, label, t, *(r[m] for m in RATIO_METRICS)]
        for name, by_decoder in report.get("ratios", {}).items()
        for label, per_t in by_decoder.items()
        for t, r in per_t.items()
    ]
    if ratio_rows:
        reference = report["reference"]
        parts += [
            f"## Ratios to `{reference}`",
            f"Mean of each drafter / mean of `{reference}`, same decoder, temperature, prompts and seeds.",
            markdown_table(
                ["drafter", "decoder", "T", *(f"{m} ratio" for m in RATIO_METRICS)],
                ratio_rows,
                "lll" + "r" * len(RATIO_METRICS),
            ).rstrip(),
        ]
    return parts


def terminal_summary(report: Mapping[str, Any], run: Path, sections: Sequence[str] = ()) -> str:
    """What a finished run prints: the method's sections, the summary tables and where everything is."""
    parts = [*sections, *(summary_sections(report) or ["No evaluation was run."])]
    parts.append(
        f"Exported: {report['drafter_dir']}\nFull report (every decoder, metric legend): {run / 'report.md'}"
        f"\nRun directory: {run}"
    )
    return "\n\n".join(parts)


def _write_json(path: Path, payload: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(to_jsonable(payload), indent=2, default=str) + "\n", encoding="utf-8")
