"""Draft or take a plain step: a gate for decoders whose draft has a fixed shape (:class:`DraftGate`).

A chain whose length is chosen by cost (:mod:`train.decoding.length_policy`) already takes a plain
verifier step where no draft pays. A fixed shape (a tree of set branching, RSD's beams, a chain of set
gamma) cannot shorten itself, so on a machine where its check and its drafter steps cost more than the
tokens it adds, every block loses time. The gate asks, before the drafter runs, whether the shape's
drafted blocks have been worth their cost so far:

    drafted rate = tokens the drafted blocks committed / what they cost (their measured step costs)
    plain rate   = 1 / V(1)

A drafted block costs ``V(n + 1) + s * D`` (n draft tokens checked, s drafter forwards; the pair's
measured :class:`~train.decoding.costs.StepCosts`) and commits its accepted tokens plus one. Both sums
decay by ``decay`` per drafted block, so the rate follows the text. Until ``warmup`` blocks of a
sampling regime have been drafted the gate drafts; after ``probe_every`` plain steps in a row it drafts
``probe_blocks`` blocks (a *probe*), so a rate that was low can recover, and after each such probe that
does not pay the interval doubles, up to ``probe_longest`` (:class:`~train.decoding.probes.Probes`). A
probe that paid beyond doubt (:func:`surely_pays`: its mean tokens per block lowered by two standard
errors still pays) restarts the decayed rate from its own blocks: blended into a rate that decays over
about ten blocks, two blocks would move it too little to tell, and the gate would need probes of four or
more blocks, each costing about two steps for a token where a check is steep. Any other probe is blended
into the rate as a drafted block always is. (Restarting on any probe that paid measured worse: a
drafter whose blocks pay one time in three passes a two-block probe often enough by luck, drafts
again, loses, and its probe interval falls back to the shortest: on the real pair in bfloat16 at T = 0
the pretrained drafter's trees checked 2.11 tokens a verifier call against 1.52, block efficiency 1.05
either way.)

The warm-up is long (16 blocks): a gate that judged after 4 blocks shut out, on the real pair at
T = 0, a chain that paid 1.15x ungated (4 first blocks rejected happen to a drafter accepting 30% of
first drafts one time in four).
But where a check costs twice a step (float32 on a CPU), 16 drafted blocks that do not pay cost a decoder
about 3% of a 512-token run, so from ``warmup_least`` (4) blocks on the warm-up ends early once even an
optimistic reading of its blocks loses (:func:`hopeless`: their mean tokens per block plus two standard
errors, the spread at least ``warmup_spread`` tokens, against their cost): four one-token blocks of a
tree costing 2.3 steps end it, the same four of a chain costing 1.4 steps (bfloat16) do not. A probe ends
early by the same rule read on its own blocks: where one drafted block cannot pay even at its
optimistic reading (a one-token block of a tree costing 2.6 steps), the probe's other blocks are plain
steps; where it could (the same block of a chain costing 1.2 steps), the probe drafts all its blocks.
Probes of four blocks (the rule before probes were judged on their own) cost gated chains in float32
about 4% of a 512-token run (about six probes of four blocks at 1.9 steps for 1.1-1.3 tokens each: a
DFlash chain of 8 at T = 1, 0.92x of plain decoding); two-block probes half of that.

**A fallback shape.** A decoder may give a cheaper draft of the same drafter to fall back on where its
shape does not pay (a tree's chain, its length chosen by cost: ``fallback_gamma`` of the tree and EAGLE-3
decoders; a DFlash block's cut, ``fallback_cut``).
:meth:`DraftGate.choose` then picks one of three per block: the shape, the fallback or a plain step
(which the fallback's own length policy may still choose). The shape must beat the better of a plain
step and the fallback's rate (tokens its blocks committed over their cost, decayed like the shape's, a
plain step counted as one token for ``V(1)``; once ``warmup_least`` fallback blocks were seen), so a tree
that pays less than its chain gives way to it, and a tree that pays more keeps its blocks. Where the shape
holds, the fallback is tried: ``warmup_least`` blocks right after the shape's warm-up, then one block after
``probe_every`` shape blocks in a row, the interval doubling while the shape keeps winning (a stale
fallback rate would otherwise hide a chain that now pays more); never inside a probe of the shape's.

**Lossless.** The decision depends only on earlier blocks (what they committed) and on the costs measured
before generation, never on this block's draws; a plain step draws the next token from the verifier's
p, a drafted block is verified by the decoder's rule as before. So every block is exact given the
sequence before it, whichever it is, and so is the whole output (the argument of docs/decoding.md,
"A draft length chosen by cost"). The costs come from the cache of measured costs, not from this run's
clock, so a seed reproduces the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from train.decoding.costs import StepCosts
from train.decoding.probes import Probes

__all__ = [
    "FALLBACK",
    "PLAIN_STEPS",
    "SHAPE",
    "DraftGate",
    "check_fallback_cut",
    "check_fallback_gamma",
    "drafting_pays",
    "hopeless",
    "plain_step_gate",
    "surely_pays",
]

#: :meth:`DraftGate.choose`'s answers besides None (a plain step): the decoder's shape, or its fallback.
SHAPE, FALLBACK = "shape", "fallback"


def drafting_pays(tokens: float, seconds: float, plain_seconds: float) -> bool:
    """Whether blocks that committed ``tokens`` in ``seconds`` beat plain steps of ``plain_seconds``
    (one token each): ``tokens / seconds >= 1 / plain_seconds``. Pure."""
    if seconds <= 0 or plain_seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds!r} and {plain_seconds!r}")
    return tokens * plain_seconds >= seconds


def hopeless(
    count: int, tokens: float, squares: float, seconds: float, plain_seconds: float, spread: float
) -> bool:
    """Whether ``count`` drafted blocks that committed ``tokens`` (their squares summing to ``squares``) in
    ``seconds`` lose to plain steps of ``plain_seconds`` even read optimistically: their mean tokens per
    block raised by two standard errors, the spread at least ``spread`` tokens (a few blocks that all
    committed one token say little about a drafter that passes a third of its first drafts). Pure."""
    if count < 1:
        return False
    return (tokens + _two_errors(count, tokens, squares, spread)) * plain_seconds < seconds


def surely_pays(
    count: int, tokens: float, squares: float, seconds: float, plain_seconds: float, spread: float
) -> bool:
    """Whether ``count`` drafted blocks (as in :func:`hopeless`) beat plain steps even read pessimistically:
    their mean tokens per block lowered by two standard errors, the spread at least ``spread``. Pure."""
    if count < 1:
        return False
    return (tokens - _two_errors(count, tokens, squares, spread)) * plain_seconds >= seconds


def _two_errors(count: int, tokens: float, squares: float, spread: float) -> float:
    """Two standard errors of the tokens ``count`` blocks committed, summed: 2 x deviation x sqrt(count),
    the deviation at least ``spread``."""
    mean = tokens / count
    deviation = max(spread, math.sqrt(max(0.0, squares / count - mean * mean)))
    return 2.0 * deviation * math.sqrt(count)


@dataclass
class _Tally:
    """Undecayed sums over drafted blocks: how many, the tokens they committed, their squares, seconds."""

    blocks: int = 0
    tokens: float = 0.0
    squares: float = 0.0
    seconds: float = 0.0

    def add(self, committed: int, seconds: float) -> None:
        self.blocks += 1
        self.tokens += committed
        self.squares += committed * committed
        self.seconds += seconds

    def hopeless(self, plain_seconds: float, spread: float) -> bool:
        """:func:`hopeless` on these blocks."""
        return hopeless(self.blocks, self.tokens, self.squares, self.seconds, plain_seconds, spread)

    def surely_pays(self, plain_seconds: float, spread: float) -> bool:
        """:func:`surely_pays` on these blocks."""
        return surely_pays(self.blocks, self.tokens, self.squares, self.seconds, plain_seconds, spread)


@dataclass
class _Rate:
    """Decayed sums of what drafted blocks committed and cost, the undecayed tally the warm-up reads, and
    the tally of the probe under way."""

    probes: Probes
    tokens: float = 0.0
    seconds: float = 0.0
    #: Blocks still to draft in the current probe.
    burst: int = 0
    total: _Tally = field(default_factory=_Tally)
    #: The blocks of the probe under way (None between probes).
    probe: _Tally | None = None


@dataclass
class _FallbackRate:
    """Decayed tokens and seconds of a fallback's blocks, how many there were, and when the fallback is
    tried while the shape holds."""

    probes: Probes
    tokens: float = 0.0
    seconds: float = 0.0
    blocks: int = 0


@dataclass
class DraftGate:
    """Whether the next block drafts (see the module docstring). ``costs`` may be set after construction
    (a decoder measures them at its first call)."""

    costs: StepCosts | None = None
    warmup: int = 16
    warmup_least: int = 4
    warmup_spread: float = 0.75
    probe_every: int = 8
    probe_longest: int = 128
    probe_blocks: int = 2
    decay: float = 0.9
    _rates: dict[object, _Rate] = field(default_factory=dict, repr=False)
    _fallbacks: dict[object, _FallbackRate] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if min(self.warmup, self.warmup_least, self.probe_blocks) < 1:
            raise ValueError(
                "warmup, warmup_least and probe_blocks must be >= 1, got "
                f"{self.warmup}, {self.warmup_least}, {self.probe_blocks}"
            )
        if self.warmup_spread < 0:
            raise ValueError(f"warmup_spread must be >= 0, got {self.warmup_spread!r}")
        Probes(self.probe_every, self.probe_longest)  # checks them
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")

    def _costs(self) -> StepCosts:
        if self.costs is None:
            raise RuntimeError("DraftGate: no step costs yet (the decoder measures them at its first call)")
        return self.costs

    def rate(self, regime: object) -> _Rate:
        if regime not in self._rates:
            self._rates[regime] = _Rate(Probes(self.probe_every, self.probe_longest))
        return self._rates[regime]

    def should_draft(self, regime: object, rival: float | None = None) -> bool:
        """Draft this block (True) or take the other step: a plain step, or where the decoder has a
        cheaper shape to fall back on, that shape; ``rival``: what a token of that fallback has cost
        (seconds), when it beats a plain step's. The shape must then beat the fallback's rate."""
        rate = self.rate(regime)
        plain = self._costs().check(1)
        if rival is not None:
            plain = min(plain, rival)
        if rate.burst and rate.probe is not None and rate.probe.hopeless(plain, self.warmup_spread):
            rate.burst = 0  # the probe's own blocks lose even read optimistically: it ends here
        if rate.burst:
            rate.burst -= 1
            return True
        if rate.probe is not None and rate.probe.surely_pays(plain, self.warmup_spread):
            rate.tokens, rate.seconds = rate.probe.tokens, rate.probe.seconds  # the probe paid: start from it
        rate.probe = None
        if self._warming(rate, plain) or drafting_pays(rate.tokens, rate.seconds, plain):
            rate.probes.accepted()
            return True
        if rate.probes.refused():
            rate.burst = self.probe_blocks - 1
            rate.probe = _Tally()
            return True
        return False

    def fallback_rate(self, regime: object) -> _FallbackRate:
        if regime not in self._fallbacks:
            self._fallbacks[regime] = _FallbackRate(Probes(self.probe_every, self.probe_longest))
        return self._fallbacks[regime]

    def rival(self, regime: object) -> float | None:
        """Seconds a token of the fallback has cost in ``regime`` (None: fewer than ``warmup_least`` of
        its blocks seen)."""
        fallback = self._fallbacks.get(regime)
        if fallback is None or fallback.blocks < self.warmup_least:
            return None
        return fallback.seconds / fallback.tokens

    def choose(self, regime: object, has_fallback: bool) -> str | None:
        """This block's draft: :data:`SHAPE`, :data:`FALLBACK` (only where ``has_fallback``) or None (a
        plain step); see the module docstring."""
        if not has_fallback:
            return SHAPE if self.should_draft(regime) else None
        fallback = self.fallback_rate(regime)
        if not self.should_draft(regime, self.rival(regime)):
            fallback.probes.accepted()
            return FALLBACK
        rate = self.rate(regime)
        if rate.probe is not None:
            return SHAPE  # the shape's probe drafts its blocks
        if fallback.blocks < self.warmup_least:  # the fallback's warm-up, once the shape's is over
            return FALLBACK if rate.total.blocks >= self.warmup else SHAPE
        return FALLBACK if fallback.probes.refused() else SHAPE

    def record_fallback(self, regime: object, committed: int, seconds: float) -> None:
        """A fallback block (drafted, or a plain step its length policy chose) committed ``committed``
        tokens at a cost of ``seconds``."""
        fallback = self.fallback_rate(regime)
        fallback.tokens = fallback.tokens * self.decay + committed
        fallback.seconds = fallback.seconds * self.decay + seconds
        fallback.blocks += 1

    def _warming(self, rate: _Rate, plain_seconds: float) -> bool:
        """Still in the warm-up: fewer than ``warmup`` drafted blocks, and from ``warmup_least`` on, not
        :func:`hopeless`."""
        if rate.total.blocks >= self.warmup:
            return False
        return rate.total.blocks < self.warmup_least or not rate.total.hopeless(
            plain_seconds, self.warmup_spread
        )

    def block_seconds(self, checked: int, drafter_steps: int) -> float:
        """What a drafted block costs: a verifier forward over ``checked`` draft tokens and the last
        committed one, and ``drafter_steps`` drafter forwards."""
        costs = self._costs()
        return costs.check(checked + 1) + drafter_steps * costs.draft

    def record(self, regime: object, committed: int, seconds: float) -> None:
        """A drafted block committed ``committed`` tokens (its accepted drafts and one more) and cost
        ``seconds`` (:meth:`block_seconds`)."""
        rate = self.rate(regime)
        rate.tokens = rate.tokens * self.decay + committed
        rate.seconds = rate.seconds * self.decay + seconds
        rate.total.add(committed, seconds)
        if rate.probe is not None:
            rate.probe.add(committed, seconds)


#: A decoder's ``plain_steps`` values: ``auto`` (gated) and ``never`` (a draft every block).
PLAIN_STEPS = ("auto", "never")


def plain_step_gate(plain_steps: str, costs: StepCosts | None = None) -> DraftGate | None:
    """A decoder's ``plain_steps`` setting, checked, as a gate under ``costs`` (None: measured by the
    decoder at its first call); None for ``never``."""
    if plain_steps not in PLAIN_STEPS:
        raise ValueError(f"plain_steps must be one of {PLAIN_STEPS}, got {plain_steps!r}")
    return DraftGate(costs) if plain_steps == "auto" else None


def check_fallback_gamma(fallback_gamma: int, plain_steps: str) -> int:
    """A gated tree's ``fallback_gamma`` (the longest chain of the same drafter it falls back on, its length
    chosen by cost; 0: a plain step), checked: an integer >= 0, and only behind a gate
    (``plain_steps="auto"``)."""
    if isinstance(fallback_gamma, bool) or not isinstance(fallback_gamma, int) or fallback_gamma < 0:
        raise ValueError(f"fallback_gamma must be an integer >= 0 (0 = a plain step), got {fallback_gamma!r}")
    if fallback_gamma and plain_steps != "auto":
        raise ValueError(
            "fallback_gamma is the chain a gated tree falls back on: it needs plain_steps='auto', "
            f"got plain_steps={plain_steps!r}"
        )
    return fallback_gamma


def check_fallback_cut(fallback_cut: bool, plain_steps: str, draft_length: str, **excluded: object) -> None:
    """A gated fixed chain's ``fallback_cut`` (where its whole chain has not paid, the same drafter's chain
    cut by cost instead of a plain step), checked: true or false, and only for a fixed chain behind a gate,
    none of the ``excluded`` settings on (a DFlash tree, a confidence stop)."""
    if not isinstance(fallback_cut, bool):
        raise ValueError(f"fallback_cut must be true or false, got {fallback_cut!r}")
    if fallback_cut and (plain_steps != "auto" or draft_length != "fixed" or any(excluded.values())):
        given = "".join(f", {name}={value!r}" for name, value in excluded.items())
        raise ValueError(
            "fallback_cut is what a gated fixed chain falls back on: it needs plain_steps='auto', "
            f"draft_length='fixed' and none of {', '.join(excluded)}, got plain_steps={plain_steps!r}, "
            f"draft_length={draft_length!r}{given}"
        )
