"""The metric contract (ARCHITECTURE.md, "The metric contract"): one definition per name.

Decoders accumulate raw counts and timings into a :class:`DecodeStats`; the functions below turn
them into the named metrics. :func:`summarize` gives the per-run dictionary, :func:`aggregate` the
mean / std / n over prompts and seeds.

Counting conventions:

- A *verifier call* is one verifier forward pass (the prompt prefill is folded into the first block's
  forward for speculative decoding, so it is one call, not two).
- A draft position is *tested* when the acceptance test is applied to it, i.e. every earlier position
  of its block was accepted. ``position_tested[i]`` is the denominator of
  ``per_position_acceptance[i]`` = P(position i accepted | positions < i accepted).
- ``sum_expected_acceptance`` sums sum_v min(p(v), q(v)) over tested positions, with p, q the warped
  distributions the test used. At temperature 0 they are one-hot, so each term is 1 if the argmaxes
  agree and 0 otherwise. Its mean estimates the per-test acceptance probability with low variance.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "DecodeResult",
    "DecodeStats",
    "accepted_per_block",
    "acceptance_rate",
    "aggregate",
    "block_efficiency",
    "cost_ratio",
    "expected_acceptance",
    "mbsu",
    "param_count",
    "per_position_acceptance",
    "simulated_block_efficiency",
    "speedup",
    "summarize",
    "tokens_per_second",
]


@dataclass
class DecodeStats:
    """Raw counts and timings accumulated by one ``generate`` call (or several, via :meth:`merge`)."""

    gamma: int = 0
    drafted: int = 0
    accepted: int = 0
    verifier_calls: int = 0
    drafter_calls: int = 0
    new_tokens: int = 0
    position_drafted: list[int] = field(default_factory=list)
    position_tested: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    tested: int = 0
    sum_expected_acceptance: float = 0.0
    wall_time: float = 0.0
    drafter_time: float = 0.0
    verifier_time: float = 0.0

    def __post_init__(self) -> None:
        for name in ("position_drafted", "position_tested", "position_accepted"):
            lst = getattr(self, name)
            if len(lst) < self.gamma:
                lst.extend([0] * (self.gamma - len(lst)))

    @property
    def forward_time(self) -> float:
        """Seconds spent inside model forward passes (drafter + verifier)."""
        return self.drafter_time + self.verifier_time

    def merge(self, other: DecodeStats) -> DecodeStats:
        """Element-wise sum of two stats objects (gamma = the larger of the two)."""
        g = max(self.gamma, other.gamma)

        def add(a: list[int], b: list[int]) -> list[int]:
            return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(g)]

        return DecodeStats(
            gamma=g,
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            verifier_calls=self.verifier_calls + other.verifier_calls,
            drafter_calls=self.drafter_calls + other.drafter_calls,
            new_tokens=self.new_tokens + other.new_tokens,
            position_drafted=add(self.position_drafted, other.position_drafted),
            position_tested=add(self.position_tested, other.position_tested),
            position_accepted=add(self.position_accepted, other.position_accepted),
            tested=self.tested + other.tested,
            sum_expected_acceptance=self.sum_expected_acceptance + other.sum_expected_acceptance,
            wall_time=self.wall_time + other.wall_time,
            drafter_time=self.drafter_time + other.drafter_time,
            verifier_time=self.verifier_time + other.verifier_time,
        )


@dataclass
class DecodeResult:
    """Output of ``decoder.generate``: ``tokens`` is the 1-D LongTensor of new tokens only."""

    tokens: torch.Tensor
    stats: DecodeStats


def _div(num: float, den: float) -> float:
    return num / den if den else float("nan")


def acceptance_rate(stats: DecodeStats) -> float:
    """Accepted draft tokens / drafted tokens (NaN when nothing was drafted)."""
    return _div(stats.accepted, stats.drafted)


def expected_acceptance(stats: DecodeStats) -> float:
    """Mean over tested draft positions of sum_v min(p(v), q(v)) = 1 - TVD(p, q)."""
    return _div(stats.sum_expected_acceptance, stats.tested)


def block_efficiency(stats: DecodeStats) -> float:
    """tau = generated tokens / verifier forward calls (counts the bonus/correction token)."""
    return _div(stats.new_tokens, stats.verifier_calls)


def accepted_per_block(stats: DecodeStats) -> float:
    """tau - 1."""
    return block_efficiency(stats) - 1.0


def per_position_acceptance(stats: DecodeStats) -> list[float]:
    """[P(draft position i accepted | positions < i accepted) for i in range(gamma)] (NaN if never tested)."""
    return [_div(a, t) for a, t in zip(stats.position_accepted, stats.position_tested, strict=False)]


def simulated_block_efficiency(a: float, gamma: int) -> float:
    """(1 - a^(gamma+1)) / (1 - a): expected tau for i.i.d. acceptance a; gamma + 1 at a = 1."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance a must be in [0, 1], got {a}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if a == 1.0:
        return float(gamma + 1)
    return (1.0 - a ** (gamma + 1)) / (1.0 - a)


def mbsu(tau: float, c_param: float, gamma: int) -> float:
    """Memory-bound speed-up tau / (c_param * gamma + 1), c_param = drafter params / verifier params."""
    return tau / (c_param * gamma + 1.0)


def cost_ratio(stats: DecodeStats) -> float:
    """Mean seconds per drafter forward / mean seconds per verifier forward, measured on this hardware."""
    return _div(
        _div(stats.drafter_time, stats.drafter_calls), _div(stats.verifier_time, stats.verifier_calls)
    )


def tokens_per_second(stats: DecodeStats) -> float:
    """New tokens / wall-clock seconds."""
    return _div(stats.new_tokens, stats.wall_time)


def speedup(method_tokens_per_second: float, autoregressive_tokens_per_second: float) -> float:
    """tokens/s of a method / tokens/s of autoregressive decoding (same prompts, machine and run)."""
    return _div(method_tokens_per_second, autoregressive_tokens_per_second)


def loop_overhead(stats: DecodeStats) -> float:
    """wall time / time inside model forwards - 1: the decoding loop's own cost relative to the models."""
    return _div(stats.wall_time, stats.forward_time) - 1.0


def param_count(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def summarize(stats: DecodeStats, c_param: float | None = None) -> dict[str, float | list[float]]:
    """All per-run metrics of ``stats`` by their contract names (plus raw counts and timings).

    ``mbsu`` is included when ``c_param`` (drafter params / verifier params) is given.
    """
    tau = block_efficiency(stats)
    ea = expected_acceptance(stats)
    out: dict[str, float | list[float]] = {
        "acceptance_rate": acceptance_rate(stats),
        "expected_acceptance": ea,
        "block_efficiency": tau,
        "accepted_per_block": tau - 1.0,
        "per_position_acceptance": per_position_acceptance(stats),
        "simulated_block_efficiency": (
            simulated_block_efficiency(ea, stats.gamma) if not math.isnan(ea) else float("nan")
        ),
        "cost_ratio": cost_ratio(stats),
        "tokens_per_second": tokens_per_second(stats),
        "loop_overhead": loop_overhead(stats),
        "new_tokens": float(stats.new_tokens),
        "drafted": float(stats.drafted),
        "accepted": float(stats.accepted),
        "verifier_calls": float(stats.verifier_calls),
        "drafter_calls": float(stats.drafter_calls),
        "wall_time": stats.wall_time,
        "drafter_time": stats.drafter_time,
        "verifier_time": stats.verifier_time,
    }
    if c_param is not None:
        out["mbsu"] = mbsu(tau, c_param, stats.gamma)
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, 0.0
    var = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
    return m, math.sqrt(var)


def aggregate(summaries: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Aggregate per-run summaries into {name: {"mean", "std", "n"}}.

    std is the sample standard deviation (ddof=1; 0 for a single run). NaN entries are skipped and
    ``n`` counts the non-NaN values. List-valued metrics (per-position acceptance) are aggregated
    element-wise, giving lists for mean / std / n.
    """
    rows = list(summaries)
    names: list[str] = []
    for r in rows:
        names.extend(k for k in r if k not in names)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        vals = [r[name] for r in rows if name in r]
        if vals and isinstance(vals[0], list | tuple):
            width = max(len(v) for v in vals)
            cols = [[float(v[i]) for v in vals if i < len(v)] for i in range(width)]
            stats = [_mean_std(c) for c in cols]
            out[name] = {
                "mean": [s[0] for s in stats],
                "std": [s[1] for s in stats],
                "n": [sum(1 for x in c if not math.isnan(x)) for c in cols],
            }
        else:
            fvals = [float(v) for v in vals]
            m, s = _mean_std(fvals)
            out[name] = {"mean": m, "std": s, "n": sum(1 for x in fvals if not math.isnan(x))}
    return out
