"""Evaluation results to experiment trackers: scalar means to every Lightning logger, and to a
``WandbLogger`` also the results table and the plots."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from train.evaluation.results import CONTRACT_METRICS, temperature_key

__all__ = ["log_results", "scalar_metrics"]


def scalar_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """Flat ``eval/<drafter>/<decoder>/T<t>/<metric>`` means (and ``eval/ar/T<t>/tokens_per_second``)."""
    out: dict[str, float] = {}
    for r in results["runs"]:
        prefix = f"eval/{r['drafter']}/{r['decoder']}/T{temperature_key(r['temperature'])}"
        for k in CONTRACT_METRICS:
            v = r["metrics"].get(k, {}).get("mean")
            if isinstance(v, int | float) and math.isfinite(v):
                out[f"{prefix}/{k}"] = float(v)
    for b in results.get("baseline", []):
        v = b["metrics"]["tokens_per_second"]["mean"]
        if isinstance(v, int | float) and math.isfinite(v):
            out[f"eval/ar/T{temperature_key(b['temperature'])}/tokens_per_second"] = float(v)
    return out


def _table_rows(results: Mapping[str, Any]) -> tuple[list[str | int], list[list[Any]]]:
    scalar_keys = [k for k in CONTRACT_METRICS if k != "per_position_acceptance"]
    columns: list[str | int] = [
        "drafter",
        "decoder",
        "gamma",
        "temperature",
        "n_prompts",
        "greedy_match",
        "greedy_ties",
    ]
    columns += [f"{k}_{s}" for k in scalar_keys for s in ("mean", "std")]
    rows = []
    for r in results["runs"]:
        row = [
            r["drafter"],
            r["decoder"],
            r["gamma"],
            r["temperature"],
            r["n_prompts"],
            r["greedy_match"],
            len(r.get("greedy_ties") or []),
        ]
        for k in scalar_keys:
            m = r["metrics"].get(k, {})
            row += [m.get("mean"), m.get("std")]
        rows.append(row)
    return columns, rows


def log_results(
    results: Mapping[str, Any],
    loggers: Sequence[Any],
    out_dir: str | os.PathLike[str] | None = None,
    step: int | None = None,
) -> None:
    """Scalar means to every logger; to a ``WandbLogger`` also ``eval/results`` (a ``wandb.Table``) and
    the plots in ``out_dir`` as ``wandb.Image``."""
    from lightning.pytorch.loggers import WandbLogger

    scalars = scalar_metrics(results)
    for logger in loggers:
        if scalars:
            logger.log_metrics(scalars, step=step)
        if not isinstance(logger, WandbLogger):
            continue
        import wandb

        columns, rows = _table_rows(results)
        payload: dict[str, Any] = {"eval/results": wandb.Table(columns=columns, data=rows)}
        for name in (results.get("files") or {}).get("plots", []):
            if out_dir is not None:
                payload[f"eval/{os.path.splitext(name)[0]}"] = wandb.Image(os.path.join(out_dir, name))
        logger.experiment.log(payload)
