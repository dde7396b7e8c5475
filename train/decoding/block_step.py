"""One block step, shared by both schedules: score a draft, commit a verdict, keep the cache in step.

Both loops (the synchronous one, :mod:`train.decoding.loop`, and the asynchronous one,
:mod:`train.decoding.async_loop`) run every block through these parts and keep only their own
scheduling:

- :class:`VerifierCache` holds the verifier's cache over the committed sequence, scores the uncached
  committed tokens plus a draft in one forward (a chain causally, a tree with its tree mask), records the
  call's cost, and afterwards keeps the committed prefix plus the accepted path (cropped or compacted);
- the rule (:class:`~train.decoding.rules.verdict.VerificationRule`, with its own settings) turns the
  logits into a :class:`~train.decoding.rules.verdict.Verdict`;
- :func:`settle_block` records the block's statistics and returns the tokens it commits: the accepted
  path and the verifier's own token, cut after the first EOS (so an accepted EOS gets no bonus token:
  this is the one place that says so) and to the tokens still allowed.

Cache invariant (batch size 1): the verifier cache holds every committed token except the last one, so
a block costs exactly one verifier call and nothing is re-encoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from train.decoding.cache import crop_cache, keep_positions
from train.decoding.draft import Draft
from train.decoding.metrics import DecodeStats
from train.decoding.model_call import CallResult, TimedModel
from train.decoding.rules.verdict import Verdict
from train.decoding.tree_attention import tree_attention_mask, tree_position_ids

__all__ = ["Settled", "VerifierCache", "committed_tokens", "record_verdict", "settle_block"]


class VerifierCache:
    """The verifier's cache over the committed sequence (all of it but the last token) and the one
    forward per block that extends it. ``stats``: where each call's cost is recorded."""

    def __init__(self, verifier: TimedModel, stats: DecodeStats) -> None:
        self.verifier = verifier
        self.stats = stats
        self.cache: Any = None
        #: Positions the cache holds.
        self.length = 0
        #: How many committed tokens the last :meth:`score` fed before the draft.
        self.context_length = 0

    @property
    def prefilled(self) -> bool:
        """Whether the prompt has been fed (the next call is a decoding call, not the prefill)."""
        return self.cache is not None

    def score(
        self, seq: Sequence[int], draft: Draft, hidden_layers: Sequence[int] | None = None
    ) -> CallResult:
        """One forward over the committed tokens not yet cached and ``draft``; logits for the last
        committed position and every draft node ((k + 1, V)). A tree is fed with its tree mask and depths
        as positions. ``hidden_layers``: the verifier layers whose states come back (``out.hidden``)."""
        context = list(seq[self.length :])
        feed = context + draft.tokens
        k = len(draft)
        if k > 1 and not draft.is_chain:
            out = self.verifier(
                feed,
                self.cache,
                position_ids=tree_position_ids(self.length, len(context), draft.depths()),
                attention_mask=tree_attention_mask(
                    self.length, len(context), draft.parents, self.verifier.mask_dtype
                ),
                logits_to_keep=k + 1,
                hidden_layers=hidden_layers,
            )
        else:
            out = self.verifier(feed, self.cache, logits_to_keep=k + 1, hidden_layers=hidden_layers)
        stats = self.stats
        if self.cache is None:
            stats.verifier_prefill_calls += 1
            stats.verifier_prefill_time += out.seconds
        stats.verifier_calls += 1
        stats.verifier_time += out.seconds
        stats.verifier_tokens += k + 1
        self.cache = out.cache
        self.length += len(feed)
        self.context_length = len(context)
        return out

    def keep(self, committed: int, draft: Draft, path: Sequence[int]) -> None:
        """After a block whose verdict accepted ``path`` on a sequence of ``committed`` tokens: keep the
        committed prefix plus the accepted nodes (the last emitted token stays uncached). A chain's
        cache is cropped; a tree's accepted nodes are compacted behind the prefix."""
        if len(draft) > 1 and not draft.is_chain:
            self.length = keep_positions(
                self.cache, [*range(committed), *(committed + i for i in path)], self.length
            )
            return
        keep = committed + len(path)
        if self.length > keep:
            crop_cache(self.cache, keep, self.length)
            self.length = keep


@dataclass(frozen=True)
class Settled:
    """What a block commits: ``tokens`` (the accepted drafts, then the verifier's token unless cut) and
    whether generation is ``done`` (an EOS was committed or no token is left)."""

    tokens: list[int]
    done: bool


def committed_tokens(draft: Draft, verdict: Verdict, eos: frozenset[int], room: int) -> Settled:
    """The tokens a verdict commits when ``room`` more are allowed: the accepted path, then the verifier's
    own token, cut after the first EOS (an accepted EOS gets no bonus token) and to ``room``."""
    tokens = [draft.tokens[i] for i in verdict.path]
    if verdict.next is not None:
        tokens.append(verdict.next)
    for j, token in enumerate(tokens):
        if token in eos:
            return Settled(tokens[: min(j + 1, room)], True)
    if len(tokens) >= room:
        return Settled(tokens[:room], True)
    return Settled(tokens, False)


def record_verdict(stats: DecodeStats, draft: Draft, verdict: Verdict) -> None:
    """Add one block's counts to ``stats``: a tree counts its depth as drafted positions and its nodes off
    the accepted path as discarded; a chain, its untested tail."""
    k = len(draft)
    if not k:
        return
    chain = draft.is_chain
    drafted = k if chain else max(draft.depths())
    n = verdict.accepted
    stats.drafted += drafted
    stats.accepted += n
    stats.tested += verdict.tested
    stats.sum_expected_acceptance += verdict.expected
    stats.count_depths(drafted, verdict.tested, n)
    stats.discarded += k - verdict.tested if chain else k - n
    if n < drafted:
        stats.rollbacks += 1


def settle_block(
    stats: DecodeStats, draft: Draft, verdict: Verdict, eos: frozenset[int], room: int
) -> Settled:
    """Record the block (:func:`record_verdict`) and return what it commits (:func:`committed_tokens`)."""
    record_verdict(stats, draft, verdict)
    return committed_tokens(draft, verdict, eos, room)
