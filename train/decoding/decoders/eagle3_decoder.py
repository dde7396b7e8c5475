"""``Eagle3Decoder``: an EAGLE-3 drafter on the verifier's fused features, EAGLE-2's dynamic tree,
one verifier forward per step (docs/eagle3.md); with ``sampled_chain``, at T > 0 a chain drawn from the
drafter instead (EAGLE-1's sampling), with ``sampled_tree`` a tree of siblings drawn without replacement.

The drafting side is :class:`~train.decoding.proposers.eagle3_proposer.Eagle3Proposer`; verification is
:func:`~train.decoding.rules.tree_walk.verify_tree` in the synchronous loop (greedy at T = 0, the
recursive rule with point-mass proposals at T > 0, the standard rule with the drafter's q for a sampled
chain, the recursive rule without replacement for a sampled tree): lossless at every temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from train.decoding.costs import StepCosts
from train.decoding.decoders.base import DraftTreeDecoder, check_feature_drafter
from train.decoding.draft_gate import check_fallback_gamma, plain_step_gate
from train.decoding.length_policy import CostAwareLength
from train.decoding.model_call import TimedModel
from train.decoding.proposers.eagle3_proposer import Eagle3Proposer
from train.decoding.proposers.eagle3_tree import Eagle3Tree
from train.decoding.proposers.gated_proposer import capped
from train.decoding.proposers.lookup_proposer import prompt_lookup
from train.decoding.proposers.step_probe import proposer_costs
from train.models.eagle3_drafter import Eagle3Drafter
from train.renames import renamed_keywords

__all__ = ["Eagle3Decoder", "check_eagle3"]


@renamed_keywords(top_k="branching")
class Eagle3Decoder(DraftTreeDecoder):
    """Speculative decoding with an :class:`~train.models.eagle3_drafter.Eagle3Drafter`: trees of at most
    ``total_tokens`` nodes and ``depth`` levels, each expanded level its ``branching`` best nodes, each node
    its ``branching`` best children (``branching=1``: a chain of ``depth`` tokens; EAGLE's ``top_k``, a name
    this project keeps for the sampling cut-off). ``sampled_chain``: at T > 0,
    a chain of ``depth`` tokens sampled from the drafter instead of the tree, its logits divided by
    ``draft_temperature`` first; ``sampled_tree`` (children per depth, e.g. ``[2, 1, 1, 1]``): at T > 0,
    a tree whose siblings are sampled from it without replacement (RSD-C), verified by the recursive
    rule. ``lookup_tokens`` K > 0: prompt lookup first, the drafter's tree where the context offers
    nothing to copy (docs/decoding.md#prompt-lookup). ``plain_steps="auto"``: the drafter drafts only in
    blocks where its drafts have paid for their measured cost so far, a plain verifier step elsewhere
    (:mod:`train.decoding.draft_gate`; lossless), under ``costs`` or the checks and drafter forward
    measured at the first call (:mod:`train.decoding.proposers.step_probe`); ``"never"`` (the default):
    a draft every block, the method as published. ``fallback_gamma`` G > 0 (with ``"auto"``): where the
    tree (or the sampled chain) has not paid, a chain of the same drafter instead of a plain step, up to G
    drafts with its length chosen by cost (greedy at T = 0, drawn from the sampled chain's q at T > 0; a
    plain step where no draft pays), the shape then weighed against that chain's measured rate
    (:meth:`~train.decoding.draft_gate.DraftGate.choose`; lossless: which draft a block makes depends
    only on earlier blocks). Same ``generate`` as the other decoders."""

    accepts: ClassVar[tuple[str, ...]] = ("eagle3",)

    # more than 8 parameters: the pair, then the keys of conf/decoding/eagle3*.yaml, which Hydra passes by
    # name (they travel on as one Eagle3Tree, one prompt-lookup proposer and one gate), and ``costs`` (fixed
    # step costs that tests give instead of measuring them)
    def __init__(
        self,
        verifier: torch.nn.Module,
        drafter: Eagle3Drafter,
        depth: int = 5,
        branching: int = 8,
        total_tokens: int = 32,
        sampled_chain: bool = False,
        draft_temperature: float = 1.0,
        sampled_tree: Sequence[int] | None = None,
        lookup_tokens: int = 0,
        lookup_max_ngram: int = 3,
        lookup_min_ngram: int = 2,
        plain_steps: str = "never",
        costs: StepCosts | None = None,
        fallback_gamma: int = 0,
    ) -> None:
        self.fallback_gamma = check_fallback_gamma(fallback_gamma, plain_steps)
        self.verifier = verifier
        self.drafter = drafter
        self._verifier = TimedModel(verifier)
        check_eagle3(verifier, drafter, self._verifier.vocab_size)
        tree = Eagle3Tree.of(
            sampled_tree,
            depth=depth,
            branching=branching,
            total_tokens=total_tokens,
            sampled_chain=sampled_chain,
            draft_temperature=draft_temperature,
        )
        #: The fallback chain's cost-aware length (None without a fallback).
        self.length = CostAwareLength(costs) if fallback_gamma else None
        self._proposer = Eagle3Proposer(drafter, self._verifier.vocab_size, tree, self.length)
        #: The draft's shape (:class:`~train.decoding.proposers.eagle3_tree.Eagle3Tree`).
        self.tree = tree
        self.depth = tree.depth
        self._gate = plain_step_gate(plain_steps, costs)
        gated = self._gate is not None
        self._lookup = prompt_lookup(lookup_tokens, lookup_max_ngram, lookup_min_ngram, self.length, gated)
        self._fallback = capped(self._proposer.propose_chain, fallback_gamma) if fallback_gamma else None

    @property
    def draft_budget(self) -> int:
        """The tree's depth, or the fallback chain's longest draft where that is longer."""
        return max(self.depth, self.fallback_gamma)

    def measure_costs(self) -> StepCosts:
        """Checks of 1 .. the tree's nodes (or the fallback chain's drafts) + 1 tokens and the drafter's
        forward, measured once per machine, setting and tree
        (:func:`~train.decoding.proposers.step_probe.proposer_costs`); the fallback chain is cut by them."""
        costs = proposer_costs(
            self._verifier,
            self._proposer,
            self.drafter,
            max(self.tree.total_tokens, self.fallback_gamma) + 1,
            self.depth,
            repr(self.tree),
        )
        if self.length is not None:
            self.length.costs = costs
        return costs

    def models(self) -> tuple[torch.nn.Module, ...]:
        return (self.verifier,)


def check_eagle3(verifier: torch.nn.Module, drafter: torch.nn.Module, vocab_size: int) -> None:
    """Refuse anything but a Eagle3Drafter, and one made for another verifier
    (:func:`~train.decoding.decoders.base.check_feature_drafter`)."""
    if not isinstance(drafter, Eagle3Drafter):
        raise ValueError(f"Eagle3Decoder takes a Eagle3Drafter, got {type(drafter).__name__}")
    check_feature_drafter(verifier, drafter, vocab_size, "EAGLE-3")
