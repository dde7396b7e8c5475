"""What a block costs and what it yields: the cost model a draft length is chosen by (pure functions).

A block that verifies m drafted tokens feeds the verifier m + 1 tokens (the last committed token, then
the drafts) and, having run the drafter s steps, takes ``V(m + 1) + s * D`` seconds, where ``V(n)`` is
the verifier's forward over n new tokens after a cached prefix and ``D`` one drafter step
(:class:`StepCosts`, measured by :func:`train.decoding.cost_probe.step_costs`). It commits the accepted
drafts plus one token (the correction or the bonus): with ``a_i`` the chance that draft i is accepted
given that the ones before it were, ``S_i = a_1 ... a_i``, the expected yield is ``1 + S_1 + ... + S_m``
(:func:`expected_tokens`). Plain decoding yields 1 token per ``V(1)``.

:func:`best_length` picks the m that maximizes yield / time, zero included (a plain step);
:func:`speedup_bound` is the best speedup over plain decoding any fixed draft length reaches given
per-position acceptance and the costs: the bound the report prints beside each measured speedup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "StepCosts",
    "best_length",
    "best_node_count",
    "block_rate",
    "expected_tokens",
    "speedup_bound",
    "survival",
]


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one verifier forward over 1, 2, ... new tokens (``verify[n - 1]``) after a cached
    prefix, and of one drafter step (0 for a drafter that costs nothing, such as prompt lookup)."""

    verify: tuple[float, ...]
    draft: float = 0.0

    def __post_init__(self) -> None:
        if not self.verify or any(not (math.isfinite(t) and t > 0) for t in self.verify):
            raise ValueError(f"StepCosts.verify must be positive seconds for 1.. tokens, got {self.verify!r}")
        if not (math.isfinite(self.draft) and self.draft >= 0):
            raise ValueError(f"StepCosts.draft must be >= 0 seconds, got {self.draft!r}")

    def check(self, tokens: int) -> float:
        """Seconds to verify ``tokens`` new tokens in one forward; past the measured range, the last
        measured step's slope (at least zero) carries on."""
        if tokens < 1:
            raise ValueError(f"a verifier forward feeds at least 1 token, got {tokens}")
        n = len(self.verify)
        if tokens <= n:
            return self.verify[tokens - 1]
        slope = max(0.0, self.verify[-1] - self.verify[-2]) if n > 1 else 0.0
        return self.verify[-1] + slope * (tokens - n)

    def relative(self) -> list[float]:
        """``V(n) / V(1)`` for each measured n: what checking n tokens costs in one-token steps."""
        return [t / self.verify[0] for t in self.verify]

    @property
    def draft_ratio(self) -> float:
        """A drafter step in verifier steps, ``D / V(1)``."""
        return self.draft / self.verify[0]

    def to_dict(self) -> dict[str, Any]:
        return {"verify": list(self.verify), "draft": self.draft}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepCosts:
        return cls(verify=tuple(float(t) for t in data["verify"]), draft=float(data.get("draft", 0.0)))

    def __repr__(self) -> str:  # compact, for logs
        return f"StepCosts({asdict(self)})"


def survival(acceptance: Sequence[float]) -> list[float]:
    """``S_i = a_1 ... a_i``: the chance that the first i drafts are all accepted."""
    out, s = [], 1.0
    for a in acceptance:
        s *= min(1.0, max(0.0, float(a)))
        out.append(s)
    return out


def expected_tokens(acceptance: Sequence[float]) -> float:
    """Tokens a block that verifies these drafts commits on average: ``1 + S_1 + ... + S_m``."""
    return 1.0 + sum(survival(acceptance))


def block_rate(acceptance: Sequence[float], costs: StepCosts, drafter_steps: int) -> float:
    """Expected tokens per second of a block verifying ``len(acceptance)`` drafts after
    ``drafter_steps`` drafter steps."""
    return expected_tokens(acceptance) / (costs.check(len(acceptance) + 1) + drafter_steps * costs.draft)


def best_length(acceptance: Sequence[float], costs: StepCosts, drafter_steps: int) -> tuple[int, float]:
    """The prefix length m (0 .. len(acceptance)) of a drafted chain whose verification yields the most
    tokens per second, the drafter's ``drafter_steps`` already spent; with that rate."""
    return best_node_count(survival(acceptance), costs, drafter_steps)


def best_node_count(chances: Sequence[float], costs: StepCosts, drafter_steps: int) -> tuple[int, float]:
    """How many of a draft's nodes, taken best first, to verify for the most tokens per second: ``chances[i]``
    is the chance that node i and every node above it are accepted (a chain's survival ``S_i``; in a tree,
    the product along the node's path), so verifying the first m nodes yields ``1 + chances[0] + ... +
    chances[m - 1]`` tokens in ``V(m + 1)`` plus the drafter's ``drafter_steps`` already spent. The first m
    nodes must hold their parents (best first does, as a child is never likelier than its parent).
    Returns (m, that rate), m = 0 included (a plain step)."""
    best_m, best = 0, 0.0
    spent = drafter_steps * costs.draft
    total = 1.0
    for m in range(len(chances) + 1):
        if m:
            total += min(1.0, max(0.0, float(chances[m - 1])))
        rate = total / (costs.check(m + 1) + spent)
        if rate > best:
            best_m, best = m, rate
    return best_m, best


def speedup_bound(
    acceptance: Sequence[float], costs: StepCosts, drafter_steps_per_draft: float = 1.0
) -> tuple[int, float]:
    """The best speedup over plain decoding that a fixed draft length n (0 .. len(acceptance)) reaches
    when draft i is accepted with ``acceptance[i]`` given the ones before (a measured per-position
    acceptance) and each draft costs ``drafter_steps_per_draft`` drafter steps (0 for copied drafts):
    ``max_n (1 + S_1 + ... + S_n) V(1) / (V(n + 1) + n c D)``, at least 1 (n = 0). Returns (n, bound)."""
    best_n, best = 0, 1.0
    plain = costs.check(1)
    for n in range(1, len(acceptance) + 1):
        time_n = costs.check(n + 1) + n * drafter_steps_per_draft * costs.draft
        value = expected_tokens(acceptance[:n]) * plain / time_n
        if value > best:
            best_n, best = n, value
    return best_n, best
