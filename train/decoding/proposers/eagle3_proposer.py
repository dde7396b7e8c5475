"""Drafting with an EAGLE-3 drafter: EAGLE-2's dynamic tree over the verifier's fused features.

:class:`Eagle3Proposer` reads the verifier's hidden states at the drafter's auxiliary layers
(``hidden_layers``), which the synchronous loop hands it for every position a verifier forward
committed (``observe``; no extra forward). The drafter's input at position p is the pair (feature of
position p, token at p + 1) at RoPE position p (:mod:`train.models.eagle3_drafter`, docs/eagle3.md), so its KV
cache always holds one entry per committed position but the last one: before drafting, the pairs of the
newly committed positions are fed (the catch-up forward), and the output at the last of them is the root
of the tree.

The tree (EAGLE-2, Li et al. 2024; its shape :class:`~train.decoding.proposers.eagle3_tree.Eagle3Tree`):
the root's ``branching`` best draft tokens are the first level, a node scored by its path's cumulative
log-probability; each further level expands the ``branching`` best nodes of the last one in one batched
forward (a node's token at its parent's position + 1, its feature the parent's ``hidden`` output, a tree
mask over the cache and its ancestors), each keeping its ``branching`` best children (EAGLE-2's ``top_k``);
the ``total_tokens`` best nodes overall (ties: the older) form the draft, closed under ancestors. Nodes
never stay in the drafter's cache. ``depth`` is the tree's depth (``depth - 1`` batched forwards after the
catch-up; the authors count forwards). The candidates are deterministic (``q = None``), so
:func:`~train.decoding.rules.tree_walk.verify_tree` verifies them losslessly at every temperature.

``sampled_chain``: at T > 0, instead of the tree, a chain of ``depth`` tokens each drawn from the
drafter's distribution warped like the verifier's (temperature, top-k, top-p; zero outside the draft
vocabulary), handed over with those distributions ``q`` so the standard speculative rule accepts
token x with probability min(1, p(x) / q(x)) (EAGLE-1's way of sampling; lossless for any q). A
deterministic tree's candidates pass only with probability p(x) each, a sampled chain's with
1 - TVD(p, q). T = 0 keeps the tree. ``draft_temperature`` divides the drafter's logits first: a drafter
trained on a few thousand answers is less confident than the verifier, and a sharper q (0.8) is
accepted more often (docs/eagle3.md); any value stays lossless, since q is what the tokens were drawn from.

``sampled_tree`` (children per depth): at T > 0, a tree instead, each node's children drawn from its q
(the same warped, ``draft_temperature``-scaled distribution) without replacement, as RSD-C draws them
(Jeon et al. 2024); the recursive rule without replacement verifies them, so two or three distinct first
tokens each get their chance where a chain offers one.

:meth:`Eagle3Proposer.propose_chain`: the chain a gated tree falls back on, its length chosen by cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from train.decoding.cache import buffered_cache, cache_length, crop_cache
from train.decoding.draft import Draft
from train.decoding.length_policy import ChainOutcome, CostAwareLength, regime
from train.decoding.metrics import DecodeStats
from train.decoding.proposers.eagle3_tree import Eagle3Tree, node_mask, select_nodes
from train.decoding.proposers.model_proposer import draft_confidence
from train.decoding.proposers.tree_proposers import gumbel_top_k
from train.decoding.sampling import SamplingParams, draw_index, uniforms, warp
from train.models.eagle3_drafter import Eagle3Drafter

__all__ = ["Eagle3Proposer"]


class Eagle3Proposer:
    """Deterministic EAGLE-2 draft trees from an EAGLE-3 drafter (see the module docstring); ``length``:
    the cost-aware length of :meth:`propose_chain`, the chain a gated tree falls back on
    (:class:`~train.decoding.proposers.gated_proposer.GatedProposer`); :meth:`propose` ignores it."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        vocab_size: int,
        tree: Eagle3Tree | None = None,
        length: CostAwareLength | None = None,
    ) -> None:
        self.drafter = drafter
        self.vocab_size = vocab_size
        #: The draft's shape (:class:`Eagle3Tree`).
        self.tree = tree or Eagle3Tree()
        self.length = length
        #: The last chain cut by ``length``, awaiting its verdict.
        self._chain: ChainOutcome | None = None
        self.hidden_layers: tuple[int, ...] = tuple(int(i) for i in drafter.aux_layers)
        param = drafter.fc.weight
        self._device, self._dtype = param.device, param.dtype
        self._targets = drafter.draft_ids.to(self._device)  # draft index -> verifier id
        self._target_ids: list[int] = self._targets.tolist()
        self._cache: DynamicCache | None = None
        self._fed = 0  # drafter cache length: positions 0 .. fed - 1 hold their (feature, next token) pair
        self._pending: list[torch.Tensor] = []  # fused features (P, h) of positions fed, fed + 1, ...

    def start(self) -> None:
        self._cache = None
        self._fed = 0
        self._pending = []
        self._chain = None

    def observe(self, states: torch.Tensor) -> None:
        """The verifier's states (P, len(aux_layers), d) at the positions just committed, in order; kept
        fused, (P, h), until the next draft feeds them."""
        flat = states.reshape(states.shape[0], -1).to(self._device, self._dtype)  # cat over the layers
        self._pending.append(self.drafter.fuse(flat))

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        """The first ``length`` tokens are final; the drafter's cache never holds more than
        ``length`` (tree nodes are cropped after every draft), so this only guards that. A chain cut by
        cost teaches its length policy what the verifier accepted of it."""
        if self._chain is not None:
            self._chain.record(length)
            self._chain = None
        if self._cache is not None and self._fed > length:
            crop_cache(self._cache, length, self._fed)
            self._fed = length

    @property
    def cache_length(self) -> int:
        """Positions in the drafter's KV cache (committed positions only between drafts)."""
        return cache_length(self._cache)

    def propose(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        self._chain = None
        root = self._catch_up(sequence, budget, stats)
        if root is None:
            return Draft()
        logits, hidden, start = root
        depth = min(self.tree.depth, budget)
        if self.tree.sampled_tree and not params.greedy:
            draft, forwards = self._sample_tree(
                logits, hidden, self.tree.sampled_tree[:budget], params, generator, eos
            )
        elif self.tree.sampled_chain and not params.greedy:
            draft, forwards, _ = self._chain_of(logits, hidden, depth, params, generator, eos)
        else:
            draft, forwards = self._grow(logits, hidden, depth)
        return self._finish(draft, forwards, start, stats)

    def propose_chain(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        """A chain of the same drafter instead of the tree: at most ``budget`` drafts, the greedy ones at
        T = 0, drawn from q with q at T > 0 (``sampled_chain``'s q), its length chosen draft by draft by
        ``length`` under the pair's measured costs, on q alone before the draw
        (:meth:`~train.decoding.length_policy.CostAwareLength.include`, ``extend``); no draft, and no
        drafter forward, where none pays (``should_draft``: a plain verifier step)."""
        self._chain = None
        if self.length is None:
            raise RuntimeError(
                "Eagle3Proposer.propose_chain needs a length policy (the decoder's fallback_gamma)"
            )
        key = regime(params)
        if not self.length.should_draft(key, budget):
            return Draft()
        root = self._catch_up(sequence, budget, stats)
        if root is None:
            return Draft()
        logits, hidden, start = root
        draft, forwards, confidences = self._chain_of(logits, hidden, budget, params, generator, eos, key)
        if draft.tokens:
            self._chain = ChainOutcome(self.length, key, confidences, len(draft.tokens), len(sequence))
        return self._finish(draft, forwards, start, stats)

    def _catch_up(
        self, sequence: list[int], budget: int, stats: DecodeStats
    ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Feed the pairs of the positions committed since the last draft (the catch-up forward): the
        root's logits (N,) and hidden output (h,), and when the draft's clock started; None where there
        is nothing to draft from (no features yet, or no budget)."""
        features = torch.cat(self._pending) if self._pending else None
        n_new = len(sequence) - 1 - self._fed  # positions whose pair the drafter has not read
        if features is None or n_new < 1 or budget < 1:
            return None
        if features.shape[0] != n_new:
            raise RuntimeError(
                f"{features.shape[0]} verifier features pending for {n_new} uncached positions: "
                "observe must follow every verifier forward"
            )
        start = time.perf_counter()
        prefill = self._cache is None  # the first catch-up reads the whole prompt
        first = self._fed
        tokens = torch.tensor([sequence[first + 1 : first + 1 + n_new]], device=self._device)
        positions = torch.arange(first, first + n_new, device=self._device)[None]
        cache = buffered_cache() if prefill else self._cache
        out = self.drafter(tokens, features[None], positions, past_key_values=cache, use_cache=True)
        self._cache = out.past_key_values
        self._fed += n_new
        self._pending = []
        if prefill:  # kept apart, as for every drafter, so the cost ratio compares decoding steps only
            self._synchronize()
            stats.drafter_prefill_calls += 1
            stats.drafter_prefill_time += time.perf_counter() - start
        return out.logits[0, -1], out.hidden[0, -1], start

    def _finish(self, draft: Draft, forwards: int, start: float, stats: DecodeStats) -> Draft:
        """The draft's nodes leave the drafter's cache; its forwards and time since ``start`` are counted."""
        crop_cache(self._cache, self._fed)
        self._synchronize()
        stats.drafter_calls += 1 + forwards
        stats.drafter_time += time.perf_counter() - start
        return draft

    def _synchronize(self) -> None:
        """Wait for the drafter's own device, so the clock measures its work."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _compact_distribution(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """q over the draft vocabulary (N,): the drafter's logits (N,) divided by ``draft_temperature``,
        warped by ``params`` (zero at every other verifier id)."""
        return warp(logits.float() / self.tree.draft_temperature, params)

    def _distribution(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """q over the verifier's vocabulary (V,): :meth:`_compact_distribution` placed at the target ids."""
        q = torch.zeros(self.vocab_size, dtype=torch.float32, device=logits.device)
        return q.index_copy_(0, self._targets, self._compact_distribution(logits, params))

    def _chain_of(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        depth: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        key: object = None,
    ) -> tuple[Draft, int, list[float]]:
        """A chain of at most ``depth`` tokens (it stops after an eos) from the root's logits (N,) and hidden
        output (h,): drawn from q with q at T > 0, greedy at T = 0; its drafter forwards; and where ``key``
        names a regime, each kept draft's confidence, the chain cut by ``length`` before each draw. Its
        nodes enter the drafter's cache after the committed positions (cropped after the draft)."""
        greedy = params.greedy
        cut = self.length if key is not None else None
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        columns: list[int] = []
        confidences: list[float] = []
        forwards = 0
        u = [] if greedy else uniforms(depth, generator).tolist()
        for d in range(depth):
            # greedy: the logits; else q over the draft vocabulary, kept compact (Draft.support)
            q = logits if greedy else self._compact_distribution(logits, params)
            if cut is not None:  # decided on q alone, before the draw (length_policy.py)
                confidences.append(draft_confidence(q, int(q.argmax()), greedy))
                if not cut.include(key, confidences, depth):
                    confidences.pop()
                    break
            column = int(q.argmax()) if greedy else draw_index(q, u[d])
            token = self._target_ids[column]
            tokens.append(token)
            qs.append(q)
            columns.append(column)
            if (
                d == depth - 1
                or token in eos
                or (cut is not None and not cut.extend(key, confidences, depth))
            ):
                break
            out = self.drafter(
                torch.tensor([[token]], device=self._device),
                hidden[None, None],
                torch.full((1, 1), self._fed + d, device=self._device),
                past_key_values=self._cache,
            )
            logits, hidden = out.logits[0, -1], out.hidden[0, -1]
            forwards += 1
        if greedy or not tokens:
            return Draft.chain(tokens), forwards, confidences
        draft = Draft.chain(tokens, torch.stack(qs), support=self._targets, columns=columns)
        return draft, forwards, confidences

    def _sample_tree(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        branching: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
    ) -> tuple[Draft, int]:
        """A tree sampled from the drafter (``sampled_tree``; RSD-C's tree, Jeon et al. 2024): every node
        at depth d (the root's children at depth 0) gets ``branching[d]`` children drawn *without
        replacement* from its q (Gumbel-top-k over the draft vocabulary; fewer where q has fewer
        tokens), in draw order, each handed its parent's q; a node after an eos is not expanded. From
        the root's logits (N,) and hidden output (h,); returns the draft and the drafter forwards it
        took (one per expanded depth). Verified by the recursive rule without replacement: lossless
        for any q, since every sibling set is a without-replacement sample of the q it carries."""
        tokens: list[int] = []
        parents: list[int] = []
        ranks: list[int] = []
        qs: list[torch.Tensor] = []
        frontier: list[int] = [-1]
        rows_logits, rows_hidden = logits[None], hidden[None]
        slot: dict[int, int] = {}  # expanded node -> its cache slot after the committed positions
        lineage: dict[int, list[int]] = {-1: []}  # node -> its expanded ancestors and itself
        feature: dict[int, torch.Tensor] = {}  # node -> the hidden output of its parent (its input feature)
        forwards = 0
        for level, width in enumerate(branching):
            q = torch.stack([self._distribution(row, params) for row in rows_logits])  # (n, V)
            sub = q.index_select(1, self._targets)  # q's support is the draft vocabulary
            drawn, scores = gumbel_top_k(
                torch.log(sub), width, uniforms(tuple(sub.shape), generator, q.device)
            )
            drawn_rows, score_rows = self._targets[drawn].tolist(), scores.tolist()  # one copy per level
            level_nodes: list[int] = []
            for row, parent in enumerate(frontier):
                for rank, (token, score) in enumerate(zip(drawn_rows[row], score_rows[row], strict=True)):
                    if score == -math.inf:  # q has fewer tokens than the width
                        break
                    node = len(tokens)
                    tokens.append(int(token))
                    parents.append(parent)
                    ranks.append(rank)
                    qs.append(q[row])
                    feature[node] = rows_hidden[row]
                    lineage[node] = [*lineage[parent], node]
                    level_nodes.append(node)
            expand = [n for n in level_nodes if tokens[n] not in eos]
            if level + 1 == len(branching) or not expand:
                break
            for n in expand:
                slot[n] = len(slot)
            mask = node_mask(
                self._fed, len(slot), [[slot[a] for a in lineage[n]] for n in expand], self._device
            )
            out = self.drafter(  # the nodes' kv enter the cache, cropped after the draft
                torch.tensor([[tokens[n] for n in expand]], device=self._device),
                torch.stack([feature[n] for n in expand])[None],
                torch.full((1, len(expand)), self._fed + level, device=self._device),
                attention_mask=mask,
                past_key_values=self._cache,
            )
            forwards += 1
            frontier, rows_logits, rows_hidden = expand, out.logits[0], out.hidden[0]
        return Draft(tokens, parents, torch.stack(qs), ranks, kind="without_replacement"), forwards

    def _grow(self, root_logits: torch.Tensor, root_hidden: torch.Tensor, depth: int) -> tuple[Draft, int]:
        """EAGLE-2's tree from the root's logits (N,) and hidden output (h,), at most ``depth`` deep, and
        the number of drafter forwards it took.

        Node lists grow level by level (parents before children); the drafter's cache gains one entry
        per expanded node, at slots ``self._fed + j`` in the order they were expanded."""
        k = min(self.tree.branching, root_logits.shape[-1])
        logp = root_logits.float().log_softmax(-1).clamp(max=0.0)
        top = logp.topk(k)
        ids: list[int] = top.indices.tolist()  # draft-vocabulary indices
        scores: list[float] = top.values.tolist()
        parents: list[int] = [-1] * k
        level = list(range(k))  # the nodes of the deepest level
        hidden_of: dict[int, torch.Tensor] = {-1: root_hidden}  # node -> its parent's feature for it
        slot: dict[int, int] = {}  # expanded node -> its cache slot (index among expanded nodes)
        ancestors: dict[int, list[int]] = {i: [] for i in level}
        base = self._fed
        for d in range(1, depth):
            frontier = sorted(level, key=lambda i: (-scores[i], i))[: self.tree.branching]
            for i in frontier:
                slot[i] = len(slot)
            seen = [[slot[a] for a in (*ancestors[i], i)] for i in frontier]
            mask = node_mask(base, len(slot), seen, self._device)
            node_ids = torch.tensor([ids[i] for i in frontier], device=self._device)
            out = self.drafter(  # the nodes' kv enter the cache, cropped after the draft
                self._targets[node_ids][None],
                torch.stack([hidden_of[parents[i]] for i in frontier])[None],
                torch.full((1, len(frontier)), base - 1 + d, device=self._device),
                attention_mask=mask,
                past_key_values=self._cache,
            )
            child = out.logits[0].float().log_softmax(-1).clamp(max=0.0).topk(k)
            child_ids, child_scores = child.indices.tolist(), child.values.tolist()  # one copy per level
            level = []
            for row, i in enumerate(frontier):
                hidden_of[i] = out.hidden[0, row]
                for j in range(k):
                    node = len(ids)
                    ids.append(child_ids[row][j])
                    scores.append(scores[i] + child_scores[row][j])
                    parents.append(i)
                    ancestors[node] = [*ancestors[i], i]
                    level.append(node)
        kept = select_nodes(scores, parents, self.tree.total_tokens)
        index = {old: new for new, old in enumerate(kept)}
        draft_ids = torch.tensor([ids[i] for i in kept], device=self._device)
        target = self._targets[draft_ids].tolist()
        new_parents = [index[parents[i]] if parents[i] >= 0 else -1 for i in kept]
        ranks: list[int] = []
        for i in kept:  # rank among kept siblings by score (ties: the older node)
            siblings = [s for s in kept if parents[s] == parents[i]]
            ranks.append(sorted(siblings, key=lambda s: (-scores[s], s)).index(i))
        return Draft([int(t) for t in target], new_parents, None, ranks), depth - 1
