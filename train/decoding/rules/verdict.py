"""What a verification rule decides for one block, whatever the rule, and what every rule offers the loops.

Every rule (the chain rule, the tree walk, Medusa's typical acceptance) returns one :class:`Verdict`; the
block step (:mod:`train.decoding.block_step`) commits it, handles EOS and the token budget and records the
block's statistics in one place for both schedules. A rule object (:class:`VerificationRule`) carries its
own settings (lenience, typical thresholds), so the loops pass one object and never a rule's knobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from train.decoding.draft import Draft
from train.decoding.sampling import SamplingParams

__all__ = ["Verdict", "VerificationRule"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """One block's outcome. ``path``: the accepted draft nodes, top down (a chain's are 0 .. n - 1);
    ``next``: the verifier's own token after them (a correction or a bonus; None where the tree walk
    stopped at an accepted EOS and drew nothing); ``tested``: the draft depths the rule examined;
    ``expected``: the sum of their acceptance probabilities (for the report)."""

    path: list[int]
    next: int | None
    tested: int
    expected: float

    @property
    def accepted(self) -> int:
        """How many drafted tokens were accepted."""
        return len(self.path)


class VerificationRule(Protocol):
    """A verification rule with its settings: ``verify`` turns the verifier's logits over a draft (row 0
    after the context, row i + 1 after node i) into a :class:`Verdict`, drawing its uniforms from
    ``generator`` only; ``lossless`` says whether the output follows the verifier's distribution."""

    @property
    def lossless(self) -> bool: ...

    def verify(
        self,
        logits: torch.Tensor,
        draft: Draft,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
    ) -> Verdict: ...
