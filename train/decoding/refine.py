"""Refining prediction heads' drafts (BPD: Kim et al., arXiv 2404.09221; docs/bpd.md).

The heads give a *lattice*: slot i holds head i's top-k tokens with their log-probabilities. A refiner
turns it into drafts for :class:`~train.decoding.proposers.heads_proposer.HeadsProposer`, which merges
them into a trie of deterministic candidates verified in one verifier forward (greedy: the longest path
equal to the verifier's argmax; T > 0: the lossless recursive rule, as for Medusa trees):

- :class:`PBestRefiner` (global p-best rescoring): every path scored by
  ``sum_i (1 - alpha) * head_logprob_i + alpha * lm_logprob(token_i | context, earlier tokens)`` with a
  language model over token ids (an n-gram model, :class:`train.models.ngram.NGramLM`); the p best
  paths come from :func:`p_best_paths`, exact dynamic programming over the model's states (the last
  ``order - 1`` tokens), keeping the p best partial paths per state. ``alpha = 0`` (or no model) is the
  paper's "p-best 0-gram" baseline: the p best paths by head scores alone.
- :class:`LocalNeuralRefiner` (local neural rescoring): left to right, slot i's top-k re-ranked by
  ``(1 - alpha) * head_logprob + alpha * log q(token | context, tokens chosen so far)`` under a small
  causal LM sharing the tokenizer; one refined draft.

A refiner's model runs on the proposer's side, so its time counts as drafter time.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["LocalNeuralRefiner", "PBestRefiner", "Refiner", "TokenScorer", "p_best_paths"]


class TokenScorer(Protocol):
    """A language model over token ids: natural-log P(token | context) for a batch (contexts (M, L),
    most recent token last; tokens (M,)). :class:`train.models.ngram.NGramLM` is one."""

    order: int

    def logprob(self, contexts: np.ndarray, tokens: np.ndarray) -> np.ndarray: ...


class Refiner(Protocol):
    """Drafts from a lattice: ``refine(sequence, tokens (K, k), logprobs (K, k))`` returns token paths
    (each of length <= K), best first."""

    def refine(
        self, sequence: Sequence[int], tokens: np.ndarray, logprobs: np.ndarray
    ) -> list[tuple[int, ...]]: ...


def _order(item: tuple[float, tuple[int, ...]]) -> tuple[float, list[int]]:
    """Higher score first; on a tie, the lower head ranks first."""
    return item[0], [-q for q in item[1]]


def p_best_paths(
    tokens: np.ndarray,
    head_logprobs: np.ndarray,
    p: int,
    context: Sequence[int] = (),
    lm: TokenScorer | None = None,
    alpha: float = 0.0,
) -> list[tuple[float, tuple[int, ...]]]:
    """The ``p`` highest-scoring full paths through the lattice (one token per slot), best first.

    tokens / head_logprobs: (K, k). Score: the module docstring's interpolation (``lm`` None or
    ``alpha`` 0: head log-probabilities only). Exact: partial paths that end in the same LM state (their
    last ``order - 1`` tokens, context included) are scored alike from then on, so keeping the p best per
    state loses none of the p best full paths. Ties keep the lower head ranks first."""
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    num_slots, k = tokens.shape
    use_lm = lm is not None and alpha > 0
    keep = max((lm.order - 1) if use_lm and lm is not None else 0, 0)
    ctx = list(context)
    # per state: a list of (score, ranks) partial paths, at most p, best first
    states: dict[tuple[int, ...], list[tuple[float, tuple[int, ...]]]] = {(): [(0.0, ())]}
    for slot in range(num_slots):
        entries = [(state, score, ranks) for state, paths in states.items() for score, ranks in paths]
        lm_scores = np.zeros((len(entries), k))
        if use_lm and lm is not None:
            width = max(lm.order - 1, 0)
            rows = []
            for _, _, ranks in entries:
                prefix = ctx + [int(tokens[i, r]) for i, r in enumerate(ranks)]
                window = prefix[len(prefix) - width :] if width else []
                rows.append([0] * (width - len(window)) + window)
            # contexts shorter than the order (a prompt shorter than order - 1) are padded with token 0
            contexts = np.repeat(np.asarray(rows, dtype=np.int64).reshape(len(entries), width), k, axis=0)
            candidates = np.tile(tokens[slot].astype(np.int64), len(entries))
            lm_scores = lm.logprob(contexts, candidates).reshape(len(entries), k)
        nxt: dict[tuple[int, ...], list[tuple[float, tuple[int, ...]]]] = {}
        for e, (_, score, ranks) in enumerate(entries):
            for r in range(k):
                total = (
                    score
                    + (1 - alpha) * float(head_logprobs[slot, r])
                    + (alpha * float(lm_scores[e, r]) if use_lm else 0.0)
                )
                path = (*ranks, r)
                state = tuple(int(tokens[i, q]) for i, q in enumerate(path))[-keep:] if keep else ()
                nxt.setdefault(state, []).append((total, path))
        states = {s: heapq.nlargest(p, paths, key=_order) for s, paths in nxt.items()}
    finals = [item for paths in states.values() for item in paths]
    best = heapq.nlargest(p, finals, key=_order)
    return [(score, tuple(int(tokens[i, r]) for i, r in enumerate(ranks))) for score, ranks in best]


class PBestRefiner:
    """Global p-best rescoring (see the module docstring): ``k`` tokens per slot, ``p`` drafts, weight
    ``alpha`` on ``lm`` (None or 0: the p-best 0-gram baseline); the first ``depth`` heads (None: all)."""

    def __init__(
        self,
        lm: TokenScorer | None = None,
        k: int = 5,
        p: int = 4,
        alpha: float = 0.5,
        depth: int | None = None,
    ) -> None:
        if k < 1 or p < 1:
            raise ValueError(f"k and p must be >= 1, got k={k}, p={p}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        if depth is not None and depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.lm, self.k, self.p, self.alpha, self.depth = lm, k, p, alpha, depth

    def refine(
        self, sequence: Sequence[int], tokens: np.ndarray, logprobs: np.ndarray
    ) -> list[tuple[int, ...]]:
        lm = self.lm if self.alpha > 0 else None
        context = list(sequence[-(lm.order - 1) :]) if lm is not None and lm.order > 1 else []
        paths = p_best_paths(tokens[:, : self.k], logprobs[:, : self.k], self.p, context, lm, self.alpha)
        return [path for _, path in paths]


class LocalNeuralRefiner:
    """Local neural rescoring (see the module docstring) with ``lm``, a causal LM on the verifier's
    tokenizer (the tiny drafter by default); ``k`` tokens per slot re-ranked, ``alpha`` its weight.
    ``window``: the last tokens of the sequence the LM reads (it runs without a cache)."""

    def __init__(
        self, lm: Any, k: int = 5, alpha: float = 0.5, depth: int | None = None, window: int = 64
    ) -> None:
        if k < 1 or not 0.0 <= alpha <= 1.0 or window < 1:
            raise ValueError(
                f"need k >= 1, alpha in [0, 1], window >= 1; got k={k}, alpha={alpha}, window={window}"
            )
        self.lm, self.k, self.alpha, self.depth, self.window = lm, k, alpha, depth, window
        self.order = window + 1

    @torch.inference_mode()
    def refine(
        self, sequence: Sequence[int], tokens: np.ndarray, logprobs: np.ndarray
    ) -> list[tuple[int, ...]]:
        device = next(self.lm.parameters()).device
        chosen: list[int] = []
        for slot in range(tokens.shape[0]):
            ids = torch.tensor([list(sequence[-self.window :]) + chosen], device=device)
            lm_logprobs = self.lm(input_ids=ids).logits[0, -1].float().log_softmax(-1)
            cand = torch.as_tensor(tokens[slot, : self.k], device=device, dtype=torch.long)
            cand_lm = lm_logprobs[cand.clamp(max=lm_logprobs.shape[-1] - 1)].cpu().numpy()
            score = (1 - self.alpha) * logprobs[slot, : self.k] + self.alpha * cand_lm
            chosen.append(int(tokens[slot, int(np.argmax(score))]))
        return [tuple(chosen)]
