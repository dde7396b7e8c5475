"""A chain drafted by a small causal LM (:class:`ModelProposer`).

A proposer (:class:`~train.decoding.proposers.protocol.Proposer`) is given the committed sequence and a
budget, returns a :class:`~train.decoding.draft.Draft`, and is told afterwards how much of the sequence
is final (:meth:`Proposer.commit`), so it can drop whatever it cached past that point. It records its
own calls and time into the :class:`~train.decoding.metrics.DecodeStats` it is handed. New drafter
kinds (Medusa heads, steered drafters, trees) are new proposers; the schedule and the verification
rules stay as they are.

:class:`ModelProposer` drafts a chain with a small causal LM over the verifier's vocabulary:

- its proposals are distributions over the *verifier's* vocabulary: when the drafter's output is
  smaller, q gets zero mass on the ids it cannot produce (p is never cut, so greedy and sampled output
  stay exactly the verifier's); when larger, its extra logits are dropped;
- a committed token the drafter cannot embed (an id past its input embeddings, in practice a padding
  id of a larger verifier vocabulary) is fed to it as its pad id (else 0): its later drafts may be
  worse, the output is not affected;
- a drafter over a reduced draft vocabulary (train/models/draft_vocab.py) is asked for the logits of its
  draft ids only: its greedy pick and its q are computed over those N ids (the same distribution as
  the full-vocabulary logits give, zero elsewhere, drawn by the same uniform to the same token), a
  sixth of the work over 8,192 of 49,152, and the draft keeps q compact (:class:`Draft`'s ``support``);
- at T > 0 a block's uniforms for its drafts are drawn at once, one per possible draft;
- its cache holds a prefix of the committed tokens plus the drafts it was fed; a block first feeds, in
  one call, every committed token it has not seen (the previous block's correction or bonus token and
  the last accepted draft, which a drafter never consumes);
- with a ``confidence_threshold`` t > 0 the chain stops early, after the first draft whose probability
  under the drafter is below t (:func:`draft_confidence`; the draft itself is kept, as in Hugging Face's
  ``assistant_confidence_threshold``): gamma becomes a cap and the drafter's calls that would mostly
  be rejected are saved. The stop depends only on the drafter's own output for the committed prefix,
  so the output law is unchanged (docs/decoding.md#adaptive-draft-length);
- with a ``length`` policy (:class:`~train.decoding.length_policy.CostAwareLength`) the draft length is
  chosen by expected tokens per second under the measured costs instead: whether to draft at all, then,
  from each position's distribution (its largest probability, before a token is drawn from it), whether
  that position gets a draft; what the verifier then accepted (learnt at :meth:`ModelProposer.commit`)
  calibrates those confidences.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from train.decoding.cache import crop_cache
from train.decoding.draft import Draft
from train.decoding.length_policy import ChainOutcome, CostAwareLength, regime
from train.decoding.metrics import DecodeStats
from train.decoding.model_call import CallResult, TimedModel
from train.decoding.sampling import SamplingParams, draw_index, greedy_ids, uniforms, warp

__all__ = ["ModelProposer", "draft_confidence"]


def draft_confidence(row: torch.Tensor, index: int, is_logits: bool) -> float:
    """The drafter's probability of the token it drafted: ``row[index]`` of a distribution, or of
    ``softmax(row)`` when ``row`` holds logits (greedy drafting, where no distribution is formed)."""
    if is_logits:
        return math.exp(float(row[index].float() - torch.logsumexp(row.float(), dim=-1)))
    return float(row[index])


class ModelProposer:
    """A chain drafted token by token by a causal LM (see the module docstring)."""

    #: A plain drafter reads none of the verifier's hidden states (see the Proposer protocol).
    hidden_layers: tuple[int, ...] | None = None

    def __init__(
        self,
        drafter: TimedModel,
        vocab_size: int,
        confidence_threshold: float = 0.0,
        length: CostAwareLength | None = None,
    ) -> None:
        if not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(
                f"confidence_threshold must be in [0, 1) (0 = off), got {confidence_threshold!r}"
            )
        if length is not None and confidence_threshold:
            raise ValueError("a cost-chosen draft length and a confidence_threshold exclude each other")
        #: The cost-aware draft length (None: ``gamma`` drafts, or the confidence stop).
        self.length = length
        #: The cut a gated fixed chain falls back on (:meth:`propose_cut`; None: none).
        self.fallback_length: CostAwareLength | None = None
        #: The last block's chain awaiting its verdict.
        self._pending: ChainOutcome | None = None
        self.drafter = drafter
        self.vocab_size = vocab_size
        #: Stop the chain after a draft the drafter gives less than this probability (0: never).
        self.confidence_threshold = float(confidence_threshold)
        pad = getattr(getattr(drafter.model, "config", None), "pad_token_id", None)
        self.substitute_id = pad if isinstance(pad, int) and 0 <= pad < drafter.embed_size else 0
        self._shared = min(vocab_size, drafter.vocab_size)
        self._slice = self._shared < drafter.vocab_size  # drop the drafter's extra logits
        self._cache: Any = None
        self._length = 0
        support = drafter.support
        #: The verifier ids of the drafter's draft vocabulary when it drafts over them alone, else None.
        self._support_ids: list[int] | None = (
            support.tolist() if support is not None and int(support.max()) < vocab_size else None
        )
        #: Called as ``(first position, count)`` before every drafter forward, whose tokens sit at
        #: positions first .. first + count - 1 (a steered drafter sets their guides,
        #: train/decoding/proposers/steered_proposer.py).
        self.before_forward: Callable[[int, int], None] | None = None

    def start(self) -> None:
        self._cache, self._length = None, 0
        self._pending = None

    def _embeddable(self, tokens: list[int]) -> list[int]:
        limit = self.drafter.embed_size
        return [t if t < limit else self.substitute_id for t in tokens]

    def _distribution(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """q over the verifier's vocabulary: (V,), zero on ids the drafter cannot produce."""
        q = warp(logits[: self._shared] if self._slice else logits, params)
        if self._shared < self.vocab_size:
            q = torch.nn.functional.pad(q, (0, self.vocab_size - self._shared))
        return q

    def _call(
        self,
        feed: list[int],
        stats: DecodeStats,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int | None = 1,
        support_only: bool = False,
    ) -> CallResult:
        """One drafter forward on top of its cache, recorded in ``stats`` (the first one as prefill);
        ``support_only``: the logits of its draft ids only (:attr:`TimedModel.support`)."""
        prefill = self._cache is None
        if self.before_forward is not None:
            self.before_forward(self._length, len(feed))
        out = self.drafter(
            feed,
            self._cache,
            position_ids=position_ids,
            attention_mask=attention_mask,
            logits_to_keep=logits_to_keep,
            support_only=support_only,
        )
        self._cache = out.cache
        stats.drafter_calls += 1
        stats.drafter_time += out.seconds
        if prefill:
            stats.drafter_prefill_calls += 1
            stats.drafter_prefill_time += out.seconds
        return out

    def propose(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        """The block's chain: ``gamma`` drafts (the loop's budget), the confidence stop, or the length
        ``length`` chooses by cost."""
        return self._chain(sequence, budget, params, generator, eos, stats, self.length)

    def propose_cut(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
    ) -> Draft:
        """The chain :meth:`propose` drafts, its length chosen by ``fallback_length`` (the drafts that pay
        under the measured costs, none where nothing does): what a gated fixed chain falls back on where
        its ``gamma`` drafts have not paid
        (:class:`~train.decoding.proposers.gated_proposer.GatedProposer`)."""
        if self.fallback_length is None:
            raise RuntimeError("propose_cut needs a fallback_length (SpeculativeDecoder(fallback_cut=True))")
        return self._chain(sequence, budget, params, generator, eos, stats, self.fallback_length)

    def _chain(
        self,
        sequence: list[int],
        budget: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos: frozenset[int],
        stats: DecodeStats,
        length: CostAwareLength | None,
    ) -> Draft:
        """The chain, its length chosen by ``length`` (None: the budget, or the confidence stop)."""
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        columns: list[int] = []
        confidences: list[float] = []
        greedy = params.greedy
        ids = self._support_ids
        key = regime(params)
        if length is not None and not length.should_draft(key, budget):
            return Draft()  # a plain verifier step: no drafted token can pay for its check
        u = [] if greedy else uniforms(budget, generator).tolist()
        feed = self._embeddable(sequence[self._length :])
        for step in range(budget):
            out = self._call(feed, stats, support_only=ids is not None)
            self._length += len(feed)
            logits = out.logits[-1]
            if ids is not None:  # logits, and q, over the draft ids
                q = logits if greedy else warp(logits, params)
            elif greedy:
                q = logits[: self._shared] if self._slice else logits
            else:
                q = self._distribution(logits, params)
            if length is not None:  # decided on q alone, before the draw (length_policy.py)
                confidences.append(draft_confidence(q, int(greedy_ids(q)), greedy))
                if not length.include(key, confidences, budget):
                    confidences.pop()
                    break
            if greedy:
                i = int(greedy_ids(q))
            else:
                i = draw_index(q, u[step])
                qs.append(q)
                columns.append(i)
            x = i if ids is None else ids[i]
            tokens.append(x)
            if x in eos:
                break
            if self.confidence_threshold and draft_confidence(q, i, greedy) < self.confidence_threshold:
                break
            if length is not None and not length.extend(key, confidences, budget):
                break  # another drafter step cannot pay (decided on the q's so far, not on x)
            feed = self._embeddable([x])
        if length is not None and tokens:
            self._pending = ChainOutcome(length, key, confidences, len(tokens), len(sequence))
        if not tokens:
            return Draft()
        if not qs:
            return Draft.chain(tokens)
        if ids is None:
            return Draft.chain(tokens, torch.stack(qs))
        # q over the draft ids, kept compact: the chain rule reads it as zero on every other id
        return Draft.chain(tokens, torch.stack(qs), support=self.drafter.support, columns=columns)

    def observe(self, states: torch.Tensor) -> None:
        """Never called: ``hidden_layers`` is None."""

    def commit(self, length: int, path: Sequence[int] | None = None) -> None:
        if self._pending is not None:
            self._pending.record(length)
            self._pending = None
        if self._length > length:
            crop_cache(self._cache, length, self._length)
            self._length = length
