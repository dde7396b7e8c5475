"""How many drafts the asynchronous verifier waits for: the adaptive ``min_ahead="auto"`` policy
(docs/async.md#adaptive-min_ahead).

With per-token acceptance ``a`` (independent positions, the usual model), a block of ``k`` drafts
yields ``(1 - a^(k+1)) / (1 - a)`` tokens on average, the verifier's own included, for one verifier
call over ``k + 1`` tokens (``verify + (k) * verify_per_token`` seconds: a forward over more tokens
costs more, little in bfloat16, more in float32 on a CPU). When ``ready`` drafts are published already,
waiting for ``k`` costs ``max(0, k - ready)`` more drafter steps first. The policy takes the ``k`` that
maximises tokens per second, :func:`best_wait`, with ``a`` (:func:`acceptance_estimate`), the drafter's
step and the verifier's cost line (:class:`CostLine`) measured during the same generation.
Only the schedule changes: which drafts a block holds never depends on the random draws, so the
decoder stays lossless.
"""

from __future__ import annotations

__all__ = ["CostLine", "acceptance_estimate", "best_wait", "expected_block_tokens", "verify_cost_line"]


def expected_block_tokens(acceptance: float, drafts: int) -> float:
    """Mean tokens one verification of a ``drafts``-long chain yields (accepted drafts + 1) when
    each draft is accepted with probability ``acceptance`` given the ones before it."""
    if drafts < 0:
        raise ValueError(f"drafts must be >= 0, got {drafts}")
    a = min(max(acceptance, 0.0), 1.0)
    return float(drafts + 1) if a == 1.0 else (1.0 - a ** (drafts + 1)) / (1.0 - a)


def best_wait(
    acceptance: float,
    draft_seconds: float,
    verify_seconds: float,
    ready: int,
    max_block: int,
    verify_per_token: float = 0.0,
    wait: bool = True,
) -> int:
    """The block length that maximises expected tokens per second when ``ready`` drafts are published
    and each further one takes ``draft_seconds``; a verification of ``k`` drafts takes
    ``verify_seconds + k * verify_per_token``. ``wait``: choose among 1 ... ``max_block`` (waiting for
    drafts not yet published); else among 0 ... ``min(ready, max_block)`` (0: the verifier steps alone).
    Ties go to the shorter block."""
    if max_block < 1:
        raise ValueError(f"max_block must be >= 1, got {max_block}")
    choices = range(1, max_block + 1) if wait else range(0, min(ready, max_block) + 1)
    best, best_rate = choices[0], -1.0
    for k in choices:
        seconds = max(verify_seconds + k * verify_per_token, 1e-9) + max(0, k - ready) * draft_seconds
        rate = expected_block_tokens(acceptance, k) / seconds
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


class CostLine:
    """Running sums of the verifier's calls (tokens scored, seconds), so the line is O(1) per block."""

    def __init__(self) -> None:
        self.n = 0
        self.sum_t = self.sum_s = self.sum_tt = self.sum_ts = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.n += 1
        self.sum_t += tokens
        self.sum_s += seconds
        self.sum_tt += tokens * tokens
        self.sum_ts += tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """``(seconds of a one-token call, seconds per extra token)``: the least-squares line through
        the calls added, the slope kept >= 0; with one call size only, that size's mean time and a slope
        of 0. None before any call."""
        if self.n == 0:
            return None
        mean_t, mean_s = self.sum_t / self.n, self.sum_s / self.n
        spread = self.sum_tt - self.n * mean_t * mean_t
        slope = 0.0 if spread <= 1e-12 else max((self.sum_ts - self.n * mean_t * mean_s) / spread, 0.0)
        return mean_s - slope * (mean_t - 1), slope


def verify_cost_line(tokens: list[int], seconds: list[float]) -> tuple[float, float] | None:
    """:meth:`CostLine.line` through the calls ``(tokens[i], seconds[i])``."""
    cost = CostLine()
    for t, s in zip(tokens, seconds, strict=True):
        cost.add(t, s)
    return cost.line()


def acceptance_estimate(accepted: int, tested: int, prior: float = 0.5, prior_weight: float = 2.0) -> float:
    """Per-token acceptance: accepted / tested drafts so far, shrunk towards ``prior`` by
    ``prior_weight`` pseudo-drafts (so the first blocks of a generation do not swing the policy)."""
    return (accepted + prior * prior_weight) / (tested + prior_weight)
