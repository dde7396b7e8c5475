"""Drafts copied from the context: prompt lookup (:class:`PromptLookupProposer`).

Answers repeat their context: code quotes the signature and docstring it was asked about, an
explanation repeats the names it explains, a list repeats its own item pattern. Prompt lookup
decoding (Saxena 2023; Hugging Face's ``prompt_lookup_num_tokens``; vLLM's n-gram speculator) drafts
by finding the committed sequence's last n tokens earlier in the sequence (prompt and answer alike)
and proposing the tokens that followed that occurrence. It costs no model call, so a copied draft can
be long; where the sequence has no such n-gram it proposes nothing, and a
:class:`~train.decoding.proposers.fallback_proposer.FallbackProposer` lets a drafter model draft instead
(the hybrid that SAM-Decoding, Hu et al. 2024, builds with a suffix automaton).

The draft is a deterministic function of the committed sequence, so every verification rule keeps
the verifier's output law: the rule treats it as a point mass (``Draft.q is None``): at T = 0 it is
accepted while it equals the verifier's argmax, at T > 0 a token x is accepted with probability p(x),
and a rejection draws from p with x removed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from train.decoding.draft import Draft
from train.decoding.draft_gate import DraftGate
from train.decoding.length_policy import CostAwareLength, regime
from train.decoding.metrics import DecodeStats
from train.decoding.proposers.fallback_proposer import FallbackProposer
from train.decoding.proposers.protocol import Proposer
from train.decoding.sampling import SamplingParams

__all__ = ["PromptLookupProposer", "lookup_continuation", "lookup_first", "prompt_lookup"]


def lookup_continuation(
    sequence: Sequence[int], max_ngram: int, min_ngram: int, num_tokens: int
) -> list[int]:
    """The up to ``num_tokens`` tokens that followed the latest earlier occurrence of ``sequence``'s
    last n tokens, for the largest n in ``max_ngram .. min_ngram`` that occurs; [] when none does.

    An occurrence counts when at least one token follows it inside ``sequence`` (the tail itself is
    not an occurrence); its continuation may run into the tail (a repeating pattern continues itself).
    """
    length = len(sequence)
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        tail = list(sequence[length - n :])
        first = tail[0]
        for start in range(length - n - 1, -1, -1):  # latest first
            if sequence[start] == first and list(sequence[start : start + n]) == tail:
                return list(sequence[start + n : start + n + num_tokens])
    return []


class PromptLookupProposer:
    """A chain copied from the committed sequence (see the module docstring); no model, no cache."""

    hidden_layers: tuple[int, ...] | None = None

    def __init__(self, num_tokens: int = 8, max_ngram: int = 3, min_ngram: int = 2) -> None:
        for name, value in (("num_tokens", num_tokens), ("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"prompt lookup: {name} must be an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(
                f"prompt lookup: min_ngram ({min_ngram}) must not exceed max_ngram ({max_ngram})"
            )
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        #: A cost-aware draft length (set by the decoder): copies are cut to the prefix with the most
        #: expected tokens per second, by the acceptance copies have had at each position.
        self.length: CostAwareLength | None = None
        self._pending: tuple[object, int, int] | None = None

    def start(self) -> None:
        """Nothing to forget but a verdict still awaited: the draft is a function of the sequence alone."""
        self._pending = None

    def propose(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        tokens = lookup_continuation(sequence, self.max_ngram, self.min_ngram, min(budget, self.num_tokens))
        for i, x in enumerate(tokens):
            if x in eos:  # nothing is drafted past an end of sequence
                tokens = tokens[: i + 1]
                break
        if tokens and self.length is not None:
            key = regime(params)
            tokens = tokens[: self.length.choose_copied(key, len(tokens))]
            self._pending = (key, len(sequence), len(tokens)) if tokens else None
        if tokens:
            stats.lookup_blocks += 1
        return Draft.chain(tokens)

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        """Nothing cached; with a cost-aware length, what was accepted of the copy is recorded."""
        if self._pending is not None and self.length is not None:
            key, first, copied = self._pending
            self.length.record_copied(key, copied, min(copied, max(0, length - first)))
            self._pending = None

    def observe(self, states: torch.Tensor) -> None:
        """Never called: ``hidden_layers`` is None."""


def lookup_first(
    proposer: Proposer, budget: int, lookup: PromptLookupProposer | None, gate: DraftGate | None = None
) -> tuple[Proposer, int]:
    """``proposer`` behind prompt lookup (its drafts capped at ``budget`` tokens), or itself when
    ``lookup`` is None; with the most tokens a block may then draft (the loop's ``max_draft``).
    ``gate`` (a gated decoder's, its costs measured): its costs are what the copies are cut by where their
    cost-aware length has none yet."""
    if lookup is None:
        return proposer, budget
    if lookup.length is not None and lookup.length.costs is None and gate is not None:
        lookup.length.costs = gate.costs
    return FallbackProposer(lookup, proposer, budget), max(budget, lookup.num_tokens)


def prompt_lookup(
    num_tokens: int,
    max_ngram: int,
    min_ngram: int,
    length: CostAwareLength | None = None,
    gated: bool = False,
) -> PromptLookupProposer | None:
    """A decoder's ``lookup_tokens`` (0: off), checked, as a proposer (None when off), its copies cut by
    ``length`` (the decoder's cost-chosen draft length), or where the decoder is ``gated`` (behind a
    plain-step gate, :mod:`train.decoding.draft_gate`) and has no such length, by a cost-aware length of
    their own, under the gate's costs (:func:`lookup_first`). A gate weighs the drafter's blocks only:
    uncut, six copies checked where checking seven tokens costs 1.9 steps lose time wherever copies are
    accepted less than they were in the text they came from (float32 on a CPU at T = 1, docs/dflash.md)."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"lookup_tokens must be an integer >= 0 (0 = off), got {num_tokens!r}")
    if not num_tokens:
        return None
    lookup = PromptLookupProposer(num_tokens, max_ngram, min_ngram)
    if length is None and gated:
        length = CostAwareLength()  # its costs: the gate's (lookup_first)
    lookup.length = length
    return lookup
