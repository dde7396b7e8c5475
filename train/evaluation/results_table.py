"""The Markdown rendering of a results dictionary (results.md, and the tables of report.md and the model
cards): the main table, the spread over prompts, per-position acceptance, greedy ties, the metric legend,
and why a run is slower than the verifier alone. Formatting through :mod:`train.tables`, as everywhere."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from train.evaluation.results import temperature_key
from train.evaluation.step_costs import break_even_tau, costs_line
from train.tables import format_metric, format_value, markdown_table

__all__ = ["METRIC_LEGEND", "results_table", "slower_than_baseline"]

#: Columns of the main table: (metric, decimals).
_COLUMNS: tuple[tuple[str, int], ...] = (
    ("acceptance_rate", 3),
    ("expected_acceptance", 3),
    ("block_efficiency", 2),
    ("simulated_block_efficiency", 2),
    ("verifier_tokens_per_call", 2),
    ("mbsu", 2),
    ("cost_ratio", 3),
    ("tokens_per_second", 0),
    ("speedup", 2),
    ("speedup_bound", 2),
)
_SPREAD_COLUMNS: tuple[tuple[str, int], ...] = (
    ("acceptance_rate", 3),
    ("block_efficiency", 2),
    ("tokens_per_second", 0),
    ("speedup", 2),
)


def _greedy_cell(run: Mapping[str, Any]) -> str:
    match = run.get("greedy_match")
    if match is None:
        return "n/a"
    if not match:
        return "**NO**"
    ties = len(run.get("greedy_ties") or [])
    return f"yes ({ties} tie{'' if ties == 1 else 's'})" if ties else "yes"


def _decoder_cell(run: Mapping[str, Any]) -> str:
    return str(run["decoder"]) if run.get("lossless", True) else f"{run['decoder']} (lossy)"


def _gamma_cell(run: Mapping[str, Any]) -> str:
    return "-" if run.get("gamma") is None else str(run["gamma"])


#: What the table's figures mean (the metric contract, docs/evaluation.md), shown under every rendering
#: of results: results.md, report.md and the exported model card.
METRIC_LEGEND = (
    "Metrics (draftsmith's metric contract): acceptance_rate = accepted / drafted draft tokens; "
    "expected_acceptance = mean probability that a draft passes the test (1 - TVD(p, q) when lossless); "
    "block_efficiency (tau) = generated tokens / verifier calls, the verifier's own token included, pooled "
    "over every block of a seed's prompts (sums, then the ratio, as serving engines report it; the mean "
    "± std is over seeds); per-position acceptance = P(draft i accepted | drafts before it accepted), "
    "pooled the same way; "
    "mbsu = tau / (c_param * drafter steps per verifier call + 1), c_param = drafter / verifier parameters; "
    "cost_ratio = drafter step time / verifier step time, measured; verifier_tokens_per_call = tokens the "
    "verifier scores per call; speedup = tokens/s against decoding with the verifier alone, same prompts, "
    "machine and run (below 1 means slower than not using the drafter)."
)


def slower_than_baseline(results: Mapping[str, Any]) -> list[str]:
    """One line per run whose mean speedup is below 1, explaining it from the run's own figures.

    A block costs one verifier forward over ``t`` tokens (the run's ``verifier_tokens_per_call``) plus
    ``s`` drafter steps of relative cost ``c`` (the measured ``cost_ratio``) and yields ``tau`` tokens,
    against one token per verifier step without a drafter; so breaking even needs
    tau > V(t) / V(1) + c * s, with V the verifier's measured step costs (``results["step_costs"]``;
    without them V(t) = V(1), a lower bound).
    """
    lines = []
    for r in results["runs"]:
        m = r["metrics"]

        def mean(name: str, metrics: Mapping[str, Any] = m) -> float | None:
            value = (metrics.get(name) or {}).get("mean")
            return float(value) if isinstance(value, int | float) and math.isfinite(value) else None

        speed, tau = mean("speedup"), mean("block_efficiency")
        cost, steps = mean("cost_ratio"), mean("drafter_calls_per_verifier_call")
        checked, bound = mean("verifier_tokens_per_call"), mean("speedup_bound")
        step_costs = (results.get("step_costs") or {}).get(r["drafter"])
        if speed is None or speed >= 1.0:
            continue
        line = (
            f"- {r['drafter']} / {r['decoder']} at T={temperature_key(r['temperature'])}: speedup "
            f"{format_value(speed, 2)} < 1, slower than the verifier alone"
        )
        if tau is not None and cost is not None and steps is not None:
            if step_costs and checked is not None:
                need = break_even_tau(step_costs, checked, cost * steps)
                check = (
                    f"checks {format_value(checked, 1)} tokens at "
                    f"{format_value(need - cost * steps, 2)} verifier steps and "
                )
            else:
                need, check = 1.0 + cost * steps, ""
            line += (
                f": each block {check}runs {format_value(steps, 1)} drafter steps at {format_value(cost, 2)} "
                f"of a verifier step, so it must yield tau > {format_value(need, 2)} to break even; measured "
                f"tau {format_value(tau, 2)}"
            )
            if bound is not None:
                line += f"; the best fixed draft length would have reached {format_value(bound, 2)}x"
        lines.append(line + ".")
    return lines


def results_table(results: Mapping[str, Any]) -> str:
    """The Markdown rendering of a results dictionary (results.md).

    One row per drafter x decoder x temperature with mean ± std over seeds; the baseline's tokens/s;
    the spread over prompts (every prompt and seed, speedup as per-prompt pairs); per-position
    acceptance; and any greedy ties or mismatches.
    """
    runs = list(results["runs"])
    parts = [_main_table(runs), _setup_paragraph(results)]
    costs = costs_line(results)
    if costs:
        parts.append(costs)
    slower = slower_than_baseline(results)
    if slower:
        parts.append("Slower than decoding without a drafter:\n\n" + "\n".join(slower) + "\n")
    parts.append(METRIC_LEGEND + "\n")
    parts.append(_spread_table(runs))
    per_position = _per_position_acceptance(runs)
    if per_position:
        parts.append(per_position)
    greedy = _greedy_differences(runs, results.get("config", {}).get("tie_ulps"))
    if greedy:
        parts.append(greedy)
    return "\n".join(parts)


def _main_table(runs: list[Mapping[str, Any]]) -> str:
    """One row per run: its settings, the :data:`_COLUMNS` metrics as mean ± std over seeds, greedy match."""
    header = ["drafter", "decoder", "gamma", "T", *(k for k, _ in _COLUMNS), "greedy match"]
    rows = [
        [
            r["drafter"],
            _decoder_cell(r),
            _gamma_cell(r),
            temperature_key(r["temperature"]),
            *(format_metric(r["metrics"].get(k), d) for k, d in _COLUMNS),
            _greedy_cell(r),
        ]
        for r in runs
    ]
    return markdown_table(header, rows, "llrr" + "r" * len(_COLUMNS) + "l")


def _setup_paragraph(results: Mapping[str, Any]) -> str:
    """How the figures were measured (seeds, prompts, paired timing) and the baseline's tokens/s."""
    config = results.get("config", {})
    seeds = config.get("seeds", [])
    n_prompts = results.get("prompts", {}).get("n", "?")
    baseline = ", ".join(
        f"T={temperature_key(b['temperature'])}: "
        f"{format_metric(b['metrics'].get('tokens_per_second'), 0)} tok/s"
        for b in results.get("baseline", [])
    )
    return (
        f"Mean ± std over {len(seeds)} seed{'' if len(seeds) == 1 else 's'} "
        f"({n_prompts} prompts, up to {config.get('max_new_tokens', '?')} new tokens each, one at a time). "
        f"Timing is paired: per prompt the autoregressive baseline and every decoder run back to back, in "
        f"an order rotated per prompt; speedup = decoder tokens/s / baseline tokens/s over the same prompts. "
        f"Autoregressive baseline (verifier alone): {baseline}.\n"
    )


def _spread_table(runs: list[Mapping[str, Any]]) -> str:
    """The spread over prompts, its heading above it."""
    rows = [
        [
            r["drafter"],
            _decoder_cell(r),
            temperature_key(r["temperature"]),
            *(format_metric((r.get("prompt_spread") or {}).get(k), d) for k, d in _SPREAD_COLUMNS),
        ]
        for r in runs
    ]
    heading = (
        "Spread over prompts (mean ± std over every prompt and seed; speedup per prompt against the "
        "baseline on the same prompt):\n"
    )
    table = markdown_table(
        ["drafter", "decoder", "T", *(k for k, _ in _SPREAD_COLUMNS)],
        rows,
        "lll" + "r" * len(_SPREAD_COLUMNS),
    )
    return f"{heading}\n{table}"


def _per_position_acceptance(runs: list[Mapping[str, Any]]) -> str | None:
    """A line per run that drafted a chain; None when none did."""
    pp = [r for r in runs if r["metrics"].get("per_position_acceptance")]
    if not pp:
        return None
    lines = ["Per-position acceptance P(draft i accepted | earlier accepted), mean over seeds:", ""]
    lines += [
        f"- {r['drafter']} ({r['decoder']}, T={temperature_key(r['temperature'])}): "
        f"{format_metric(r['metrics']['per_position_acceptance'])}"
        for r in pp
    ]
    return "\n".join(lines) + "\n"


def _greedy_differences(runs: list[Mapping[str, Any]], tie_ulps: Any) -> str | None:
    """A line per temperature-0 tie or mismatch with the verifier's greedy output; None when there is none."""
    notes = []
    for r in runs:
        for kind, records in (
            ("tie", r.get("greedy_ties") or []),
            ("MISMATCH", r.get("greedy_mismatches") or []),
        ):
            for rec in records:
                a, b = rec["tokens"]
                notes.append(
                    f"- {kind}: {r['drafter']} ({r['decoder']}), seed {rec['seed']}, prompt {rec['prompt']}, "
                    f"new token {rec['position']}: greedy {a} vs decoder {b}, float32 margin "
                    f"{format_value(rec.get('margin_ulps'), 1)} ulp (tolerance {format_value(tie_ulps, 1)})"
                )
    if not notes:
        return None
    return (
        "Temperature-0 differences from the verifier's greedy output (a tie: both tokens within the "
        "verifier's precision of the top logit):\n\n" + "\n".join(notes) + "\n"
    )
