"""DSpark's Markov head: a low-rank bias on a draft slot's logits from the token before it (docs/dflash.md).

A DFlash block drafts every slot in one forward, so slot k never sees the token slot k - 1 chose: where
two continuations are plausible ("of course" / "no problem") the slots can mix them. DSpark (DeepSeek's
DFlash with a sequential stage; vLLM's and speculators' ``dspark``) adds, after the parallel forward, a
bias that depends on the previous token alone:

    logits_k = base_k + markov_w2 @ markov_w1[t_{k-1}]          t_0: the anchor; t_{k-1}: what slot k - 1 drew

``markov_w1`` embeds a target id (the verifier's vocabulary, V x r), ``markov_w2`` maps the r numbers to
the draft vocabulary (N x r). Drafting walks the slots left to right, one r-wide embedding and one
N x r product a slot; after the first slot the previous token is a draft-vocabulary token, so the walk can
read the bias from a table of the N possible rows (:func:`bias_table`, N x N) computed once instead. The
names are speculators' / vLLM's (``markov_head.markov_w1.weight``, ``markov_head.markov_w2.weight``), so
the export writes them as they are.

Initialisation: ``markov_w1`` normal, ``markov_w2`` zero, so a fresh head adds nothing and training starts
from the plain DFlash drafter (LoRA's rule: one factor zero, the other not, so the first gradient flows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MARKOV_TABLE_BYTES", "MarkovHead", "WalkWeights", "bias_table"]

#: The largest bias table :meth:`MarkovHead.walk_weights` keeps (float32 N x N: 64 MiB for a 4,096-token
#: draft vocabulary; a 32k one computes each bias instead).
MARKOV_TABLE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class WalkWeights:
    """What drafting's walk reads, in float32: the two factors, (V, r) and (N, r), and the bias after each
    draft token (N, N; :func:`bias_table`), None where it would exceed ``MARKOV_TABLE_BYTES``."""

    w1: torch.Tensor
    w2: torch.Tensor
    table: torch.Tensor | None


class MarkovHead(nn.Module):
    """The bias ``markov_w2(markov_w1(previous))`` (see the module docstring)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"markov rank must be >= 1, got {rank}")
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=1.0)
        nn.init.zeros_(self.markov_w2.weight)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        """previous: (...) target ids -> (..., N) biases over the draft vocabulary."""
        return self.markov_w2(self.markov_w1(previous))

    def walk_weights(self, draft_ids: torch.Tensor) -> WalkWeights:
        """The float32 factors and the bias table for drafting over ``draft_ids`` (N,), computed once and
        shared by every decoder of this drafter (an evaluation builds several) while the weights' storage,
        version counters (bumped by every in-place update), device and the ids are unchanged."""
        w1, w2 = self.markov_w1.weight, self.markov_w2.weight
        key = (
            w1.data_ptr(), w1._version, w2.data_ptr(), w2._version, w1.device,
            tuple(draft_ids.tolist()), MARKOV_TABLE_BYTES,
        )  # fmt: skip
        cached: tuple[Any, WalkWeights] | None = getattr(self, "_walk", None)
        if cached is None or cached[0] != key:
            f1, f2 = w1.detach().float(), w2.detach().float()
            n = draft_ids.numel()
            table = bias_table(f1, f2, draft_ids) if 4 * n * n <= MARKOV_TABLE_BYTES else None
            cached = (key, WalkWeights(f1, f2, table))
            self._walk = cached
        return cached[1]


def bias_table(w1: torch.Tensor, w2: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """The bias after every draft-vocabulary token, (N, N): row j is ``w2 @ w1[draft_ids[j]]``, the bias
    the walk adds to a slot whose predecessor is draft token j. ``w1`` (V, r), ``w2`` (N, r)."""
    return w1.index_select(0, draft_ids) @ w2.T
