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
decoder stays lossless. :class:`AsyncSchedule` holds the schedule's settings.

Whether to overlap at all (``overlap="auto"``, :func:`overlap_pays`): running the two models at once
pays only where what each loses to the other (the cores or the device they share) costs less than the
drafting it hides. With the pair's step costs measured alone (``V``, ``D``) and measured while the
other model computes (``Vt``, ``Dt``, :mod:`train.decoding.overlap_probe`), a synchronous chain of
``k`` drafts takes ``V(k + 1) + k D`` per block; an overlapped block takes ``Vt(k + 1)`` plus, when a
draft is rejected (chance ``1 - a^k``), the ``k Dt`` the drafter needs to draft the next block from
the corrected sequence (its drafts past a rejection are wasted). Each side's best ``k`` (a plain step
included for the synchronous side) decides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from train.decoding.costs import StepCosts, speedup_bound

__all__ = [
    "IDLE_POLICIES",
    "OVERLAP_CHOICES",
    "AsyncSchedule",
    "CostLine",
    "acceptance_estimate",
    "best_wait",
    "expected_block_tokens",
    "overlap_pays",
    "overlapped_speedup",
    "synchronous_speedup",
    "verify_cost_line",
]


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
    gamma: int,
    verify_per_token: float = 0.0,
    wait: bool = True,
) -> int:
    """The block length that maximises expected tokens per second when ``ready`` drafts are published
    and each further one takes ``draft_seconds``; a verification of ``k`` drafts takes
    ``verify_seconds + k * verify_per_token``. ``wait``: choose among 1 ... ``gamma`` (waiting for
    drafts not yet published); else among 0 ... ``min(ready, gamma)`` (0: the verifier steps alone).
    Ties go to the shorter block."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    choices = range(1, gamma + 1) if wait else range(0, min(ready, gamma) + 1)
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


def synchronous_speedup(acceptance: float, alone: StepCosts, gamma: int) -> tuple[int, float]:
    """(k, speedup over plain decoding) of the best synchronous chain of 0 .. ``gamma`` drafts, each
    accepted with ``acceptance``, under the costs measured with each model alone."""
    return speedup_bound([acceptance] * gamma, alone)


def overlapped_speedup(
    acceptance: float, together: StepCosts, alone: StepCosts, gamma: int
) -> tuple[int, float]:
    """(k, speedup over plain decoding at ``alone``'s one-token step) of the best overlapped block of
    1 .. ``gamma`` drafts under the costs measured with both models computing at once (module
    docstring)."""
    best_k, best = 1, 0.0
    a = min(max(acceptance, 0.0), 1.0)
    for k in range(1, gamma + 1):
        seconds = together.check(k + 1) + (1.0 - a**k) * k * together.draft
        value = expected_block_tokens(a, k) * alone.check(1) / seconds
        if value > best:
            best_k, best = k, value
    return best_k, best


def overlap_pays(acceptance: float, together: StepCosts, alone: StepCosts, gamma: int) -> bool:
    """Whether the best overlapped block is expected to beat the best synchronous one (a tie does not)."""
    return (
        overlapped_speedup(acceptance, together, alone, gamma)[1]
        > synchronous_speedup(acceptance, alone, gamma)[1]
    )


#: ``auto``: overlap only where :func:`overlap_pays` (else a synchronous chain of cost-chosen length);
#: ``always``: the asynchronous schedule whatever it costs.
OVERLAP_CHOICES: tuple[str, ...] = ("auto", "always")

#: What the verifier does when no draft is ready: ``step`` (an autoregressive step) or ``wait``.
IDLE_POLICIES: tuple[str, ...] = ("step", "wait")


@dataclass(frozen=True)
class AsyncSchedule:
    """The asynchronous schedule's settings. ``gamma``: most drafts one verification takes;
    ``max_ahead``: most drafts published ahead of the verified sequence; ``min_ahead``: drafts needed before
    verifying them, or ``"auto"`` (each verification takes :func:`auto_block` drafts, waiting for them with
    ``idle="wait"``; with ``idle="step"`` at most those ready, none to step alone); ``idle``: ``step`` (a
    plain verifier step when fewer are ready) or ``wait``; ``pin_cores``: (verifier core, drafter core) on
    a CPU; ``on_block``: called with each block's length (tests)."""

    gamma: int = 8
    max_ahead: int = 8
    min_ahead: int | str = 1
    idle: str = "step"
    pin_cores: tuple[int, int] | None = None
    on_block: Callable[[int], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_count("gamma", self.gamma)
        _check_count("max_ahead", self.max_ahead)
        if self.min_ahead != "auto":
            _check_count("min_ahead", self.min_ahead, " or 'auto'")
        if self.idle not in IDLE_POLICIES:
            raise ValueError(f"idle must be one of {list(IDLE_POLICIES)}, got {self.idle!r}")
        if isinstance(self.min_ahead, int) and self.min_ahead > self.max_ahead:
            raise ValueError(f"min_ahead ({self.min_ahead}) cannot exceed max_ahead ({self.max_ahead})")
        if self.pin_cores is not None:
            if len(self.pin_cores) != 2:
                raise ValueError(f"pin_cores must be (verifier core, drafter core), got {self.pin_cores!r}")
            object.__setattr__(self, "pin_cores", (int(self.pin_cores[0]), int(self.pin_cores[1])))

    @property
    def waits(self) -> bool:
        return self.idle == "wait"


def _check_count(name: str, value: object, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1{alternative}, got {value!r}")
