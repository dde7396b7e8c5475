"""Drafting with prediction heads on the verifier (Medusa, blockwise parallel decoding).

:class:`HeadsProposer` drafts from the verifier's own last hidden state, which the synchronous loop
hands it after every verifier forward (``observe``; no extra forward): head k's top candidates guess
the token k + 1 places after the next one. A sparse tree given as paths of ranks ("choices", Medusa's
format: ``[[0], [1], [0, 0], ...]``, rank r at depth d = head d's r-th most likely token) turns them into
a :class:`~train.decoding.draft.Draft` of deterministic candidates (``q = None``). The candidates of a
node do not depend on its path (the heads read one state), as in the authors' code. Verification is
:func:`~train.decoding.tree.verify_tree`: greedy at T = 0, and at T > 0 the recursive rule with point-mass
proposals, which samples from p without replacement over the candidates: lossless.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from ._common import eos_set, validate_request
from .draft import Draft
from .loop import run_synchronous
from .metrics import DecodeResult, DecodeStats
from .model_call import TimedModel
from .sampling import SamplingParams

__all__ = ["DEFAULT_CHOICES", "HeadsProposer", "MedusaDecoder", "chain_choices"]

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


class HeadsProposer:
    """Deterministic draft trees from prediction heads on the verifier's last hidden state."""

    hidden_layer = -1  # hidden_states[-1]: the final (normalised) state the lm_head reads

    def __init__(self, heads: torch.nn.Module, choices: Sequence[Sequence[int]], vocab_size: int) -> None:
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
        self._hidden: torch.Tensor | None = None

    def start(self) -> None:
        self._hidden = None

    def observe(self, hidden: torch.Tensor) -> None:
        self._hidden = hidden

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
        if not paths:
            return Draft()
        param = next(self.heads.parameters())
        start = time.perf_counter()
        logits = self.heads(self._hidden.to(param.device, param.dtype))[: self.depth, : self.vocab_size]
        if param.device.type == "cuda":
            torch.cuda.synchronize(param.device)
        stats.drafter_calls += 1  # the heads are the drafter: their forward is its time
        stats.drafter_time += time.perf_counter() - start
        candidates = logits.topk(min(self.top, logits.shape[-1]), dim=-1).indices.tolist()  # (K, top)
        index: dict[tuple[int, ...], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        ranks: list[int] = []
        for p in paths:
            if p[-1] >= len(candidates[len(p) - 1]) or (len(p) > 1 and p[:-1] not in index):
                continue
            index[p] = len(tokens)
            tokens.append(int(candidates[len(p) - 1][p[-1]]))
            parents.append(index[p[:-1]] if len(p) > 1 else -1)
            ranks.append(p[-1])
        return Draft(tokens, parents, None, ranks)

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        """Nothing cached here: the next draft comes from the state :meth:`observe` receives."""


class MedusaDecoder:
    """Speculative decoding with prediction heads: ``heads(hidden) -> (K, V)`` on the verifier's last
    hidden state (e.g. :class:`train.models.heads.MedusaHeads`), a sparse tree of their top candidates
    (``tree``: paths of ranks; None: :data:`DEFAULT_CHOICES`; :func:`chain_choices` for blockwise
    decoding), verified in one verifier forward per step. Same ``generate`` as the other decoders.
    """

    def __init__(
        self, verifier: torch.nn.Module, heads: torch.nn.Module, tree: Sequence[Sequence[int]] | None = None
    ) -> None:
        self.verifier = verifier
        self.heads = heads
        self._verifier = TimedModel(verifier)
        self._proposer = HeadsProposer(
            heads, DEFAULT_CHOICES if tree is None else tree, self._verifier.vocab_size
        )
        self.tree = self._proposer.paths
        self.depth = self._proposer.depth

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),  # noqa: B008 -- frozen dataclass, never mutated
        eos_token_id: int | Iterable[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeResult:
        """New tokens only (1-D, CPU), stopping after the first EOS; random numbers from ``generator``."""
        prompt = validate_request(input_ids, max_new_tokens, params, (self.verifier,))
        return run_synchronous(
            self._verifier,
            self._proposer,
            prompt,
            max_new_tokens,
            self.depth,
            params,
            eos_set(eos_token_id),
            generator,
        )
