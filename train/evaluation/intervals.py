"""Paired comparisons with intervals: is drafter A better than drafter B, or than plain decoding?

The evaluator decodes every (seed, prompt) with every entry back to back (``results["runs"][i]
["per_prompt"]``, :data:`~train.evaluation.results.PAIRED_UNIT_FIELDS`), so two drafters under one decoder
are compared unit by unit: the same prompts, seeds and moment of the run. A figure is a ratio of pooled
sums (block efficiency = sum of new tokens / sum of verifier calls; acceptance = sum accepted / sum
drafted; tokens/s = sum of tokens / sum of seconds), and its interval is a paired percentile bootstrap
over the units (resampled with replacement, the same units for both sides).

Wall time on a shared machine is noisy in bursts: another process takes a core for a few seconds and
every decode running then is slower. The pooled ratio lets a burst in a long decode weigh by its length;
the **median of the per-unit ratios** ignores a few slow units whatever their size, so both are given,
and a speedup claim should hold for both.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from train.evaluation.results import temperature_key
from train.tables import format_metric, format_value, markdown_table

__all__ = [
    "PAIRED_RATIOS",
    "bootstrap_ratio",
    "describe",
    "interval_sections",
    "paired_figures",
    "paired_ratios",
    "speedup_interval",
]

Unit = Mapping[str, float]

#: name -> (numerator field, denominator field) of the pooled figure whose ratio is compared.
PAIRED_RATIOS: dict[str, tuple[str, str]] = {
    "block_efficiency": ("new_tokens", "verifier_calls"),
    "acceptance_rate": ("accepted", "drafted"),
    "tokens_per_second": ("new_tokens", "wall_time"),
}


def _pooled(units: Sequence[Unit], num: str, den: str) -> float:
    bottom = sum(u[den] for u in units)
    return sum(u[num] for u in units) / bottom if bottom else float("nan")


def _median(values: Sequence[float]) -> float:
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return float("nan")
    mid = len(finite) // 2
    return finite[mid] if len(finite) % 2 else (finite[mid - 1] + finite[mid]) / 2


def bootstrap_ratio(
    n: int,
    statistic: Callable[[Sequence[int]], float],
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """The ``level`` percentile interval of ``statistic(indices)`` over ``resamples`` resamplings of the
    ``n`` unit indices with replacement (seeded: the same interval every time)."""
    rng = random.Random(seed)
    values = sorted(
        v for _ in range(resamples) if math.isfinite(v := statistic([rng.randrange(n) for _ in range(n)]))
    )
    if not values:
        return float("nan"), float("nan")
    low = values[int((1 - level) / 2 * (len(values) - 1))]
    high = values[int((1 + level) / 2 * (len(values) - 1))]
    return low, high


def _unit_key(unit: Unit) -> tuple[float, float]:
    return unit.get("seed", 0), unit.get("prompt", 0)


def paired_ratios(
    units_a: Sequence[Unit], units_b: Sequence[Unit], resamples: int = 2000, seed: int = 0
) -> dict[str, dict[str, float]]:
    """``{figure: {"ratio", "low", "high", "median_unit_ratio"}}`` of A over B for every figure of
    :data:`PAIRED_RATIOS`, on the units both decoded (matched by seed and prompt)."""
    b_by_key = {_unit_key(u): u for u in units_b}
    pairs = [(a, b_by_key[_unit_key(a)]) for a in units_a if _unit_key(a) in b_by_key]
    out: dict[str, dict[str, float]] = {}
    if not pairs:
        return out
    for name, (num, den) in PAIRED_RATIOS.items():
        if not all(num in u and den in u for pair in pairs for u in pair):
            continue

        def ratio(idx: Sequence[int], num: str = num, den: str = den) -> float:
            a = _pooled([pairs[i][0] for i in idx], num, den)
            b = _pooled([pairs[i][1] for i in idx], num, den)
            return a / b if b else float("nan")

        unit_ratios = [
            (a[num] / a[den]) / (b[num] / b[den]) if a[den] and b[den] and b[num] else float("nan")
            for a, b in pairs
        ]
        low, high = bootstrap_ratio(len(pairs), ratio, resamples, seed=seed)
        out[name] = {
            "ratio": ratio(range(len(pairs))),
            "low": low,
            "high": high,
            "median_unit_ratio": _median(unit_ratios),
            "units": float(len(pairs)),
        }
    return out


def speedup_interval(units: Sequence[Unit], resamples: int = 2000, seed: int = 0) -> dict[str, float]:
    """A decoder's wall-clock speedup over the autoregressive decodes paired with it, unit by unit:
    ``{"ratio", "low", "high", "median_unit_ratio", "units"}`` (empty without paired timings)."""
    if not units or not all("ar_wall_time" in u and "ar_new_tokens" in u for u in units):
        return {}
    plain = [{**u, "new_tokens": u["ar_new_tokens"], "wall_time": u["ar_wall_time"]} for u in units]
    return paired_ratios(units, plain, resamples, seed).get("tokens_per_second", {})


def describe(interval: Mapping[str, Any], digits: int = 2) -> str:
    """``1.23x [1.10, 1.37]`` (the pooled ratio and its interval), or ``-`` when there is none."""
    ratio = interval.get("ratio") if interval else None
    if not isinstance(ratio, int | float) or not math.isfinite(ratio):
        return "-"
    return f"{ratio:.{digits}f}x [{interval['low']:.{digits}f}, {interval['high']:.{digits}f}]"


def paired_figures(runs: Sequence[Mapping[str, Any]], reference: str | None) -> dict[str, Any]:
    """``speedup_intervals``: {drafter: {decoder: {T: speedup over the paired plain decodes, with its
    interval}}}; ``paired``: {drafter: {decoder: {T: {figure: ratio to the reference drafter, with its
    interval}}}} (:mod:`train.evaluation.intervals`). Empty where the results carry no per-prompt units."""
    units = {
        (r["drafter"], r["decoder"], temperature_key(r["temperature"])): r.get("per_prompt") or []
        for r in runs
    }
    speedups: dict[str, Any] = {}
    paired: dict[str, Any] = {}
    for (name, label, t), rows in units.items():
        interval = speedup_interval(rows)
        if interval:
            speedups.setdefault(name, {}).setdefault(label, {})[t] = interval
        base = units.get((reference, label, t)) if reference is not None else None
        if name != reference and rows and base:
            figures = paired_ratios(rows, base)
            if figures:
                paired.setdefault(name, {}).setdefault(label, {})[t] = figures
    return {"speedup_intervals": speedups, "paired": paired}


def interval_sections(report: Mapping[str, Any]) -> list[str]:
    """The speedups over plain decoding and the paired ratios to the reference drafter, each with its 95%
    bootstrap interval over the (seed, prompt) units, and the median of the per-unit ratios."""
    parts: list[str] = []
    rows = [
        [
            name,
            label,
            t,
            describe(iv),
            format_metric(iv.get("median_unit_ratio"), 2),
            format_value(iv["units"], 0),
        ]
        for name, by_decoder in report.get("speedup_intervals", {}).items()
        for label, per_t in by_decoder.items()
        for t, iv in per_t.items()
    ]
    if rows:
        parts += [
            "## Speedup over plain decoding, with intervals",
            "Pooled tokens/s over the paired plain decodes of the same prompts and seeds, [95% bootstrap "
            "interval over the units]; the median of the per-unit ratios is robust to a slow burst.",
            markdown_table(
                ["drafter", "decoder", "T", "speedup [95% interval]", "median per unit", "units"],
                rows,
                "lllrrr",
            ).rstrip(),
        ]
    figures = ("block_efficiency", "acceptance_rate", "tokens_per_second")
    rows = [
        [name, label, t, *(describe(f.get(m, {}), 3) for m in figures)]
        + [format_metric(f.get("tokens_per_second", {}).get("median_unit_ratio"), 3)]
        for name, by_decoder in report.get("paired", {}).items()
        for label, per_t in by_decoder.items()
        for t, f in per_t.items()
    ]
    if rows:
        reference = report["reference"]
        parts += [
            f"## Paired against `{reference}`, with intervals",
            f"Each drafter over `{reference}` under the same decoder, prompts and seeds: pooled ratio "
            "[95% bootstrap interval over the (seed, prompt) units]. An interval that excludes 1 is a "
            "difference the run can tell from noise.",
            markdown_table(
                [
                    "drafter",
                    "decoder",
                    "T",
                    "block efficiency ratio",
                    "acceptance ratio",
                    "tokens/s ratio",
                    "tokens/s, median per unit",
                ],
                rows,
                "lllrrrr",
            ).rstrip(),
        ]
    return parts
