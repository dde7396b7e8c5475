"""Speculative rejection sampling as one rule object: a chain by the chain rule, a tree by the tree walk.

:class:`RejectionRule` is what the loops verify with unless a decoder chooses Medusa's typical acceptance
(:class:`~train.decoding.rules.typical.TypicalAcceptance`). Its settings are the DistillSpec lenience
f(p, eps) of the chain rule (``eps = 1``: lossless, the default :data:`LOSSLESS`); a tree is always walked
losslessly (:func:`~train.decoding.rules.tree_walk.verify_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.decoding.draft import Draft
from train.decoding.rules.chain import verify_chain
from train.decoding.rules.tree_walk import verify_tree
from train.decoding.rules.verdict import Verdict
from train.decoding.sampling import LENIENCES, SamplingParams

__all__ = ["LOSSLESS", "RejectionRule"]


@dataclass(frozen=True)
class RejectionRule:
    """Rejection sampling with the chain rule's ``lenience`` (``"linear"``, ``"squared"``,
    ``"exponential"`` or None) at ``eps`` in (0, 1]; ``eps = 1`` (or no lenience) is lossless. Lenience
    applies when sampling only: greedy verification always keeps the verifier's argmax."""

    lenience: str | None = None
    eps: float = 1.0

    def __post_init__(self) -> None:
        if self.lenience is not None and self.lenience not in LENIENCES:
            raise ValueError(f"lenience must be one of {sorted(LENIENCES)} or None, got {self.lenience!r}")
        if not 0.0 < self.eps <= 1.0:
            raise ValueError(f"eps must be in the range (0, 1] (1 = lossless), got {self.eps!r}")
        if self.eps == 1.0:  # f(p, 1) = p whatever f is: one lossless rule, one name
            object.__setattr__(self, "lenience", None)

    @property
    def lossless(self) -> bool:
        return self.lenience is None

    def verify(
        self,
        logits: torch.Tensor,
        draft: Draft,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
    ) -> Verdict:
        if len(draft) > 1 and not draft.is_chain:
            return verify_tree(logits, draft, params, generator, eos)
        return verify_chain(logits, draft, params, generator, self.lenience, self.eps)


#: The lossless rule, the loops' default.
LOSSLESS = RejectionRule()
