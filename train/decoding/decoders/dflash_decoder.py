"""``DFlashDecoder``: a DFlash drafter proposes a chain from one forward per block (docs/dflash.md).

The drafting side is :class:`~train.decoding.proposers.dflash_proposer.DFlashProposer`; verification is
the synchronous loop's chain rule (greedy at T = 0, the standard rule with the drafter's q at T > 0):
lossless at every temperature. ``draft_length="cost"`` cuts each block's chain to the prefix with the
most expected tokens per second under the pair's measured check costs (measured at the first call and
cached per machine, :mod:`train.decoding.cost_probe`). ``lookup_tokens`` K > 0: prompt lookup first,
the drafter where the context offers nothing to copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from train.decoding.cost_probe import step_costs
from train.decoding.costs import StepCosts
from train.decoding.decoders.base import DraftTreeDecoder, check_feature_drafter
from train.decoding.draft_gate import check_fallback_cut, plain_step_gate
from train.decoding.length_policy import CostAwareLength
from train.decoding.metrics import DecodeResult
from train.decoding.model_call import TimedModel
from train.decoding.proposers.dflash_proposer import DFlashProposer
from train.decoding.proposers.lookup_proposer import prompt_lookup
from train.decoding.proposers.step_probe import proposer_costs
from train.decoding.sampling import SamplingParams
from train.models.dflash_drafter import DFlashDrafter
from train.renames import renamed_keywords

__all__ = ["DFlashDecoder", "check_dflash"]


@renamed_keywords(max_draft="gamma")
class DFlashDecoder(DraftTreeDecoder):
    """Speculative decoding with a :class:`~train.models.dflash_drafter.DFlashDrafter`: a chain of at most
    ``gamma`` tokens (None: the block's ``block_size - 1``) from one drafter forward per block;
    ``draft_temperature`` divides the drafter's logits at T > 0 (any value stays lossless: q is what the
    tokens are drawn from); ``draft_length``: ``"fixed"`` (the whole chain) or ``"cost"`` (the prefix
    that pays, ``costs`` or measured at the first call); ``tree_nodes`` N > 0: instead of the chain, a tree
    of N candidates from the slots' top tokens, the paths with the largest product of the slots'
    probabilities (deterministic candidates, verified by the tree walk: lossless at every temperature);
    with ``draft_length="cost"`` the tree is cut to the best-first nodes that pay (up to N, none where
    nothing does), each candidate's probability calibrated online against what the verifier accepted.
    ``plain_steps="auto"``: the drafter runs only in blocks where its blocks have paid for their measured
    cost so far, a plain verifier step elsewhere (:mod:`train.decoding.draft_gate`; lossless), the
    drafter's forward measured at the first call (:mod:`train.decoding.proposers.step_probe`). With
    ``draft_length="cost"`` the two work together: the cut chooses how many drafts a block checks once the
    forward is spent, the gate whether to spend it (a cut to nothing still paid for the forward);
    ``"never"`` (the default): the drafter runs every block. ``fallback_cut`` (with ``"auto"``, a fixed
    chain or a sampled tree): where the whole chain (or the sampled tree) has not paid, the same forward's
    chain cut by cost instead of a plain step (the gate weighs the two and a plain step,
    :meth:`~train.decoding.draft_gate.DraftGate.choose`). ``sampled_tree`` (children per depth, e.g.
    ``[4, 1, 1]``): at T > 0, instead of the chain (or the tree), a tree whose siblings are drawn from the
    slots' distributions without replacement (RSD-C), verified by the recursive rule; T = 0 keeps the
    chain or ``tree_nodes``' tree. Same ``generate`` as the other decoders."""

    accepts: ClassVar[tuple[str, ...]] = ("dflash",)
    _proposer: DFlashProposer

    # more than 8 parameters: the pair, then the keys of conf/decoding/*.yaml, which Hydra passes by name, and
    # ``costs`` (fixed step costs that tests give instead of measuring them)
    def __init__(
        self,
        verifier: torch.nn.Module,
        drafter: DFlashDrafter,
        gamma: int | None = None,
        draft_temperature: float = 1.0,
        draft_length: str = "fixed",
        costs: StepCosts | None = None,
        lookup_tokens: int = 0,
        lookup_max_ngram: int = 3,
        lookup_min_ngram: int = 2,
        tree_nodes: int = 0,
        plain_steps: str = "never",
        fallback_cut: bool = False,
        sampled_tree: Sequence[int] | None = None,
    ) -> None:
        if draft_length not in ("fixed", "cost"):
            raise ValueError(f"draft_length must be 'fixed' or 'cost', got {draft_length!r}")
        check_fallback_cut(fallback_cut, plain_steps, draft_length, tree_nodes=tree_nodes)
        self.verifier = verifier
        self.drafter = drafter
        self._verifier = TimedModel(verifier)
        check_dflash(verifier, drafter, self._verifier.vocab_size)
        #: The cost-aware cut (``draft_length="cost"``), else None.
        self.length = CostAwareLength(costs) if draft_length == "cost" else None
        self.draft_length = draft_length
        self._proposer = DFlashProposer(
            drafter,
            self._verifier.vocab_size,
            gamma,
            draft_temperature,
            self.length,
            tree_nodes,
            sampled_tree,
        )
        #: At T > 0, children per depth of the tree sampled from the block (None: none).
        self.sampled_tree = self._proposer.sampled_tree
        self.depth = self._proposer.gamma
        self.fallback_cut = fallback_cut
        if fallback_cut:
            self._proposer.fallback_length = CostAwareLength(costs)
            self._fallback = self._proposer.propose_cut
        self.draft_temperature = self._proposer.draft_temperature
        self._gate = plain_step_gate(plain_steps, costs)
        gated = self._gate is not None
        self._lookup = prompt_lookup(lookup_tokens, lookup_max_ngram, lookup_min_ngram, self.length, gated)

    def models(self) -> tuple[torch.nn.Module, ...]:
        return (self.verifier,)

    def measure_costs(self) -> StepCosts:
        """Checks of 1 .. the draft's tokens + 1 and the drafter's forward over a block, measured once per
        machine, setting and block (:func:`~train.decoding.proposers.step_probe.proposer_costs`)."""
        nodes = max(self._proposer.tree_nodes or self.depth, self._proposer.sampled_nodes)
        shape = f"dflash block {self.drafter.block_size} gamma {self.depth} tree {self._proposer.tree_nodes}"
        if self.sampled_tree is not None:
            shape += f" sampled {list(self.sampled_tree)}"
        length, self._proposer.length = self._proposer.length, None  # the probe's blocks teach it nothing
        try:
            return proposer_costs(self._verifier, self._proposer, self.drafter, nodes + 1, self.depth, shape)
        finally:
            self._proposer.length = length

    @property
    def step_costs(self) -> StepCosts | None:
        """The measured check costs the chain is cut by (None: not cut by cost, or not measured yet)."""
        return self.length.costs if self.length is not None else None

    def decode(
        self,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        eos: frozenset[int],
        generator: torch.Generator | None,
    ) -> DecodeResult:
        for policy in (self.length, self._proposer.fallback_length):
            if policy is not None and policy.costs is None:
                lookup = self._lookup.num_tokens if self._lookup is not None else 0
                most = max(self.depth, self._proposer.tree_nodes, self._proposer.sampled_nodes, lookup) + 1
                policy.costs = step_costs(self._verifier, None, most)
        return super().decode(prompt, max_new_tokens, params, eos, generator)


def check_dflash(verifier: torch.nn.Module, drafter: torch.nn.Module, vocab_size: int) -> None:
    """Refuse anything but a DFlashDrafter, and one made for another verifier
    (:func:`~train.decoding.decoders.base.check_feature_drafter`)."""
    if not isinstance(drafter, DFlashDrafter):
        raise ValueError(f"DFlashDecoder takes a DFlashDrafter, got {type(drafter).__name__}")
    check_feature_drafter(verifier, drafter, vocab_size, "DFlash")
