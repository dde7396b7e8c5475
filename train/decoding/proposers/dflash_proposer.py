"""Drafting with a DFlash drafter: a whole chain from one forward (:class:`DFlashProposer`).

The proposer reads the verifier's hidden states at the drafter's auxiliary layers (``hidden_layers``),
which the loop hands it for every position a verifier forward committed (``observe``; no extra forward),
and keeps every layer's keys and values of those context rows
(:class:`~train.models.dflash_drafter.ContextKV`):
positions 0 .. n - 1 when the committed sequence is t_0 .. t_n. A block is the last committed token t_n
(the anchor, whose verifier state does not exist yet) and ``block_size - 1`` mask tokens at positions
n .. n + B - 1; one drafter forward gives a distribution for each of the positions n + 1 .. n + B - 1
(docs/dflash.md).

With DSpark's Markov head (:mod:`train.models.markov_head`) the positions are walked left to right after
the forward: each one's logits get the bias of the token chosen (or drawn) at the position before it, the
anchor for the first; q is that biased distribution.

The chain: at T = 0 each position's argmax over the draft vocabulary; at T > 0 a token drawn from each
position's distribution (the drafter's logits divided by ``draft_temperature``, warped like the verifier's:
temperature, top-k, top-p), handed over with those distributions as q, so the standard rule accepts x
with probability min(1, p(x) / q(x)). Without a Markov head the positions' distributions do not depend on
the tokens drawn at the others (one forward made them all); with one they do. The rule needs neither:
only that each token was drawn from the q it is handed, given the committed sequence and the drafts
before it. Lossless at every temperature. The chain stops after an eos.

With a ``length`` policy (:class:`~train.decoding.length_policy.CostAwareLength`) the chain is cut to the
prefix with the most expected tokens per second (:func:`~train.decoding.costs.best_length`) under the
measured check costs and the drafter's own forward time (spent either way), each position's acceptance
calibrated online from its confidence (the largest probability of its distribution, never the drawn
token's): the cut depends on the distributions alone, so the kept drafts are still draws from their q.
With a Markov head at T > 0 the cut reads the distributions before the bias, which no draw changes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from train.decoding.draft import Draft
from train.decoding.length_policy import ChainOutcome, CostAwareLength, regime
from train.decoding.metrics import DecodeStats
from train.decoding.proposers.dflash_slots import BlockSlots, sample_tree
from train.decoding.proposers.heads_proposer import choices_draft, tree_from_accuracies
from train.decoding.proposers.tree_proposers import check_sampled_tree
from train.decoding.sampling import SamplingParams, draw_index, uniforms
from train.models.dflash_drafter import ContextKV, DFlashDrafter, block_inputs

__all__ = ["DFlashProposer"]


class DFlashProposer:
    """Chains of up to ``block_size - 1`` tokens from a :class:`DFlashDrafter`, one forward each (see the
    module docstring). ``gamma`` caps the chain (None: the whole block)."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        vocab_size: int,
        gamma: int | None = None,
        draft_temperature: float = 1.0,
        length: CostAwareLength | None = None,
        tree_nodes: int = 0,
        sampled_tree: Sequence[int] | None = None,
    ) -> None:
        slots = drafter.block_size - 1
        if gamma is not None and (isinstance(gamma, bool) or not 1 <= int(gamma) <= slots):
            raise ValueError(f"gamma must be in [1, block_size - 1 = {slots}], got {gamma!r}")
        if isinstance(draft_temperature, bool) or not draft_temperature > 0:
            raise ValueError(f"draft_temperature must be > 0, got {draft_temperature!r}")
        if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or tree_nodes < 0:
            raise ValueError(f"tree_nodes must be an integer >= 0 (0: a chain), got {tree_nodes!r}")
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.gamma = int(gamma) if gamma is not None else slots
        self.draft_temperature = float(draft_temperature)
        #: The cost-aware cut of the chain (None: the whole chain).
        self.length = length
        #: Nodes of the tree drafted from the slots' top candidates (0: a chain).
        self.tree_nodes = tree_nodes
        #: At T > 0, children per depth of a tree sampled from the slots without replacement (None: none).
        self.sampled_tree = check_sampled_tree(sampled_tree, slots)
        self.hidden_layers: tuple[int, ...] = tuple(int(i) for i in drafter.aux_layers)
        param = drafter.fc.weight
        self._device, self._dtype = param.device, param.dtype
        self._targets = drafter.draft_ids.to(self._device)
        #: The slots' distributions: the warp, DSpark's Markov bias (dflash_slots.py).
        self._slots = BlockSlots(drafter, self._targets, self.draft_temperature)
        self._target_ids = self._slots.target_ids
        self._context = ContextKV([])
        self._pending: list[torch.Tensor] = []
        self._forward_time = 0.0  # mean of the drafter's forwards so far (the cut weighs it as spent)
        self._forwards = 0
        #: The cut a gated fixed chain falls back on (:meth:`propose_cut`; None: none).
        self.fallback_length: CostAwareLength | None = None
        #: What commit() tells the cost policy that cut the last draft: a chain's outcome or a tree's
        #: (policy, regime, each node's probability, parents).
        self._outcome: ChainOutcome | None = None
        self._tree_outcome: tuple[CostAwareLength, object, list[float], list[int]] | None = None

    def start(self) -> None:
        self._context = ContextKV([])
        self._pending = []
        self._outcome = self._tree_outcome = None

    def observe(self, states: torch.Tensor) -> None:
        """The verifier's states (P, len(aux_layers), d) at the positions just committed, in order."""
        self._pending.append(states.reshape(states.shape[0], -1).to(self._device, self._dtype))

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        """The first ``length`` tokens are final: the verifier's answer to the last draft is learnt (for
        the cost-aware cut), and no context row past ``length - 1`` stays (none is ever added, since
        ``observe`` brings committed positions only)."""
        if self._outcome is not None:
            self._outcome.record(length)
        if self._tree_outcome is not None and path is not None:
            policy, key, confidences, parents = self._tree_outcome
            policy.record_tree(key, confidences, parents, path)
        self._outcome = self._tree_outcome = None
        if self._context.length > length - 1:
            self._context = self._context.crop(max(length - 1, 0))

    @property
    def sampled_nodes(self) -> int:
        """The most nodes the sampled tree can have (0: none)."""
        widths, nodes, total = self.sampled_tree or (), 1, 0
        for width in widths:
            nodes *= width
            total += nodes
        return total

    @property
    def context_length(self) -> int:
        """Positions whose context rows the proposer holds."""
        return self._context.length

    def _catch_up(self) -> None:
        """The pending verifier states become context rows, keys and values in every layer."""
        if not self._pending:
            return
        states = torch.cat(self._pending)[None]
        first = self._context.length
        positions = torch.arange(first, first + states.shape[1], device=self._device)[None]
        self._context = self._context.append(self.drafter.context_kv(self.drafter.fuse(states), positions))
        self._pending = []

    def propose(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        """The block's draft: the sampled tree at T > 0 (``sampled_tree``), else the tree (``tree_nodes``),
        else the chain; cut by ``length`` where it is set (the sampled tree is never cut)."""
        return self._block(sequence, budget, params, generator, eos, stats, self.length, shaped=True)

    def propose_cut(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        """The block's chain cut by ``fallback_length`` (the prefix that pays under the measured costs, none
        where nothing does), whatever shape :meth:`propose` drafts: what a gated whole block or sampled tree
        falls back on where it has not paid
        (:class:`~train.decoding.proposers.gated_proposer.GatedProposer`)."""
        if self.fallback_length is None:
            raise RuntimeError("propose_cut needs a fallback_length (DFlashDecoder(fallback_cut=True))")
        cut = self.fallback_length
        return self._block(sequence, budget, params, generator, eos, stats, cut, shaped=False)

    def _block(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
        policy: CostAwareLength | None,
        shaped: bool,
    ) -> Draft:
        """One drafter forward and the draft from it: the configured tree where ``shaped`` (else the
        chain), cut by ``policy`` (None: uncut)."""
        if budget < 1 or (not self._pending and self._context.length == 0):
            return Draft()
        if policy is not None and not self._forward_pays(policy, min(self.gamma, budget), params):
            return Draft()  # a plain verifier step: no cut of this forward can pay for it and its check
        start = time.perf_counter()
        prefill = self._context.length == 0
        self._catch_up()
        if prefill:  # the prompt's context rows: a call of its own, kept apart as for every drafter (the
            # cost ratio compares decoding steps only)
            self._synchronize()
            stats.drafter_prefill_calls += 1
            stats.drafter_prefill_time += time.perf_counter() - start
        block_start = time.perf_counter()
        anchor = len(sequence) - 1
        if self._context.length != anchor:
            raise RuntimeError(
                f"{self._context.length} context rows for an anchor at position {anchor}: "
                "observe must follow every verifier forward"
            )
        size = self.drafter.block_size
        ids = block_inputs(
            torch.tensor([sequence[-1]], device=self._device), size, self.drafter.mask_token_id
        )
        positions = torch.arange(anchor, anchor + size, device=self._device)[None]
        count = min(self.gamma, budget)
        # the logits of the slots the chain can use only (not the anchor's, nor any past the budget)
        logits = self.drafter(ids, positions, self._context, slots=slice(1, 1 + count))[0].float()
        spent = time.perf_counter() - block_start
        if shaped and self.sampled_tree is not None and not params.greedy:
            draft = sample_tree(self._slots, logits, sequence[-1], self.sampled_tree, params, generator, eos)
        elif shaped and self.tree_nodes:
            draft = self._tree(self._slots.along_argmax(logits, sequence[-1]), params, eos, spent, policy)
        else:
            draft = self._chain(logits, sequence[-1], params, generator, eos, spent, len(sequence), policy)
        self._synchronize()
        end = time.perf_counter()
        self._forwards += 1  # the drafter's time per block, which the cost-aware cut weighs as spent
        self._forward_time += (end - block_start - self._forward_time) / self._forwards
        stats.drafter_calls += 1 + int(prefill)
        stats.drafter_time += end - start
        return draft

    def _forward_pays(self, policy: CostAwareLength, count: int, params: SamplingParams) -> bool:
        """Whether ``policy`` spends this block's forward (its mean time so far) on up to ``count`` drafts
        (:meth:`~train.decoding.length_policy.CostAwareLength.should_spend_forward`); True until its
        costs are known."""
        if policy.costs is None:
            return True
        costs = replace(policy.costs, draft=self._forward_time)
        return policy.should_spend_forward(regime(params), count, costs)

    def _synchronize(self) -> None:
        """Wait for the drafter's own device, so the clock measures its work."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _chain(
        self,
        logits: torch.Tensor,
        anchor: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        spent: float,
        committed: int,
        policy: CostAwareLength | None,
    ) -> Draft:
        """The chain from the block's logits (n, N) after the ``anchor`` token: greedy or sampled, cut by
        the cost ``policy`` (None: uncut), stopped after an eos.

        With a Markov head each slot's distribution depends on the token drawn before it, so at T > 0 the
        cut reads the confidences of the slots' distributions without the bias: a cut that read slot 2's
        biased confidence would keep or drop slot 1's draw by its value, and the kept drafts would no
        longer be plain draws from their q. At T = 0 nothing is drawn, and the biased rows are read."""
        if params.greedy:
            q = None
            top = self._slots.along_argmax(logits, anchor).softmax(-1).max(-1)
            columns, confidences = top.indices.tolist(), top.values.tolist()
        else:
            u = uniforms(logits.shape[0], generator).tolist()
            if self._slots.markov is None:
                q = self._slots.warped(logits, params)
                columns = [draw_index(q[i], u[i]) for i in range(q.shape[0])]
                confidences = q.max(-1).values.tolist()
            else:
                columns, q = self._slots.sampled_walk(logits, anchor, params, u)
                # only the cut reads them (the rows before the bias: see above)
                unbiased = self._slots.warped(logits, params) if policy is not None else q
                confidences = unbiased.max(-1).values.tolist()
        keep = len(columns)
        key = regime(params)
        if policy is not None and policy.costs is not None:
            spent_costs = replace(policy.costs, draft=max(self._forward_time, spent))
            keep = policy.cut(key, confidences, spent_costs)
        tokens: list[int] = []
        for column in columns[:keep]:
            tokens.append(self._target_ids[column])
            if tokens[-1] in eos:
                break
        n = len(tokens)
        if policy is not None:  # what commit() tells the policy about these drafts
            self._outcome = ChainOutcome(policy, key, confidences[:n], n, committed)
        if q is None:
            return Draft.chain(tokens)
        return Draft.chain(tokens, q[:n], support=self._targets, columns=columns[:n])

    def _tree(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        eos: frozenset[int],
        spent: float,
        policy: CostAwareLength | None,
    ) -> Draft:
        """A tree of up to ``tree_nodes`` deterministic candidates from the block's logits (n, N): each slot's
        top candidates (the drafter's distribution, warped at T > 0 as for a chain), the paths chosen by
        :func:`~train.decoding.proposers.heads_proposer.tree_from_accuracies` with each candidate's chance
        of acceptance (its probability; calibrated online with a cost policy), nothing under an eos and no
        candidate of probability 0. With a cost policy the tree keeps the best-first nodes that yield the
        most tokens per second under the measured check costs, the forward counted as spent
        (:meth:`~train.decoding.length_policy.CostAwareLength.cut_tree`): a tree as large as the checks
        afford, none where nothing pays. The size depends on the distributions alone and the candidates
        are deterministic, so the walk's verdict stays lossless."""
        q = logits.softmax(-1) if params.greedy else self._slots.warped(logits, params)
        top = q.topk(min(self.tree_nodes, q.shape[-1]), dim=-1)
        probabilities = top.values.clamp(0.0, 1.0).tolist()
        key = regime(params)
        if policy is not None and policy.costs is None:
            policy = None  # not measured yet: an uncut tree
        chances = (
            [policy.acceptances(key, row) for row in probabilities] if policy is not None else probabilities
        )
        candidates = [[self._target_ids[c] for c in row] for row in top.indices.tolist()]
        paths: list[tuple[int, ...]] = []
        kept: set[tuple[int, ...]] = {()}
        for path in tree_from_accuracies(chances, self.tree_nodes):  # parents first
            parent = path[:-1]
            if (
                parent in kept
                and probabilities[len(path) - 1][path[-1]] > 0
                and not (parent and candidates[len(parent) - 1][parent[-1]] in eos)
            ):
                paths.append(path)
                kept.add(path)
        if policy is not None:
            assert policy.costs is not None
            # best first (a child is never likelier than its parent; ties: the shorter path), cut, then
            # parents first again as the uncut tree's paths are
            chance = {path: math.prod(chances[d][r] for d, r in enumerate(path)) for path in paths}
            best_first = sorted(paths, key=lambda path: (-chance[path], len(path)))
            costs = replace(policy.costs, draft=max(self._forward_time, spent))
            keep = policy.cut_tree([chance[path] for path in best_first], costs)
            paths = sorted(best_first[:keep], key=lambda path: (len(path), path))
        draft = choices_draft(candidates, paths)
        if policy is not None:  # what commit() tells the policy about these nodes
            depths = draft.depths()
            confidences = [probabilities[d - 1][r] for d, r in zip(depths, draft.rank, strict=True)]
            self._tree_outcome = (policy, key, confidences, list(draft.parents))
        return draft
