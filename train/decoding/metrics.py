"""The metric contract (docs/evaluation.md, "The metric contract"): one definition per name.

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
from dataclasses import dataclass, field, fields
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
    "drafter_calls_per_verifier_call",
    "loop_overhead",
    "mbsu",
    "param_count",
    "positional_block_efficiency",
    "per_position_acceptance",
    "simulated_block_efficiency",
    "speedup",
    "summarize",
    "tokens_per_second",
    "verifier_tokens_per_call",
]


@dataclass
class DecodeStats:
    """Raw counts and timings accumulated by one ``generate`` call (or several, via :meth:`merge`).

    Per-depth lists (``position_*``) grow with the deepest draft seen; they are not sized by ``max_draft``, so
    trees, variable-length asynchronous blocks and pooled runs with different draft lengths all fit.
    The first call of each model in a ``generate`` also encodes the prompt (the *prefill*); its time
    and count are kept apart so :func:`cost_ratio` compares decoding steps only.
    """

    #: The most draft tokens a block may verify: a chain's gamma, a tree's depth, an asynchronous
    #: ``gamma`` (informational: simulated tau uses it).
    max_draft: int = 0
    drafted: int = 0
    accepted: int = 0
    verifier_calls: int = 0
    drafter_calls: int = 0
    new_tokens: int = 0
    #: Tokens whose verifier distribution was scored, summed over calls (chain: drafts + 1 per call).
    verifier_tokens: int = 0
    #: Blocks that ended in a rejection (both caches rolled back to the accepted prefix).
    rollbacks: int = 0
    #: Drafted tokens thrown away untested (after a rejection, or stale in an asynchronous schedule).
    discarded: int = 0
    position_drafted: list[int] = field(default_factory=list)
    position_tested: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    tested: int = 0
    sum_expected_acceptance: float = 0.0
    wall_time: float = 0.0
    drafter_time: float = 0.0
    verifier_time: float = 0.0
    #: Calls (and their seconds) that encoded the prompt; excluded from :func:`cost_ratio`.
    drafter_prefill_calls: int = 0
    drafter_prefill_time: float = 0.0
    verifier_prefill_calls: int = 0
    verifier_prefill_time: float = 0.0
    #: Seconds during which the drafter and the verifier were both computing (asynchronous schedule).
    overlap_time: float = 0.0
    #: Seconds spent projecting steering guides from the verifier's states (SD^2), once per block.
    guide_time: float = 0.0
    #: Blocks whose draft was copied from the context (prompt lookup), not drafted by a model.
    lookup_blocks: int = 0

    @property
    def forward_time(self) -> float:
        """Seconds during which at least one model was computing (drafter + verifier - their overlap)."""
        return self.drafter_time + self.verifier_time - self.overlap_time

    def count_depths(self, drafted: int, tested: int, accepted: int) -> None:
        """Record one chain (or tree path) verification: depths ``< drafted`` were drafted, ``< tested``
        tested and ``< accepted`` accepted (accepted <= tested <= drafted)."""
        need = max(drafted, tested, accepted)
        for lst in (self.position_drafted, self.position_tested, self.position_accepted):
            if len(lst) < need:
                lst.extend([0] * (need - len(lst)))
        for i in range(drafted):
            self.position_drafted[i] += 1
        for i in range(tested):
            self.position_tested[i] += 1
        for i in range(accepted):
            self.position_accepted[i] += 1

    def merge(self, other: DecodeStats) -> DecodeStats:
        """Element-wise sum of two stats objects (``max_draft`` = the larger of the two)."""

        def add(a: list[int], b: list[int]) -> list[int]:
            n = max(len(a), len(b))
            return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]

        merged = DecodeStats(max_draft=max(self.max_draft, other.max_draft))
        for f in fields(DecodeStats):
            if f.name == "max_draft":
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(merged, f.name, add(a, b) if isinstance(a, list) else a + b)
        return merged


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
    """[P(draft position i accepted | positions < i accepted) for each depth drafted]
    (NaN if never tested)."""
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


def positional_block_efficiency(acceptance: Sequence[float]) -> float:
    """1 + sum_k prod_{i <= k} a_i: expected tau when the i-th draft of a block is accepted with
    probability a_i (e.g. a steered drafter whose guide is i verifications stale); equals
    :func:`simulated_block_efficiency` when every a_i is the same."""
    tau, run = 1.0, 1.0
    for a in acceptance:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance rates must be in [0, 1], got {a}")
        run *= a
        tau += run
    return tau


def drafter_calls_per_verifier_call(stats: DecodeStats) -> float:
    """Drafter forwards actually made per verifier forward (<= gamma: short final blocks, EOS drafts)."""
    return _div(stats.drafter_calls, stats.verifier_calls)


def mbsu(tau: float, c_param: float, drafter_steps: float) -> float:
    """Memory-bound speed-up tau / (c_param * drafter_steps + 1), c_param = drafter / verifier params.

    ``drafter_steps`` is the drafter calls made per verifier call (:func:`drafter_calls_per_verifier_call`),
    not the configured gamma: blocks cut short by EOS or ``max_new_tokens`` cost fewer drafter steps.
    """
    return tau / (c_param * drafter_steps + 1.0)


def verifier_tokens_per_call(stats: DecodeStats) -> float:
    """Tokens the verifier scores per call (chain: drafts + 1; tree: the tree's size + 1)."""
    return _div(stats.verifier_tokens, stats.verifier_calls)


def cost_ratio(stats: DecodeStats) -> float:
    """Seconds per drafter forward / seconds per verifier forward, measured on this hardware.

    Calls that encoded the prompt (the prefill of each model) are left out of both means: a prompt
    costs far more than a decoding step, and it would otherwise inflate the verifier's step time.
    """
    d_calls = stats.drafter_calls - stats.drafter_prefill_calls
    v_calls = stats.verifier_calls - stats.verifier_prefill_calls
    d_time = stats.drafter_time - stats.drafter_prefill_time
    v_time = stats.verifier_time - stats.verifier_prefill_time
    return _div(_div(d_time, d_calls), _div(v_time, v_calls))


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
    acceptance = expected_acceptance(stats)
    out: dict[str, float | list[float]] = {
        "acceptance_rate": acceptance_rate(stats),
        "expected_acceptance": acceptance,
        "block_efficiency": tau,
        "accepted_per_block": tau - 1.0,
        "per_position_acceptance": per_position_acceptance(stats),
        "simulated_block_efficiency": (
            simulated_block_efficiency(acceptance, stats.max_draft)
            if not math.isnan(acceptance)
            else float("nan")
        ),
        "verifier_tokens_per_call": verifier_tokens_per_call(stats),
        "drafter_calls_per_verifier_call": drafter_calls_per_verifier_call(stats),
        "cost_ratio": cost_ratio(stats),
        "tokens_per_second": tokens_per_second(stats),
        "loop_overhead": loop_overhead(stats),
        "new_tokens": float(stats.new_tokens),
        "drafted": float(stats.drafted),
        "accepted": float(stats.accepted),
        "verifier_calls": float(stats.verifier_calls),
        "drafter_calls": float(stats.drafter_calls),
        "verifier_tokens": float(stats.verifier_tokens),
        "rollbacks": float(stats.rollbacks),
        "discarded": float(stats.discarded),
        "wall_time": stats.wall_time,
        "drafter_time": stats.drafter_time,
        "verifier_time": stats.verifier_time,
        "overlap_fraction": _div(stats.overlap_time, stats.wall_time),
        "guide_time": stats.guide_time,
        "lookup_blocks": float(stats.lookup_blocks),
    }
    if c_param is not None:
        out["mbsu"] = mbsu(tau, c_param, drafter_calls_per_verifier_call(stats))
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, float("nan")  # one observation: the spread is undefined, not zero
    var = sum((v - m) ** 2 for v in vals) / (len(vals) - 1)
    return m, math.sqrt(var)


def aggregate(summaries: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Aggregate per-run summaries into {name: {"mean", "std", "n"}}.

    std is the sample standard deviation (ddof=1; NaN, i.e. undefined, for a single run). NaN entries are
    skipped and ``n`` counts the non-NaN values. List-valued metrics (per-position acceptance) are
    aggregated element-wise, giving lists for mean / std / n.
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
