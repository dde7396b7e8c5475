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

import torch
from torch import nn

__all__ = ["MarkovHead", "bias_table"]


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


def bias_table(w1: torch.Tensor, w2: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """The bias after every draft-vocabulary token, (N, N): row j is ``w2 @ w1[draft_ids[j]]``, the bias
    the walk adds to a slot whose predecessor is draft token j. ``w1`` (V, r), ``w2`` (N, r)."""
    return w1.index_select(0, draft_ids) @ w2.T
