"""Tree speculative decoding: SpecInfer, RSD-C and RSD-S (docs/trees.md).

A composition of the engine's parts, like :class:`~train.decoding.decoders.speculative.SpeculativeDecoder`: a
:class:`~train.decoding.proposers.tree_proposers.TreeProposer` drafts a tree with the drafter (one forward per
depth), :func:`~train.decoding.loop.run_synchronous` scores it in one verifier forward with tree attention
and verifies it with :func:`~train.decoding.rules.tree_walk.verify_tree`. Lossless: at T = 0 the output
is the verifier's greedy output; at T > 0 every token is distributed exactly as the verifier's warped
distribution (multi-round rejection with i.i.d. siblings for SpecInfer, without replacement for RSD).
``stats.verifier_tokens`` counts the tree tokens scored, so methods compare at a fixed verifier budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from train.decoding.cost_probe import step_costs
from train.decoding.costs import StepCosts
from train.decoding.decoders.base import DraftTreeDecoder
from train.decoding.draft_gate import check_fallback_gamma, plain_step_gate
from train.decoding.length_policy import CostAwareLength
from train.decoding.model_call import TimedModel
from train.decoding.proposers.gated_proposer import capped
from train.decoding.proposers.lookup_proposer import prompt_lookup
from train.decoding.proposers.tree_proposers import TREE_METHODS, TreeProposer

__all__ = ["TreeSpeculativeDecoder", "tree_size"]


def tree_size(branching: Sequence[int]) -> int:
    """Nodes of a constant-branching tree: sum over depths d of prod(branching[:d + 1])."""
    total, width = 0, 1
    for b in branching:
        width *= b
        total += width
    return total


class TreeSpeculativeDecoder(DraftTreeDecoder):
    """Speculative decoding of ``verifier`` with a draft tree from ``drafter``.

    ``method="specinfer"`` or ``"rsd_c"`` with ``branching`` (children of every depth-d node, so depth
    d + 1 holds prod(branching[:d + 1]) nodes); ``method="rsd_s"`` with ``depth`` and ``beam_width``
    (at most ``beam_width`` nodes per depth). ``lookup_tokens`` K > 0: prompt lookup first, the tree
    where the context offers nothing to copy (docs/decoding.md#prompt-lookup). ``plain_steps="auto"``:
    the tree is drafted only in blocks where trees have paid for their measured cost so far, a plain
    verifier step elsewhere (:mod:`train.decoding.draft_gate`; lossless), under ``costs`` or the pair's
    step costs measured at the first call; ``"never"`` (the default): a tree every block, the method as
    published. ``fallback_gamma`` G > 0 (with ``"auto"``): where the tree has not paid, a chain of the same
    drafter instead of a plain step, up to G drafts with its length chosen by cost (a plain step where no
    draft pays, as ``sd_adaptive``); the tree must then beat that chain's measured rate to keep its blocks
    (:class:`~train.decoding.proposers.gated_proposer.GatedProposer`; lossless: which shape a block drafts
    depends only on earlier blocks). Same ``generate`` interface and result as
    :class:`~train.decoding.decoders.speculative.SpeculativeDecoder`.
    """

    # more than 8 parameters: the pair, then the keys of conf/decoding/*.yaml, which Hydra passes by name, and
    # ``costs`` (fixed step costs that tests give instead of measuring them)
    def __init__(
        self,
        verifier: torch.nn.Module,
        drafter: torch.nn.Module,
        method: str = "rsd_c",
        branching: Sequence[int] | None = None,
        depth: int | None = None,
        beam_width: int | None = None,
        lookup_tokens: int = 0,
        lookup_max_ngram: int = 3,
        lookup_min_ngram: int = 2,
        plain_steps: str = "never",
        costs: StepCosts | None = None,
        fallback_gamma: int = 0,
    ) -> None:
        check_fallback_gamma(fallback_gamma, plain_steps)
        if method not in TREE_METHODS:
            raise ValueError(f"method must be one of {sorted(TREE_METHODS)}, got {method!r}")
        if method == "rsd_s":
            if branching is not None:
                raise ValueError("rsd_s takes depth and beam_width, not branching")
            for name, value in (("depth", depth), ("beam_width", beam_width)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"rsd_s needs {name} as an integer >= 1, got {value!r}")
            self.depth = int(depth)  # type: ignore[arg-type]
            self.branching: tuple[int, ...] = ()
        else:
            if depth is not None or beam_width is not None:
                raise ValueError(f"{method} takes branching, not depth / beam_width")
            if not branching or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in branching
            ):
                raise ValueError(f"branching must be a non-empty list of integers >= 1, got {branching!r}")
            self.branching = tuple(branching)
            self.depth = len(self.branching)
        self.verifier = verifier
        self.drafter = drafter
        self.method = method
        self.beam_width = beam_width
        self._verifier = TimedModel(verifier)
        self.fallback_gamma = fallback_gamma
        #: The fallback chain's cost-aware length (None without a fallback).
        self.length = CostAwareLength(costs) if fallback_gamma else None
        self._proposer: TreeProposer = TreeProposer(
            TimedModel(drafter),
            self._verifier.vocab_size,
            method,
            branching=self.branching,
            depth=self.depth,
            beam_width=beam_width or 0,
            length=self.length,
        )
        self.vocab_size = self._verifier.vocab_size
        self._gate = plain_step_gate(plain_steps, costs)
        gated = self._gate is not None
        self._lookup = prompt_lookup(lookup_tokens, lookup_max_ngram, lookup_min_ngram, self.length, gated)
        self._fallback = capped(self._proposer.propose_chain, fallback_gamma) if fallback_gamma else None

    @property
    def draft_budget(self) -> int:
        """The tree's depth, or the fallback chain's longest draft where that is longer."""
        return max(self.depth, self.fallback_gamma)

    def measure_costs(self) -> StepCosts:
        """Checks of 1 .. the tree's nodes + 1 tokens and a drafter step, measured once per machine and
        setting (:func:`~train.decoding.cost_probe.step_costs`)."""
        nodes = self.depth * (self.beam_width or 0) if self.method == "rsd_s" else tree_size(self.branching)
        costs = step_costs(self._verifier, self._proposer.drafter, max(nodes, self.fallback_gamma) + 1)
        if self.length is not None:
            self.length.costs = costs
        return costs

    def models(self) -> tuple[torch.nn.Module, ...]:
        return (self.verifier, self.drafter)
