"""A draft length chosen by expected tokens per second (:class:`CostAwareLength`), zero included.

A chain's drafts are worth verifying while the tokens they are expected to add pay for what checking
them costs. With the measured step costs (:class:`~train.decoding.costs.StepCosts`: the verifier's
forward over n tokens, a drafter step) and an estimate of each draft's acceptance, the policy answers
three questions per block:

1. **Draft at all?** (:meth:`CostAwareLength.should_draft`) Before the drafter runs, with the running
   acceptance of first drafts as the guess for every draft: if no length beats a plain verifier step,
   the block is a plain step (no drafter call). After ``probe_every`` such blocks in a row one drafts anyway,
   so the estimate can recover when the text changes; the interval doubles after each probe that does not
   pay, up to ``probe_longest`` (:class:`~train.decoding.probes.Probes`). A drafter that gives the whole
   block from one forward (DFlash) asks the same before that forward
   (:meth:`CostAwareLength.should_spend_forward`), its forward counted once.
2. **Verify this draft?** (:meth:`CostAwareLength.include`) Each time the drafter gives its distribution
   for the next position: with the calibrated acceptance of the drafts kept so far and of this one (the
   last also the guess for those to come), keep it (and draft on) while some chain through it promises
   more tokens per second than stopping before it. The first draft refused makes the block a plain step.
   Then, before the drafter runs again (:meth:`CostAwareLength.extend`), whether another drafter step,
   guessed as likely accepted as the last kept draft, can pay for itself and its check.
3. **Copy how many?** (:meth:`CostAwareLength.choose_copied`) Copied drafts (prompt lookup) are cut to
   the prefix with the most expected tokens per second (:func:`~train.decoding.costs.best_length`), by
   the acceptance copies have had at each position, at no drafter cost.

The acceptance of a draft is calibrated online from what the verifier accepted
(:class:`AcceptanceCalibration`): the drafter's confidence at that position (the largest probability of
its distribution), binned, each bin's acceptance rate shrunk towards the confidence itself (which is
what a calibrated greedy drafter would give). Calibration
is kept per sampling regime (greedy, or a temperature and cut-offs) for the life of the decoder.

**Why the output stays the verifier's.** Whether position j gets a draft depends on the committed
sequence, the drafts before it, the drafter's *distribution* at j and what earlier blocks accepted;
never on the token drawn at j, nor on this block's verification. So a draft that is kept is still a
draw from the q the rule is handed, and the chain rule's argument (docs/decoding.md) holds position
by position, for a shorter chain and an empty one (a plain step drawn from p) alike. (Choosing the
prefix after the fact, by the drawn tokens' own probabilities, would not be: keeping x only when q(x) is
high draws kept drafts from another law than q. At T > 0 that biased the output, chi-square 243 against
a critical value of 106; tests/decoding/test_cost_length.py.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from train.decoding.costs import StepCosts, best_length, best_node_count, block_rate, survival
from train.decoding.probes import Probes
from train.decoding.sampling import SamplingParams

__all__ = [
    "AcceptanceCalibration",
    "ChainOutcome",
    "CostAwareLength",
    "PositionAcceptance",
    "chain_outcomes",
    "regime",
]


def regime(params: SamplingParams) -> object:
    """The key calibration is kept under: every greedy regime is one, a sampled one is its settings."""
    return "greedy" if params.greedy else (params.temperature, params.top_k, params.top_p)


@dataclass
class AcceptanceCalibration:
    """P(a draft is accepted | the drafter gave it probability c), from tested drafts: ``bins`` equal
    bins of c, each bin's rate shrunk towards c with ``prior`` pseudo-observations."""

    bins: int = 10
    prior: float = 4.0
    accepted: list[float] = field(default_factory=list)
    tested: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted = self.accepted or [0.0] * self.bins
        self.tested = self.tested or [0.0] * self.bins

    def _bin(self, c: float) -> int:
        return min(self.bins - 1, max(0, int(c * self.bins)))

    def estimate(self, c: float) -> float:
        b = self._bin(c)
        return (self.accepted[b] + self.prior * c) / (self.tested[b] + self.prior)

    def record(self, c: float, accepted: bool) -> None:
        b = self._bin(c)
        self.tested[b] += 1.0
        self.accepted[b] += float(accepted)


@dataclass
class PositionAcceptance:
    """P(draft i accepted | the drafts before it were), per position i, from tested drafts, with a
    ``prior`` of pseudo-observations at ``prior_mean``; positions past the last seen take its value."""

    prior_mean: float = 0.5
    prior: float = 2.0
    accepted: list[float] = field(default_factory=list)
    tested: list[float] = field(default_factory=list)

    def estimate(self, i: int) -> float:
        if i < len(self.tested):
            return (self.accepted[i] + self.prior * self.prior_mean) / (self.tested[i] + self.prior)
        if self.tested:
            return self.estimate(len(self.tested) - 1)
        return self.prior_mean

    def record(self, i: int, accepted: bool) -> None:
        while len(self.tested) <= i:
            self.tested.append(0.0)
            self.accepted.append(0.0)
        self.tested[i] += 1.0
        self.accepted[i] += float(accepted)


def chain_outcomes(tested_count: int, accepted_count: int) -> list[tuple[int, bool]]:
    """The (position, accepted) outcomes of a chain of which ``tested_count`` drafts were verified and
    the first ``accepted_count`` accepted: the accepted ones, then the first rejected one (the drafts
    after it were never tested)."""
    outcomes = [(i, True) for i in range(accepted_count)]
    if accepted_count < tested_count:
        outcomes.append((accepted_count, False))
    return outcomes


def _some_longer_chain_pays(
    acceptance: list[float], costs: StepCosts, steps: int, extras: range, now: float
) -> bool:
    """Whether verifying ``acceptance``'s drafts and ``extra`` more (each guessed as likely accepted as the
    last), after ``steps + extra`` drafter steps, beats ``now`` tokens per second for some ``extra``."""
    guess = acceptance[-1]
    return any(block_rate(acceptance + [guess] * e, costs, steps + e) > now for e in extras)


class CostAwareLength:
    """The draft length that maximizes expected tokens per second (module docstring).

    ``costs`` may be set after construction (a decoder measures them at its first call);
    ``probe_every``: after this many blocks in a row that skipped the drafter, draft once anyway;
    ``probe_longest``: the longest interval, which doubles after each probe that does not pay.
    """

    def __init__(self, costs: StepCosts | None = None, probe_every: int = 8, probe_longest: int = 64) -> None:
        self.costs = costs
        self._calibration: dict[object, AcceptanceCalibration] = {}
        self._first: dict[object, PositionAcceptance] = {}
        self._copies: dict[object, PositionAcceptance] = {}
        self._first_probes = Probes(probe_every, probe_longest)
        #: This block verifies its first draft as a probe (its plain steps before it were many enough).
        self._probing = False
        #: The last :meth:`should_spend_forward` granted its forward as a probe (read once, by the cut).
        self._forward_probe = False
        self._copy_probes = Probes(probe_every, probe_longest)

    def _costs(self) -> StepCosts:
        if self.costs is None:
            raise RuntimeError(
                "CostAwareLength: no step costs yet (the decoder measures them at its first call)"
            )
        return self.costs

    def calibration(self, regime: object) -> AcceptanceCalibration:
        return self._calibration.setdefault(regime, AcceptanceCalibration())

    def acceptances(self, regime: object, confidences: Sequence[float]) -> list[float]:
        """Each draft's calibrated acceptance, from the drafter's probability of it."""
        cal = self.calibration(regime)
        return [cal.estimate(c) for c in confidences]

    def should_draft(self, regime: object, budget: int) -> bool:
        """Whether a chain of up to ``budget`` drafts, each accepted like first drafts so far and each
        costing a drafter step, can beat a plain step (with probes,
        :class:`~train.decoding.probes.Probes`)."""
        return self._worth_drafting(regime, budget, self._costs(), None)

    def should_spend_forward(self, regime: object, budget: int, costs: StepCosts) -> bool:
        """Whether one drafter forward that gives every draft of the block at once (DFlash), ``costs.draft``
        seconds, can pay: some chain of up to ``budget`` drafts, each accepted like first drafts so far,
        beats a plain step under ``costs`` (with probes, as :meth:`should_draft`). Asked before the forward,
        so a block where nothing can pay costs a plain step and not a forward cut to nothing; the block's
        :meth:`cut` then keeps its first draft where this call probed."""
        spend = self._worth_drafting(regime, budget, costs, 1)
        self._forward_probe = self._probing
        return spend

    def _worth_drafting(self, regime: object, budget: int, costs: StepCosts, forwards: int | None) -> bool:
        """:meth:`should_draft` with ``forwards`` drafter steps a block (None: one per draft)."""
        guess = self._first.setdefault(regime, PositionAcceptance()).estimate(0)
        plain = 1.0 / costs.check(1)
        self._probing = False
        if any(block_rate([guess] * n, costs, forwards or n) > plain for n in range(1, budget + 1)):
            return True
        self._probing = self._first_probes.refused()
        return self._probing

    def include(self, regime: object, confidences: Sequence[float], budget: int) -> bool:
        """Whether to verify the next draft: ``confidences`` are the drafter's confidence at each
        position drafted so far, the last one the candidate's (the largest probability of its distribution,
        never the probability of the token drawn from it), ``budget`` the most drafts the block may
        verify. The drafter's steps spent so far are one per confidence; stopping now verifies the
        drafts before the candidate, going on verifies it and, were later drafts as likely accepted,
        perhaps more."""
        n = len(confidences)
        costs = self._costs()
        a = self.acceptances(regime, confidences)
        pays = _some_longer_chain_pays(a, costs, n, range(0, budget - n + 1), block_rate(a[:-1], costs, n))
        return pays if n > 1 else self._first_draft(pays)

    def _first_draft(self, pays: bool) -> bool:
        """Whether a block verifies its first draft: on its merits (``pays``), or as a probe. A block
        whose first draft is refused is a plain step, and plain steps in a row are what the probes count:
        refused by :meth:`should_draft` or here, the estimate would otherwise never see another outcome
        (a probe that passed :meth:`should_draft` only to be refused here taught nothing, and the policy
        stayed a plain step for good: 10 drafts in 487 blocks on the real pair, 2026-11-29)."""
        if self._probing:
            return True
        if pays:
            self._first_probes.accepted()
            return True
        self._probing = self._first_probes.refused()
        return self._probing

    def cut(self, regime: object, confidences: Sequence[float], costs: StepCosts) -> int:
        """How many of a block's drafts to verify when all of them came from one drafter forward already
        spent (DFlash): the prefix with the most expected tokens per second under ``costs``, by each
        draft's calibrated acceptance; where none pays, none, or the first one as a probe (a chain is the
        tree whose nodes' chances are its survivals, :meth:`cut_tree`)."""
        return self.cut_tree(survival(self.acceptances(regime, confidences)), costs)

    def cut_tree(self, chances: Sequence[float], costs: StepCosts) -> int:
        """How many of a draft's nodes, best first, to verify when one drafter forward already spent gave
        them all (a DFlash chain or tree): ``chances[i]`` is the calibrated chance that node i's path is
        accepted (:func:`~train.decoding.costs.best_node_count`); where none pays, none, or the first one
        as a probe (the block's :meth:`should_spend_forward`, asked before the forward, says whether this
        block probes; a cut without it never does)."""
        self._probing, self._forward_probe = self._forward_probe, False
        keep = best_node_count(chances, costs, 1)[0]
        if chances and self._first_draft(keep > 0):
            return keep or 1  # the nodes that pay, or the first one as a probe
        return 0

    def record_tree(
        self, regime: object, confidences: Sequence[float], parents: Sequence[int], path: Sequence[int]
    ) -> None:
        """What the verifier did with a tree of deterministic candidates: node i, drafted with probability
        ``confidences[i]`` under ``parents[i]`` (-1: the root), was tested when its parent was accepted (or
        is the root), and accepted when it is on ``path`` (the accepted nodes, top down). Every tested node
        teaches the calibration: a candidate of rank 2 drafted with probability 0.2 and refused is as much an
        outcome as a first choice accepted."""
        cal = self.calibration(regime)
        accepted = set(path)
        reached = {-1, *path}
        for i, (c, parent) in enumerate(zip(confidences, parents, strict=True)):
            if parent in reached:
                cal.record(c, i in accepted)
        self._first.setdefault(regime, PositionAcceptance()).record(0, bool(path))

    def extend(self, regime: object, confidences: Sequence[float], budget: int) -> bool:
        """Whether to run the drafter for one more position, the drafts with ``confidences`` kept: some
        longer chain, each draft to come guessed as likely accepted as the last kept one, promises more
        tokens per second than verifying the kept ones, its drafter steps counted as still to be spent.
        (:meth:`include` weighs a draft whose drafter step is already spent: only its check. Without this
        question a chain on a machine where checks are nearly flat ran to the cap whatever its drafter
        steps cost.)"""
        n = len(confidences)
        if n >= budget:
            return False
        costs = self._costs()
        a = self.acceptances(regime, confidences)
        return _some_longer_chain_pays(a, costs, n, range(1, budget - n + 1), block_rate(a, costs, n))

    def choose_copied(self, regime: object, count: int) -> int:
        """How many of ``count`` copied tokens (prompt lookup, no drafter cost) to verify; after
        ``probe_every`` refusals in a row (more after probes that do not pay), all of them once (so the
        copies' acceptance is learnt again)."""
        copies = self._copies.setdefault(regime, PositionAcceptance())
        keep = best_length([copies.estimate(i) for i in range(count)], self._costs(), 0)[0]
        if keep:
            self._copy_probes.accepted()
            return keep
        return count if self._copy_probes.refused() else 0

    def record(self, regime: object, confidences: Sequence[float], tested: int, accepted: int) -> None:
        """What the verifier did with a drafted chain: ``tested`` of its drafts were verified (the
        prefix chosen), the first ``accepted`` accepted."""
        cal = self.calibration(regime)
        first = self._first.setdefault(regime, PositionAcceptance())
        for i, ok in chain_outcomes(tested, accepted):
            cal.record(confidences[i], ok)
            if i == 0:
                first.record(0, ok)

    def record_copied(self, regime: object, tested: int, accepted: int) -> None:
        copies = self._copies.setdefault(regime, PositionAcceptance())
        for i, ok in chain_outcomes(tested, accepted):
            copies.record(i, ok)


@dataclass(frozen=True)
class ChainOutcome:
    """A drafted chain awaiting the verifier's verdict: the ``policy`` that chose its length, its
    ``regime``, the ``confidences`` of its ``drafted`` drafts, and the sequence length ``first`` it
    continued. :meth:`record` teaches the policy once the loop commits."""

    policy: CostAwareLength
    regime: object
    confidences: list[float]
    drafted: int
    first: int

    def record(self, committed: int) -> None:
        """The loop committed the first ``committed`` tokens: the drafts up to there were accepted."""
        accepted = min(self.drafted, max(0, committed - self.first))
        self.policy.record(self.regime, self.confidences, self.drafted, accepted)
