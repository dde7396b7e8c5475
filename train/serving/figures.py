"""The figures of one served export, from vLLM's counters and from this project's metric contract, in the
same terms, and the table that sets them side by side.

vLLM counts, over the drafts it made (``num_drafts`` blocks of ``num_speculative_tokens``), how many
draft tokens were accepted and how many drafts had their i-th token accepted
(``accepted_per_position[i]``; a token is only accepted after every one before it). So:

- acceptance at position i, **unconditional**: ``accepted_per_position[i] / num_drafts`` = P(the first
  i + 1 drafts accepted);
- **conditional** (the metric contract's ``per_position_acceptance``): position i's count over position
  i - 1's;
- block efficiency: tokens per verifier step that drafted, ``1 + accepted / num_drafts``.

This project's evaluator reports the conditional one; the unconditional one is its running product.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "conditional_from_unconditional",
    "ours_figures",
    "serving_table",
    "unconditional_from_conditional",
    "vllm_figures",
]


def unconditional_from_conditional(conditional: Sequence[float]) -> list[float]:
    out, running = [], 1.0
    for value in conditional:
        running *= value if math.isfinite(value) else 0.0
        out.append(running)
    return out


def conditional_from_unconditional(unconditional: Sequence[float]) -> list[float]:
    out, previous = [], 1.0
    for value in unconditional:
        out.append(value / previous if previous > 0 else float("nan"))
        previous = value
    return out


def tokens_per_second(outputs: Sequence[Sequence[int]], seconds: Sequence[float]) -> float:
    total = sum(seconds)
    return sum(len(o) for o in outputs) / total if total > 0 else float("nan")


def vllm_figures(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Acceptance and block efficiency from vLLM's counter deltas
    (:func:`train.vllm.worker.spec_counters`)."""
    drafts = int(spec["num_drafts"])
    if drafts == 0:
        raise ValueError("vLLM made no drafts: speculative decoding did not run")
    unconditional = [count / drafts for count in spec["accepted_per_position"]]
    return {
        "drafts": drafts,
        "acceptance": unconditional,
        "conditional": conditional_from_unconditional(unconditional),
        "block_efficiency": 1.0 + spec["num_accepted_tokens"] / drafts,
        "acceptance_rate": spec["num_accepted_tokens"] / max(1, int(spec["num_draft_tokens"])),
    }


def ours_figures(metrics: Mapping[str, Any], k: int) -> dict[str, Any]:
    """The same figures from one run's metric contract (``results.json``'s ``metrics``),
    the first k positions."""

    def mean(value: Any) -> Any:
        return value.get("mean") if isinstance(value, Mapping) else value

    conditional = [float(v) for v in (mean(metrics["per_position_acceptance"]) or [])][:k]
    return {
        "drafts": int(mean(metrics["verifier_calls"])),
        "acceptance": unconditional_from_conditional(conditional),
        "conditional": conditional,
        "block_efficiency": float(mean(metrics["block_efficiency"])),
        "acceptance_rate": float(mean(metrics["acceptance_rate"])),
    }


def _positions(values: Sequence[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def serving_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: per export and engine, acceptance per position, block efficiency, tokens/s alone and with
    speculation (batch 1), and whether the greedy output with speculation equals the engine's own without
    (differences classified as the evaluator does: ties within the run's ``tie_ulps`` of the top logit, or
    not; :func:`train.serving.serve.equality_cell`). A row vLLM refused (``vllm`` None) gives its reason.
    """
    lines = [
        "| export | vLLM method | engine | drafts | acceptance per position (P(first i+1 accepted)) "
        "| conditional | block efficiency | tokens/s alone | tokens/s speculative | speedup | greedy equal |",
        "|---|---|---|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        for engine in ("vllm", "ours"):
            fig = row[engine]
            if fig is None:  # vLLM refused this export: its reason instead of its figures
                lines.append(
                    f"| {row['export']} | {row['method']} | vLLM {row['vllm_version']} "
                    f"| refused: {row['refused']} | | | | | | | |"
                )
                continue
            lines.append(
                f"| {row['export']} | {row['method']} "
                f"| {'vLLM ' + row['vllm_version'] if engine == 'vllm' else 'draftsmith'} "
                f"| {fig['drafts']} | {_positions(fig['acceptance'])} | {_positions(fig['conditional'])} "
                f"| {fig['block_efficiency']:.2f} | {fig['tokens_per_second_alone']:.1f} "
                f"| {fig['tokens_per_second']:.1f} "
                f"| {fig['tokens_per_second'] / fig['tokens_per_second_alone']:.2f}x "
                f"| {fig['greedy_equal']} |"
            )
    return "\n".join(lines)
