"""One leaderboard over several evaluations: every drafter x decoder x temperature in one table, with the
speedup each would reach at the cost ratios of real GPU pairs (docs/leaderboard.md).

The measured columns come straight from :func:`train.evaluation.evaluate_drafters`' results (the metric
contract, mean ± std over seeds). The projection is a model, labelled as such: a block costs
``c x drafter_steps`` of drafting plus one verifier call whose cost grows with the tokens it scores,
``1 + kappa x (verifier_tokens - 1)`` autoregressive steps, so

    projected speedup = tau / (c x drafter_steps + 1 + kappa x (verifier_tokens - 1))

with tau the measured block efficiency, ``drafter_steps`` the measured drafter calls per verifier call
and ``verifier_tokens`` the measured tokens per verifier call. ``c`` is the drafter/verifier step cost
of a deployment (0.05 and 0.1 are typical of a 1B drafter for an 8B-70B verifier on a GPU);
``kappa`` is the marginal cost of one more token in a memory-bound verifier forward (0.01 by default:
scoring 5 tokens costs 4% more than 1, a 64-node tree 63% more). Prediction heads make no drafter
calls (their cost is inside the verifier call), so they are projected at c = 0 whatever the column.
The asynchronous decoder is projected as if synchronous: its overlap is a property of the hardware.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from train.decoding.metrics import aggregate
from train.evaluation.results import temperature_key
from train.tables import format_metric, markdown_table

__all__ = [
    "DEFAULT_COSTS",
    "DEFAULT_KAPPA",
    "leaderboard_markdown",
    "leaderboard_rows",
    "projected_speedup",
]

DEFAULT_COSTS: tuple[float, ...] = (0.05, 0.1)
DEFAULT_KAPPA = 0.01

MEASURED: tuple[tuple[str, int], ...] = (
    ("block_efficiency", 2),
    ("acceptance_rate", 3),
    ("verifier_tokens_per_call", 2),
    ("cost_ratio", 3),
    ("tokens_per_second", 1),
    ("speedup", 2),
    ("speedup_bound", 2),
)


def projected_speedup(
    tau: float, drafter_steps: float, verifier_tokens: float, c: float, kappa: float = DEFAULT_KAPPA
) -> float:
    """tau / (c x drafter_steps + 1 + kappa x (verifier_tokens - 1)); NaN when an input is missing."""
    values = (tau, drafter_steps, verifier_tokens)
    if any(not isinstance(v, int | float) or math.isnan(v) for v in values):
        return float("nan")
    if c < 0 or kappa < 0:
        raise ValueError(f"c and kappa must be >= 0, got c={c}, kappa={kappa}")
    return tau / (c * drafter_steps + 1.0 + kappa * max(verifier_tokens - 1.0, 0.0))


def _projections(
    per_seed: Sequence[Mapping[str, Any]], costs: Sequence[float], kappa: float, heads: bool
) -> dict[str, dict[str, Any]]:
    """{"c=0.05": aggregated projected speedup over seeds, ...}."""
    out = {}
    for c in costs:
        values = [
            projected_speedup(
                float(s.get("block_efficiency", math.nan)),
                float(s.get("drafter_calls_per_verifier_call", math.nan)),
                float(s.get("verifier_tokens_per_call", math.nan)),
                0.0 if heads else c,
                kappa,
            )
            for s in per_seed
        ]
        out[f"c={c:g}"] = aggregate({"v": v} for v in values).get("v", {"mean": math.nan, "std": math.nan})
    return out


def leaderboard_rows(
    evaluations: Mapping[str, Mapping[str, Any]],
    costs: Sequence[float] = DEFAULT_COSTS,
    kappa: float = DEFAULT_KAPPA,
    heads_drafters: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """One row per autoregressive baseline and per drafter x decoder x temperature of every evaluation.

    evaluations: {verifier label: results of :func:`train.evaluation.evaluate_drafters`} (one per
    verifier: Medusa-2 has its own). heads_drafters: drafter names that are prediction heads (projected
    at c = 0). Each row: ``verifier``, ``drafter``, ``decoder``, ``temperature``, ``lossless``, ``n``
    (seeds), ``metrics`` (aggregated, the contract's names) and ``projected`` ({"c=...": aggregated})."""
    rows: list[dict[str, Any]] = []
    for verifier, results in evaluations.items():
        n_seeds = len(results.get("config", {}).get("seeds", []))
        for base in results.get("baseline", []):
            rows.append(
                {
                    "verifier": verifier,
                    "drafter": "-",
                    "decoder": "ar",
                    "temperature": base["temperature"],
                    "lossless": True,
                    "n": n_seeds,
                    "metrics": {**base["metrics"], "speedup": {"mean": 1.0, "std": 0.0, "n": n_seeds}},
                    "projected": {f"c={c:g}": {"mean": 1.0, "std": 0.0, "n": n_seeds} for c in costs},
                }
            )
        for run in results["runs"]:
            rows.append(
                {
                    "verifier": verifier,
                    "drafter": run["drafter"],
                    "decoder": run["decoder"],
                    "temperature": run["temperature"],
                    "lossless": bool(run.get("lossless", True)),
                    "n": len(run.get("seeds", [])),
                    "metrics": run["metrics"],
                    "projected": _projections(
                        run.get("per_seed", []), costs, kappa, run["drafter"] in heads_drafters
                    ),
                }
            )
    return sorted(rows, key=lambda r: (r["temperature"], r["verifier"] != next(iter(evaluations)), _order(r)))


def _order(row: Mapping[str, Any]) -> float:
    """Autoregressive first, then by measured speedup, fastest first."""
    if row["decoder"] == "ar":
        return -math.inf
    mean = row["metrics"].get("speedup", {}).get("mean")
    return -mean if isinstance(mean, int | float) and not math.isnan(mean) else math.inf


def leaderboard_markdown(rows: Sequence[Mapping[str, Any]], kappa: float = DEFAULT_KAPPA) -> str:
    """The table (one per temperature) and its legend."""
    costs = list(rows[0]["projected"]) if rows else []
    header = [
        "verifier",
        "drafter",
        "decoder",
        *(name for name, _ in MEASURED),
        "lossless",
        "n",
        *(f"projected speedup {c}" for c in costs),
    ]
    parts = []
    for t in dict.fromkeys(r["temperature"] for r in rows):
        body = [
            [
                r["verifier"],
                r["drafter"],
                r["decoder"],
                *(format_metric(r["metrics"].get(name), d) for name, d in MEASURED),
                "yes" if r["lossless"] else "no",
                str(r["n"]),
                *(format_metric(r["projected"].get(c), 2) for c in costs),
            ]
            for r in rows
            if r["temperature"] == t
        ]
        parts += [
            f"### T = {temperature_key(t)}",
            markdown_table(header, body, "lll" + "r" * (len(header) - 3)),
        ]
    parts.append(
        "Measured columns: mean ± std over n seeds on the same prompts, timed on this machine (speedup = "
        "tokens/s over the autoregressive baseline of the same verifier, same run); speedup_bound = the best "
        "speedup a chain of any fixed length reaches with the run's measured acceptance and step costs "
        "(docs/decoding.md). **Projected speedup "
        "(a model, not a measurement)**: tau / (c x drafter calls per verifier call + 1 + kappa x "
        f"(verifier tokens per call - 1)), kappa = {kappa:g}, from the measured tau and counts, at the "
        "drafter/verifier cost ratio c of a GPU deployment; heads are projected at c = 0. Lossless = the "
        "output follows the verifier's own distribution (Medusa-2's verifier is a fine-tuned one)."
    )
    return "\n\n".join(parts) + "\n"
