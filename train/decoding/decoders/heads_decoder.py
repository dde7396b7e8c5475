"""``HeadsDecoder``: prediction heads on the verifier, a sparse tree of their candidates, one
verifier forward per step (Medusa; blockwise parallel decoding with a chain; BPD with a refiner).

The drafting side is :class:`~train.decoding.proposers.heads_proposer.HeadsProposer`; verification is
:func:`~train.decoding.rules.tree_walk.verify_tree` (lossless) or Medusa's typical acceptance
(:mod:`train.decoding.rules.typical`, lossy at T > 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from train.decoding.costs import StepCosts
from train.decoding.decoders.base import DraftTreeDecoder
from train.decoding.draft_gate import plain_step_gate
from train.decoding.model_call import TimedModel
from train.decoding.proposers.heads_proposer import DEFAULT_CHOICES, HeadsProposer, tree_from_accuracies
from train.decoding.proposers.step_probe import proposer_costs
from train.decoding.refine import Refiner
from train.decoding.rules.rejection import LOSSLESS
from train.decoding.rules.typical import TypicalAcceptance
from train.decoding.rules.verdict import VerificationRule

__all__ = ["ACCEPTANCES", "HeadsDecoder", "check_heads"]

#: ``rejection``: lossless (the recursive rule with point-mass candidates); ``typical``: Medusa's lossy rule.
ACCEPTANCES: tuple[str, ...] = ("rejection", "typical")


class HeadsDecoder(DraftTreeDecoder):
    """Speculative decoding with prediction heads: ``heads(hidden) -> (K, V)`` on the verifier's last
    hidden state (e.g. :class:`train.models.heads.MedusaHeads`), a sparse tree of their top candidates
    verified in one verifier forward per step. Same ``generate`` as the other decoders.

    tree: paths of ranks (Medusa's "choices"); None: the tree the heads carry (``heads.tree``, built from
    their measured accuracies by :func:`~train.decoding.proposers.heads_proposer.tree_from_accuracies`
    when they were trained), else :data:`~train.decoding.proposers.heads_proposer.DEFAULT_CHOICES`
    without its paths deeper than the heads (``heads.num_heads``);
    :func:`~train.decoding.proposers.heads_proposer.chain_choices` gives blockwise decoding.
    tree_nodes: instead of a tree, build one of that many nodes from the heads' measured
    ``rank_accuracy`` (a size sweep).
    refiner: draft from the lattice of the heads' top-k instead of a fixed tree (BPD,
    :mod:`train.decoding.refine`): its drafts are merged into a trie and verified like a tree.
    acceptance: ``rejection`` (lossless) or ``typical`` (Medusa's lossy rule at T > 0, with
    ``posterior_threshold`` and ``posterior_alpha``; :attr:`lossless` is then False).
    plain_steps: ``auto``: the heads draft only in blocks where their drafts have paid for their measured
    cost so far, a plain verifier step elsewhere (:mod:`train.decoding.draft_gate`), under ``costs`` or
    the checks and the heads' forward measured at the first call
    (:mod:`train.decoding.proposers.step_probe`); ``never`` (the default): a draft every block, the
    method as published.
    """

    accepts: ClassVar[tuple[str, ...]] = ("heads",)
    _proposer: HeadsProposer

    # more than 8 parameters: the pair, then the keys of conf/decoding/medusa*.yaml and bpd*.yaml, which Hydra
    # passes by name, and ``costs`` (fixed step costs that tests give instead of measuring them)
    def __init__(
        self,
        verifier: torch.nn.Module,
        heads: torch.nn.Module,
        tree: Sequence[Sequence[int]] | None = None,
        tree_nodes: int | None = None,
        acceptance: str = "rejection",
        posterior_threshold: float = 0.09,
        posterior_alpha: float = 0.3,
        refiner: Refiner | None = None,
        plain_steps: str = "never",
        costs: StepCosts | None = None,
    ) -> None:
        if acceptance not in ACCEPTANCES:
            raise ValueError(f"acceptance must be one of {list(ACCEPTANCES)}, got {acceptance!r}")
        self.verifier = verifier
        self.heads = heads
        self._verifier = TimedModel(verifier)
        check_heads(verifier, heads, self._verifier.vocab_size)
        if tree_nodes is not None:
            accuracy = getattr(heads, "rank_accuracy", None)
            if tree is not None or not accuracy:
                raise ValueError(
                    "tree_nodes builds the tree from the heads' measured rank accuracies: give it without "
                    "a tree, for heads trained by draftsmith (their config holds rank_accuracy)"
                )
            tree = tree_from_accuracies(accuracy, tree_nodes)
        num_heads = getattr(heads, "num_heads", None)
        if tree is None:
            tree = getattr(heads, "tree", None) or [  # the default, cut to the heads there are
                p for p in DEFAULT_CHOICES if num_heads is None or len(p) <= num_heads
            ]
        refine_depth = getattr(refiner, "depth", None) or num_heads
        self._proposer = HeadsProposer(heads, tree, self._verifier.vocab_size, refiner, refine_depth)
        if num_heads is not None and self._proposer.depth > num_heads:
            raise ValueError(f"the tree is {self._proposer.depth} deep but the heads number {num_heads}")
        self.tree = self._proposer.paths
        self.depth = self._proposer.depth
        self.acceptance = acceptance
        self._rule: VerificationRule = (
            TypicalAcceptance(posterior_threshold, posterior_alpha) if acceptance == "typical" else LOSSLESS
        )
        self._gate = plain_step_gate(plain_steps, costs)

    def measure_costs(self) -> StepCosts:
        """Checks of 1 .. the tree's nodes + 1 tokens and the heads' forward (with the refiner's work, for
        BPD), measured once per machine, setting and tree
        (:func:`~train.decoding.proposers.step_probe.proposer_costs`)."""
        refiner = self._proposer.refiner
        nodes = len(self.tree) if refiner is None else int(getattr(refiner, "p", 1)) * self.depth
        return proposer_costs(
            self._verifier,
            self._proposer,
            self.heads,
            nodes + 1,
            self.depth,
            f"heads {self.tree} {_shape(refiner)}",
        )

    @property
    def lossless(self) -> bool:
        """Whether the output follows the verifier's distribution exactly (always so at T = 0)."""
        return self._rule.lossless

    def models(self) -> tuple[torch.nn.Module, ...]:
        return (self.verifier,)


def check_heads(verifier: torch.nn.Module, heads: torch.nn.Module, vocab_size: int) -> None:
    """Refuse heads made for another verifier: their hidden size and vocabulary must match its own."""
    config = getattr(verifier, "config", None)
    hidden = getattr(config, "hidden_size", None)
    heads_hidden = getattr(heads, "hidden_size", None)
    if hidden is not None and heads_hidden is not None and int(hidden) != int(heads_hidden):
        raise ValueError(
            f"the heads read hidden states of size {heads_hidden}, but the verifier's are {hidden}: "
            "they were trained on another verifier"
        )
    heads_vocab = getattr(heads, "vocab_size", None)
    if heads_vocab is not None and int(heads_vocab) < vocab_size:
        raise ValueError(
            f"the heads predict {heads_vocab} tokens, but the verifier's vocabulary has {vocab_size}: "
            "they were trained on another verifier"
        )


def _shape(refiner: Refiner | None) -> str:
    """What a refiner's cost depends on: its kind, its settings and its language model's kind and size."""
    if refiner is None:
        return "no refiner"
    lm = getattr(refiner, "lm", None)
    size = sum(p.numel() for p in lm.parameters()) if isinstance(lm, torch.nn.Module) else None
    settings = {k: getattr(refiner, k, None) for k in ("k", "p", "alpha", "depth", "window")}
    return f"{type(refiner).__name__} {settings} lm {type(lm).__name__} {size}"
