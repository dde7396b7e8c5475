"""Tree proposers: a drafter expands a draft tree level by level, one forward per depth.

Three ways to choose the children of a node (docs/trees.md):

- ``specinfer`` (Miao et al.): ``branching[d]`` children of every depth-d node drawn i.i.d. from the
  drafter's q (duplicates possible), verified with the multi-round rule with replacement;
- ``rsd_c`` (Jeon et al., RSD with constant branching): ``branching[d]`` distinct children by
  Gumbel-top-k (top-b of log q + Gumbel noise), i.e. sampled without replacement, in draw order;
- ``rsd_s`` (RSD with stochastic beam search, Kool et al. 2019): ``beam_width`` sequences kept per depth
  by their perturbed log-probabilities, over ``depth`` levels; a node's children are again a
  without-replacement sample of its q.

At temperature 0 every method keeps the drafter's top children (top-b; beam search for ``rsd_s``),
deterministically. Each node's ``q`` row is the distribution it was drawn from (its parent's, before
any sibling was removed); ``rank`` is its draw order among its siblings.

Cache: like :class:`~train.decoding.proposers.model_proposer.ModelProposer`, the drafter's cache holds a
prefix of the committed tokens; a block first feeds what it has not seen, then one forward per depth
feeds that depth's nodes with a tree mask. :meth:`TreeProposer.commit` keeps the committed prefix plus
the cache entries of the accepted path (compacted) and drops the rest of the tree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from train.decoding.cache import crop_cache, keep_positions
from train.decoding.draft import Draft
from train.decoding.length_policy import CostAwareLength
from train.decoding.metrics import DecodeStats
from train.decoding.model_call import TimedModel
from train.decoding.proposers.model_proposer import ModelProposer
from train.decoding.sampling import SamplingParams, sample_with_uniform, uniforms
from train.decoding.tree_attention import ancestors

__all__ = [
    "TREE_METHODS",
    "TreeProposer",
    "check_sampled_tree",
    "gumbel_scores",
    "gumbel_top_k",
    "sbs_scores",
    "sbs_top",
]

#: Tree builders and the candidate kind their verification uses at T > 0.
TREE_METHODS: dict[str, str] = {
    "specinfer": "iid",
    "rsd_c": "without_replacement",
    "rsd_s": "without_replacement",
}


def gumbel_scores(log_q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """log q + Gumbel noise (Gumbel = -log(-log u)), float64; -inf where q = 0. Any shape."""
    return log_q.double() - torch.log(-torch.log(u.double().clamp_min(1e-300)))


def gumbel_top_k(log_q: torch.Tensor, k: int, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of ``log_q + Gumbel`` per row: ``k`` tokens sampled without replacement from q, in
    draw order, and their perturbed scores (-inf marks a slot past q's support, where fewer than ``k``
    tokens have q > 0). log_q, u: (*, V); returns (*, k) tokens and scores."""
    scores, tokens = gumbel_scores(log_q, u).topk(min(k, log_q.shape[-1]), dim=-1)
    return tokens, scores


def check_sampled_tree(
    sampled_tree: Sequence[int] | None, max_depth: int | None = None
) -> tuple[int, ...] | None:
    """A sampled tree's children per depth as a decoder config gives them (``sampled_tree: [4, 1]``): None
    stays None (no sampled tree); anything but a non-empty list of integers >= 1, or more depths than
    ``max_depth``, is refused with the setting's name."""
    if sampled_tree is None:
        return None
    branching = list(sampled_tree)
    if not branching or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in branching):
        raise ValueError(f"sampled_tree must be a non-empty list of integers >= 1, got {sampled_tree!r}")
    if max_depth is not None and len(branching) > max_depth:
        raise ValueError(f"sampled_tree has {len(branching)} depths; at most {max_depth} can be drafted")
    return tuple(branching)


def on_support(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q`` (n, V) restricted to the ids some row can draw, and those ids (None when that is every
    id). A drafter over a draft vocabulary (FR-Spec) gives q = 0 on most of the verifier's ids; the
    Gumbel draws over them are wasted work (about 6x on SmolLM2's 49,152 ids with 8,192 drafted)."""
    ids = (q > 0).any(dim=0).nonzero().squeeze(-1)
    if ids.numel() == q.shape[-1]:
        return q, None
    return q.index_select(-1, ids), ids


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, stably."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _conditioned(parent: torch.Tensor, g_hat: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Kool et al.'s eq. 23 in their stable form: Gumbels ``g_hat`` whose row maximum is ``z``,
    conditioned on a maximum of ``parent`` (n, 1). -inf stays -inf."""
    v = parent - g_hat + _log1mexp((g_hat - z).clamp_max(0.0))
    scores = parent - v.clamp_min(0) - torch.log1p(torch.exp(-v.abs()))
    return torch.where(torch.isfinite(g_hat), scores, torch.full_like(scores, -math.inf))


def sbs_scores(parent_scores: torch.Tensor, log_phi: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Stochastic beam search's perturbed scores of every child (Kool et al. 2019): Gumbels with
    locations ``log_phi`` (the children's sequence log-probabilities) conditioned on their maximum being
    the parent's perturbed score. parent_scores: (n,); log_phi, u: (n, V). Returns (n, V), -inf where
    log_phi is -inf. Within a parent the order is that of log_phi + Gumbel, so the kept children of a
    node are a without-replacement sample of its q."""
    g_hat = gumbel_scores(log_phi, u)
    z = g_hat.max(dim=-1, keepdim=True).values
    return _conditioned(parent_scores.double().unsqueeze(-1), g_hat, z)


def sbs_top(
    parent_scores: torch.Tensor, log_phi: torch.Tensor, u: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best children of each row by :func:`sbs_scores`, computing the conditioned scores for
    those only (the transform is increasing within a row). Returns (scores, tokens), both (n, k)."""
    g_hat = gumbel_scores(log_phi, u)
    z = g_hat.max(dim=-1, keepdim=True).values
    top, tokens = g_hat.topk(min(k, g_hat.shape[-1]), dim=-1)
    return _conditioned(parent_scores.double().unsqueeze(-1), top, z), tokens


class TreeProposer(ModelProposer):
    """A draft tree from a causal LM drafter (see the module docstring).

    method: one of :data:`TREE_METHODS`. branching: children per node at each depth (``specinfer``,
    ``rsd_c``); depth and beam_width: the beam search of ``rsd_s``. A block's budget caps the depth.
    ``length``: the cost-aware draft length of :meth:`propose_chain`, the chain a gated tree falls back on
    (:class:`~train.decoding.proposers.gated_proposer.GatedProposer`); :meth:`propose` ignores it.
    """

    # more than 5 arguments: the drafter and vocabulary, then the tree's shape, and the chain's length policy
    def __init__(
        self,
        drafter: TimedModel,
        vocab_size: int,
        method: str,
        branching: Sequence[int] = (),
        depth: int = 0,
        beam_width: int = 0,
        length: CostAwareLength | None = None,
    ) -> None:
        super().__init__(drafter, vocab_size, length=length)
        if method not in TREE_METHODS:
            raise ValueError(f"method must be one of {sorted(TREE_METHODS)}, got {method!r}")
        self.method = method
        self.branching = tuple(int(b) for b in branching)
        self.depth = len(self.branching) if method != "rsd_s" else int(depth)
        self.beam_width = int(beam_width)
        self._fed: list[int] = []  # tree nodes fed this block, in cache order after the prefix

    @property
    def kind(self) -> str:
        """How siblings were drawn (:data:`~train.decoding.rules.recursive.CANDIDATE_KINDS`)."""
        return TREE_METHODS[self.method]

    def start(self) -> None:
        super().start()
        self._fed = []

    # ------------------------------------------------------------------ drafting

    def propose(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        depth = min(self.depth, budget)
        tokens: list[int] = []
        parents: list[int] = []
        ranks: list[int] = []
        qs: list[torch.Tensor] = []
        # scores: the rsd_s beam's perturbed scores and sequence log-probabilities per node
        score: dict[int, float] = {-1: 0.0}
        logp: dict[int, float] = {-1: 0.0}
        self._fed = []
        out = self._call(self._embeddable(sequence[self._length :]), stats)
        self._length = len(sequence)
        frontier: list[int] = [-1]  # nodes whose children are drawn next
        frontier_logits = out.logits[-1:]
        for level in range(depth):
            chosen: list[
                tuple[int, int, torch.Tensor | None, float, float]
            ] = []  # parent, token, q, score, logp
            if self.method == "rsd_s":
                chosen = self._beam_step(frontier, frontier_logits, params, generator, score, logp)
            else:
                width = self.branching[level]
                for row, kids in enumerate(self._children(frontier_logits, width, params, generator)):
                    chosen += [(frontier[row], tok, q, 0.0, 0.0) for tok, q in kids]
            if not chosen:
                break
            start = len(tokens)
            rank_of: dict[int, int] = {}
            for parent, tok, q, sc, lp in chosen:
                node = len(tokens)
                tokens.append(tok)
                parents.append(parent)
                ranks.append(rank_of.get(parent, 0))
                rank_of[parent] = ranks[-1] + 1
                if q is not None:
                    qs.append(q)
                score[node], logp[node] = sc, lp
            expand = [i for i in range(start, len(tokens)) if tokens[i] not in eos]
            if level + 1 == depth or not expand:
                break
            frontier = expand
            frontier_logits = self._feed_level(expand, tokens, parents, stats)
        q_all = torch.stack(qs) if qs and not params.greedy else None
        return Draft(tokens, parents, q_all, ranks, kind=self.kind)

    def propose_chain(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        """A chain of the same drafter instead of the tree (:meth:`ModelProposer.propose`): its length chosen
        by ``length``'s costs where there is one, none where no draft pays; ``budget`` drafts at most."""
        self._fed = []
        return super().propose(sequence, budget, params, generator, eos, stats)

    def _feed_level(
        self, nodes: list[int], tokens: list[int], parents: list[int], stats: DecodeStats
    ) -> torch.Tensor:
        """One forward over ``nodes`` (one depth of the tree) after the prefix and the nodes fed before;
        returns their logits (len(nodes), V)."""
        cached = self._length + len(self._fed)
        slot = {node: j for j, node in enumerate(self._fed)}
        lines = ancestors(parents)
        allowed = torch.zeros(len(nodes), cached + len(nodes), dtype=torch.bool)
        allowed[:, : self._length] = True
        depth = len(lines[nodes[0]]) + 1
        for r, node in enumerate(nodes):
            for a in lines[node]:
                allowed[r, self._length + slot[a]] = True
            allowed[r, cached + r] = True
        mask = torch.zeros(1, 1, len(nodes), cached + len(nodes), dtype=self.drafter.mask_dtype)
        mask = mask.masked_fill(~allowed, torch.finfo(self.drafter.mask_dtype).min)
        positions = torch.full((1, len(nodes)), self._length - 1 + depth, dtype=torch.long)
        out = self._call(
            self._embeddable([tokens[n] for n in nodes]), stats, positions, mask, logits_to_keep=None
        )
        self._fed.extend(nodes)
        return out.logits

    def _children(
        self, logits: torch.Tensor, width: int, params: SamplingParams, generator: torch.Generator | None
    ) -> list[list[tuple[int, torch.Tensor | None]]]:
        """``width`` children for each row of ``logits`` (one depth's nodes, (n, V)), drawn for all rows
        at once: top-b at T = 0; i.i.d. (specinfer) or Gumbel-top-k (rsd_c) from each row's q."""
        shared = logits[:, : self._shared] if self._slice else logits
        n = logits.shape[0]
        if params.greedy:
            top = shared.topk(min(width, shared.shape[-1]), dim=-1).indices.tolist()
            return [[(t, None) for t in row] for row in top]
        q = self._distribution(logits, params)  # (n, V)
        if self.method == "specinfer":
            u = uniforms((n, width), generator, q.device)
            drawn = sample_with_uniform(q.unsqueeze(1).expand(n, width, q.shape[-1]), u).tolist()
        else:
            sub, ids = on_support(q)
            tokens, scores = gumbel_top_k(
                torch.log(sub), width, uniforms(tuple(sub.shape), generator, q.device)
            )
            tokens = tokens if ids is None else ids[tokens]
            drawn = [
                [t for t, sc in zip(row_t, row_s, strict=True) if sc > -math.inf]
                for row_t, row_s in zip(tokens.tolist(), scores.tolist(), strict=True)
            ]
        return [[(t, q[row]) for t in drawn[row]] for row in range(n)]

    def _beam_step(
        self,
        frontier: list[int],
        logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        score: dict[int, float],
        logp: dict[int, float],
    ) -> list[tuple[int, int, torch.Tensor | None, float, float]]:
        """One level of (stochastic) beam search: the ``beam_width`` best children over the frontier,
        grouped by parent, siblings in draw order."""
        parent_logp = torch.tensor([logp[p] for p in frontier], dtype=torch.float64, device=logits.device)
        if params.greedy:
            shared = logits[:, : self._shared] if self._slice else logits
            log_phi, q = parent_logp.unsqueeze(-1) + torch.log_softmax(shared.double(), dim=-1), None
            ranked, tokens = log_phi.topk(min(self.beam_width, log_phi.shape[-1]), dim=-1)
            log_phi = ranked  # the kept children's sequence log-probabilities, (n, k)
        else:
            q = self._distribution(logits, params)
            sub, ids = on_support(q)
            sub_log_phi = parent_logp.unsqueeze(-1) + torch.log(sub.double())
            parent_scores = torch.tensor([score[p] for p in frontier], dtype=torch.float64, device=q.device)
            u = uniforms(tuple(sub.shape), generator, q.device)
            ranked, tokens = sbs_top(parent_scores, sub_log_phi, u, self.beam_width)
            tokens = tokens if ids is None else ids[tokens]
            log_phi = parent_logp.unsqueeze(-1) + torch.log(q.gather(-1, tokens).double())  # (n, k)
        width = ranked.shape[-1]
        values, flat = ranked.flatten().topk(min(self.beam_width, ranked.numel()))
        token_ids = tokens.flatten().tolist()
        child_logp = log_phi.flatten().tolist()
        kept = [
            (int(i) // width, token_ids[int(i)], float(v), child_logp[int(i)])
            for i, v in zip(flat.tolist(), values.tolist(), strict=True)
            if v > -math.inf
        ]
        kept.sort(key=lambda c: (c[0], -c[2]))  # siblings together, in draw order
        return [(frontier[row], tok, None if q is None else q[row], sc, lp) for row, tok, sc, lp in kept]

    # ------------------------------------------------------------------ after verification

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        """Keep the committed prefix and the accepted ``path``'s fed nodes (compacted); ``length`` is
        the committed length the verifier keeps (prefix + path). After a chain (:meth:`propose_chain`, or a
        tree that fed no level) the chain's commit: its cache cropped, its length policy told the verdict."""
        if not self._fed:
            super().commit(length, path)
            return
        fed = [self._length + self._fed.index(n) for n in (path or ()) if n in self._fed]
        held = self._length + len(self._fed)
        if self._cache is not None and held:
            if fed:
                self._length = keep_positions(self._cache, [*range(self._length), *fed], held)
            else:
                crop_cache(self._cache, min(self._length, length), held)
                self._length = min(self._length, length)
        self._fed = []
