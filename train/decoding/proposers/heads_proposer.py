"""Drafting with prediction heads on the verifier (Medusa, blockwise parallel decoding).

:class:`HeadsProposer` drafts from the verifier's own last hidden state, which the synchronous loop
hands it after every verifier forward (``observe``; no extra forward): head k's top candidates guess
the token k + 1 places after the next one. A sparse tree given as paths of ranks ("choices", Medusa's
format: ``[[0], [1], [0, 0], ...]``, rank r at depth d = head d's r-th most likely token) turns them into
a :class:`~train.decoding.draft.Draft` of deterministic candidates (``q = None``). The candidates of a
node do not depend on its path (the heads read one state), as in the authors' code. Verification is
:func:`~train.decoding.rules.tree_walk.verify_tree`: greedy at T = 0, and at T > 0 the recursive rule
with point-mass proposals, which samples from p without replacement over the candidates: lossless.
"""

from __future__ import annotations

import heapq
import inspect
import time
from collections.abc import Sequence

import torch

from train.decoding.draft import Draft
from train.decoding.metrics import DecodeStats
from train.decoding.refine import Refiner
from train.decoding.sampling import SamplingParams

__all__ = [
    "DEFAULT_CHOICES",
    "HeadsProposer",
    "chain_choices",
    "choices_draft",
    "tree_from_accuracies",
    "trie_draft",
]

#: A small sparse tree (12 nodes, depth 4): the top-3 of head 0, the top-2 of head 1 under its best
#: two, and a top-1 spine; sized for a 4-head model on a CPU verifier (a tree built from measured per-head
#: top-k accuracies, as the Medusa paper recommends, replaces it for a trained model).
DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,),
    (0, 0), (0, 1), (1, 0), (1, 1),
    (0, 0, 0), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 1, 0, 0),
)  # fmt: skip


def chain_choices(depth: int) -> tuple[tuple[int, ...], ...]:
    """The blockwise top-1 chain (Stern et al.): ``[[0], [0, 0], ...]``."""
    return tuple((0,) * d for d in range(1, depth + 1))


def tree_from_accuracies(
    accuracies: Sequence[Sequence[float]], num_nodes: int
) -> tuple[tuple[int, ...], ...]:
    """The sparse tree of ``num_nodes`` paths with the largest expected accepted length (the Medusa
    paper's construction). ``accuracies[k][r]`` in [0, 1]: how often head k's rank-r candidate is the
    verifier's token (measured on validation data). Returns the paths, parents first.

    Taking heads as independent, a path is accepted with the product of its ranks' accuracies, and a
    tree's expected accepted length is the sum of that over its paths. A path needs its parent in the
    tree, not its lower-rank siblings (:class:`HeadsProposer` drafts any path whose parent is drafted,
    and a candidate is accepted for being the verifier's token, whoever its siblings are), so the best
    tree of each size is the ``num_nodes`` paths of largest chance: a child's chance never exceeds its
    parent's, so those paths hold their parents (ties go to the shorter path). They are enumerated best
    first without scoring every path: each head's ranks are visited in decreasing accuracy (which need
    not fall with the rank), and a popped path offers its next sibling in that order and its best child,
    neither more likely than itself.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    acc = [[float(a) for a in row] for row in accuracies]
    if not acc or any(not row for row in acc):
        raise ValueError("accuracies needs one non-empty row of per-rank accuracies per head")
    bad = [(k, r, a) for k, row in enumerate(acc) for r, a in enumerate(row) if not 0.0 <= a <= 1.0]
    if bad:
        k, r, a = bad[0]
        raise ValueError(f"accuracies are probabilities in [0, 1]; head {k} rank {r} has {a}")
    order = [sorted(range(len(row)), key=row.__getitem__, reverse=True) for row in acc]  # ties: by rank
    # heap entries: (-chance, depth, path of ranks, parent's chance, place in the sibling order)
    chosen: list[tuple[int, ...]] = []
    frontier: list[tuple[float, int, tuple[int, ...], float, int]] = [
        (-acc[0][order[0][0]], 1, (order[0][0],), 1.0, 0)
    ]
    while frontier and len(chosen) < num_nodes:
        neg, depth, path, parent_chance, place = heapq.heappop(frontier)
        chosen.append(path)
        head = depth - 1
        if place + 1 < len(order[head]):  # the next sibling, in decreasing accuracy
            rank = order[head][place + 1]
            heapq.heappush(
                frontier,
                (-parent_chance * acc[head][rank], depth, (*path[:-1], rank), parent_chance, place + 1),
            )
        if depth < len(acc):  # the best child
            rank = order[depth][0]
            heapq.heappush(frontier, (neg * acc[depth][rank], depth + 1, (*path, rank), -neg, 0))
    return tuple(sorted(chosen, key=lambda p: (len(p), p)))


def trie_draft(paths: Sequence[Sequence[int]]) -> Draft:
    """Token paths (best first) merged into one tree of deterministic candidates: shared prefixes become
    one node; siblings are ranked by the first path that reaches them."""
    index: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    ranks: list[int] = []
    children: dict[int, int] = {}
    for path in paths:
        for depth in range(1, len(path) + 1):
            prefix = tuple(int(t) for t in path[:depth])
            if prefix in index:
                continue
            parent = index[prefix[:-1]] if depth > 1 else -1
            index[prefix] = len(tokens)
            tokens.append(prefix[-1])
            parents.append(parent)
            ranks.append(children.get(parent, 0))
            children[parent] = ranks[-1] + 1
    return Draft(tokens, parents, None, ranks)


def choices_draft(candidates: Sequence[Sequence[int]], paths: Sequence[tuple[int, ...]]) -> Draft:
    """A tree of deterministic candidates from per-depth ranked ``candidates`` (``candidates[d][r]``: the
    rank-r token at depth d + 1, the same whatever the path above it) and ``paths`` of ranks, parents first
    (Medusa's "choices"). A path whose rank is missing or whose parent was not drafted is skipped."""
    index: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    ranks: list[int] = []
    for p in paths:
        if len(p) > len(candidates) or p[-1] >= len(candidates[len(p) - 1]):
            continue
        if len(p) > 1 and p[:-1] not in index:
            continue
        index[p] = len(tokens)
        tokens.append(int(candidates[len(p) - 1][p[-1]]))
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
        ranks.append(p[-1])
    return Draft(tokens, parents, None, ranks)


class HeadsProposer:
    """Deterministic draft trees from prediction heads on the verifier's last hidden state."""

    hidden_layers = (-1,)  # hidden_states[-1]: the final (normalised) state the lm_head reads

    def __init__(
        self,
        heads: torch.nn.Module,
        choices: Sequence[Sequence[int]],
        vocab_size: int,
        refiner: Refiner | None = None,
        refine_depth: int | None = None,
    ) -> None:
        paths = [tuple(int(r) for r in c) for c in choices]
        if not paths or any(not p or min(p) < 0 for p in paths):
            raise ValueError(f"choices must be non-empty paths of ranks >= 0, got {choices!r}")
        if len(set(paths)) != len(paths):
            raise ValueError("choices must not repeat a path")
        for p in paths:
            if len(p) > 1 and p[:-1] not in paths:
                raise ValueError(f"choice {list(p)} needs its parent {list(p[:-1])} in the tree")
        self.heads = heads
        self.paths = sorted(paths, key=lambda p: (len(p), p))  # parents before children
        self.depth = max(len(p) for p in self.paths)
        self.top = max(max(p) for p in self.paths) + 1
        self.vocab_size = vocab_size
        self.refiner = refiner
        if refiner is not None:  # the lattice's depth replaces the tree's
            if refine_depth is None or refine_depth < 1:
                raise ValueError("refined drafting needs the lattice depth (the number of heads to read)")
            self.depth = refine_depth
            self.top = int(getattr(refiner, "k", self.top))
        # heads that can stop early (MedusaHeads) compute only the tree's depth, not every head
        self._takes_num_heads = "num_heads" in inspect.signature(heads.forward).parameters
        self._hidden: torch.Tensor | None = None

    def start(self) -> None:
        self._hidden = None

    def observe(self, states: torch.Tensor) -> None:
        """The verifier's states (P, 1, d) at the positions just committed, from the loop; the heads read
        the last one's (d,)."""
        self._hidden = states[-1, -1]

    def propose(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        if self._hidden is None:
            return Draft()
        paths = [p for p in self.paths if len(p) <= budget]
        if not paths and self.refiner is None:
            return Draft()
        param = next(self.heads.parameters())
        start = time.perf_counter()
        hidden = self._hidden.to(param.device, param.dtype)
        logits = (self.heads(hidden, num_heads=self.depth) if self._takes_num_heads else self.heads(hidden))[
            : self.depth, : self.vocab_size
        ]
        if self.refiner is not None:
            top = logits.float().log_softmax(dim=-1).topk(min(self.top, logits.shape[-1]), dim=-1)
            lattice_tokens, lattice_logprobs = top.indices.cpu().numpy(), top.values.cpu().numpy()
            drafts = self.refiner.refine(sequence, lattice_tokens[:budget], lattice_logprobs[:budget])
            stats.drafter_calls += 1  # the heads and the refiner's model are the drafter
            stats.drafter_time += time.perf_counter() - start
            return trie_draft(drafts)
        if param.device.type == "cuda":
            torch.cuda.synchronize(param.device)
        stats.drafter_calls += 1  # the heads are the drafter: their forward is its time
        stats.drafter_time += time.perf_counter() - start
        candidates = logits.topk(min(self.top, logits.shape[-1]), dim=-1).indices.tolist()  # (K, top)
        return choices_draft(candidates, paths)

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        """Nothing cached here: the next draft comes from the state :meth:`observe` receives."""
