"""One formatting of metric values and one Markdown table writer for everything that prints figures.

Evaluation results, model cards, method reports and sweep tables all render through these three
functions, so a figure reads the same everywhere: ``mean ± std`` over seeds, ``mean (n=1)`` when a
spread is undefined, ``n/a`` when nothing was measured. This module sits at the bottom of the
layering (it imports nothing of ours).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["format_metric", "format_value", "markdown_table"]

MISSING = "n/a"


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def format_value(value: Any, digits: int = 3) -> str:
    """A number with ``digits`` decimals; ``n/a`` for None, NaN or inf; other values as ``str``."""
    if _missing(value):
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        return f"{value:.{digits}f}"
    return str(value)


def format_metric(metric: Mapping[str, Any] | float | int | None, digits: int = 3) -> str:
    """An aggregated metric ``{"mean", "std", "n"}`` as ``mean ± std``.

    A single observation (``n == 1``, std undefined) reads ``mean (n=1)``; a plain number is formatted
    as is; list-valued metrics (per-position acceptance) read ``[m1, m2, ...]`` with 2 decimals.
    """
    if metric is None:
        return MISSING
    if not isinstance(metric, Mapping):
        return format_value(metric, digits)
    mean, std, n = metric.get("mean"), metric.get("std"), metric.get("n")
    if isinstance(mean, list | tuple):
        return "[" + ", ".join(format_value(m, 2) for m in mean) + "]"
    if _missing(mean):
        return MISSING
    if isinstance(n, int) and n == 1:
        return f"{format_value(mean, digits)} (n=1)"
    if _missing(std):
        return format_value(mean, digits)
    return f"{format_value(mean, digits)} ± {format_value(std, digits)}"


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[Any]], align: Sequence[str] | str | None = None
) -> str:
    """A GitHub Markdown table. ``align``: one of ``l``/``r``/``c`` per column (or one string such as
    ``"llrr"``); default left. Cells that are not strings go through :func:`format_value`."""
    width = len(header)
    spec = list(align) if align is not None else ["l"] * width
    if len(spec) != width:
        raise ValueError(f"align has {len(spec)} entries for {width} columns")
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    try:
        rule = [marks[a] for a in spec]
    except KeyError as err:
        raise ValueError(f"align entries must be 'l', 'r' or 'c', got {err.args[0]!r}") from None
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    for i, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"row {i} has {len(row)} cells for {width} columns")
        cells = [c if isinstance(c, str) else format_value(c) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
