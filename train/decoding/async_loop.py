"""The asynchronous schedule (AMUSD; McDanel, arXiv 2410.17375; docs/async.md).

The drafter runs in its own thread and never waits for verification: it keeps drafting one token at
a time ahead of the verified sequence (up to ``max_ahead`` tokens) and publishes each with the q it
was drawn from. The verifier, in the calling thread, takes every published draft beyond the verified
prefix (up to ``gamma``), verifies the chain in one forward with the same rule as the synchronous
loop and commits the accepted drafts plus its own token through the same block step
(:mod:`train.decoding.block_step`); this module keeps only what is asynchronous.

Only tokens cross between the two sides, under one ``threading.Condition`` (no spinning):

- drafts still consistent with the new verified sequence stay published (an all-accepted block whose
  bonus token equals the next draft keeps the rest); otherwise the published drafts are dropped and the
  *epoch* advances (a rollback). A draft computed on a stale sequence is refused at publication (its
  epoch or its position no longer matches), and the drafter crops its cache to the first token where
  what it has cached and the verified sequence differ (:meth:`ModelProposer.commit`), then continues;
- with no draft ready, the verifier takes a plain autoregressive step (``idle="step"``) or waits for
  the drafter (``idle="wait"``).

Lossless at every temperature: each published draft was drawn from q given exactly the verified
prefix it extends plus the earlier drafts it follows, so each verification is ordinary chain rejection
sampling; how many drafts a block holds depends on timing, never on the random draws. Greedy output is
the verifier's greedy output.

PyTorch releases the GIL inside its kernels, so two Python threads run the two models at once (on a
CPU each gets half of the intra-op threads set, one each of two; ``pin_cores`` puts each thread on its
own core). The statistics record
each side's busy time and the time both were busy (``overlap_time``), the point of the method.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import torch

from train.decoding.async_policy import IDLE_POLICIES, AsyncSchedule, CostLine, acceptance_estimate, best_wait
from train.decoding.block_step import VerifierCache, settle_block
from train.decoding.draft import Draft
from train.decoding.metrics import DecodeResult, DecodeStats
from train.decoding.model_call import TimedModel
from train.decoding.proposers.model_proposer import ModelProposer
from train.decoding.rules.rejection import LOSSLESS
from train.decoding.sampling import SamplingParams
from train.decoding.side_thread import beside

__all__ = ["IDLE_POLICIES", "AsyncSchedule", "auto_block", "interval_overlap", "run_asynchronous"]


#: The longest a thread waits on the condition before re-checking (seconds); a bound, not a poll rate.
_WAIT = 0.5


def interval_overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two lists of disjoint, time-ordered intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


class _Shared:
    """The state both threads see, guarded by ``cond``."""

    def __init__(self, prompt: list[int]) -> None:
        self.cond = threading.Condition()
        self.verified = list(prompt)
        self.drafts: list[int] = []
        self.qs: list[torch.Tensor | None] = []
        self.epoch = 0
        self.stop = False
        self.error: BaseException | None = None


def auto_block(
    stats: DecodeStats,
    drafter_stats: DecodeStats,
    calls: CostLine,
    ready: int,
    gamma: int,
    wait: bool,
) -> int:
    """``min_ahead="auto"``: how many drafts this verification takes
    (:func:`~train.decoding.async_policy.best_wait`), from this generation's acceptance, the drafter's
    measured step and the verifier's cost line over its ``calls`` (prefill excluded).
    ``wait``: 1 or more, waiting for drafts not yet published; else at most ``ready``, 0 to step alone.
    Before both models have taken a step: 1 (``wait``) or every ready draft."""
    line = calls.line()
    steps = drafter_stats.drafter_calls - drafter_stats.drafter_prefill_calls
    if line is None or steps <= 0:
        return 1 if wait else min(ready, gamma)
    draft = (drafter_stats.drafter_time - drafter_stats.drafter_prefill_time) / steps
    acceptance = acceptance_estimate(stats.accepted, stats.tested)
    return best_wait(acceptance, draft, line[0], ready, gamma, verify_per_token=line[1], wait=wait)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# more than 8 parameters: the drafter thread's state, bound once with functools.partial
def _draft(
    shared: _Shared,
    proposer: ModelProposer,
    params: SamplingParams,
    generator: torch.Generator | None,
    eos: frozenset[int],
    stats: DecodeStats,
    busy: list[tuple[float, float]],
    max_ahead: int,
    limit: int,
) -> None:
    """Draft, publish, resynchronise after rollbacks, until ``shared.stop``."""
    # ``local``: the sequence the drafter works on (and its cache was built from), updated in place:
    # only the tokens past ``stable`` (the verified length at the last look; verified tokens never
    # change) are copied from the shared state, so no step copies the whole sequence.
    local: list[int] = []
    stable = 0
    while True:
        with shared.cond:
            while not shared.stop and (
                len(shared.drafts) >= max_ahead
                or (shared.drafts and shared.drafts[-1] in eos)
                or len(shared.verified) + len(shared.drafts) >= limit
            ):
                shared.cond.wait(_WAIT)
            if shared.stop:
                return
            tail = shared.verified[stable:] + shared.drafts
            epoch = shared.epoch
            verified_length = len(shared.verified)
        # crop the cache to the first divergence between what it holds and the shared sequence
        proposer.commit(stable + _common_prefix(local[stable:], tail))
        del local[stable:]
        local.extend(tail)
        stable = verified_length
        before = stats.drafter_time
        draft = proposer.propose(local, 1, params, generator, eos, stats)
        end = time.perf_counter()
        busy.append((end - (stats.drafter_time - before), end))  # the forward's own seconds
        with shared.cond:
            fresh = shared.epoch == epoch and len(shared.verified) + len(shared.drafts) == len(local)
            if fresh and len(draft):
                shared.drafts.append(draft.tokens[0])
                q = draft.dense_q(proposer.vocab_size)  # the block's rows are stacked: all over V
                shared.qs.append(None if q is None else q[0])
                shared.cond.notify_all()
            elif len(draft):
                stats.discarded += 1  # computed on a sequence that changed meanwhile


def _republish(shared: _Shared, k: int, accepted: int, extra: list[int], done: bool) -> int:
    """After a block of ``k`` drafts, ``accepted`` of them, then the verifier's ``extra`` token (if kept):
    the published drafts past the block that still extend the verified sequence stay (an all-accepted
    block whose verifier token equals the next draft keeps the rest); the others are dropped and the
    epoch advances. Returns how many published drafts were dropped. Call under ``shared.cond``."""
    rest, rest_q = shared.drafts[k:], shared.qs[k:]
    shared.drafts, shared.qs = [], []
    if done:
        shared.stop = True
    if accepted == k and not done and extra and rest and rest[0] == extra[0]:
        shared.drafts, shared.qs = rest[1:], rest_q[1:]  # the drafter had guessed it: keep the rest
        return 0
    if accepted < k or done or rest:
        shared.epoch += 1
    return len(rest)


def _stop(shared: _Shared, error: BaseException | None = None) -> None:
    """Stop both sides (with the drafter's ``error``, which the verifier's thread raises)."""
    with shared.cond:
        if error is not None:
            shared.error = error
        shared.stop = True
        shared.cond.notify_all()


def _take_block(
    shared: _Shared, schedule: AsyncSchedule, auto: Callable[..., int], eos: frozenset[int], limit: int
) -> Draft:
    """The drafts the next verification takes (waiting for them under ``idle="wait"``), as a chain with
    the q rows they were drawn from. Raises the drafter thread's error, if any."""
    min_ahead = schedule.min_ahead
    seq = shared.verified
    with shared.cond:
        target = min_ahead if isinstance(min_ahead, int) else auto(ready=len(shared.drafts))
        while not shared.stop and schedule.waits and len(shared.drafts) < target:
            if shared.drafts and shared.drafts[-1] in eos:
                break  # the drafter stops after an EOS
            if len(seq) + len(shared.drafts) >= limit - 1:
                break  # nor does it draft past the limit
            shared.cond.wait(_WAIT)
        if shared.error is not None:
            raise shared.error
        k = min(len(shared.drafts), schedule.gamma, limit - len(seq) - 1)
        if not isinstance(min_ahead, int):
            k = min(k, auto(ready=len(shared.drafts)))
        elif k and len(shared.drafts) < target and not schedule.waits:
            k = 0
        block, qs = shared.drafts[:k], shared.qs[:k]
    if schedule.on_block is not None:
        schedule.on_block(k)
    return Draft.chain(block, None if k == 0 or qs[0] is None else torch.stack(qs))  # type: ignore[arg-type]


def run_asynchronous(
    verifier: TimedModel,
    proposer: ModelProposer,
    prompt: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    eos: frozenset[int],
    generator: torch.Generator | None,
    schedule: AsyncSchedule | None = None,
) -> DecodeResult:
    """Decode up to ``max_new_tokens`` after ``prompt`` with the drafter in a second thread (module
    docstring; ``schedule``: :class:`AsyncSchedule`). ``generator`` drives the verifier's draws; the
    drafter's generator is seeded from it."""
    schedule = schedule or AsyncSchedule()
    t_start = time.perf_counter()
    stats = DecodeStats(max_draft=schedule.gamma)
    drafter_stats = DecodeStats()
    limit = len(prompt) + max_new_tokens
    if max_new_tokens == 0:
        return DecodeResult(torch.zeros(0, dtype=torch.long), stats)
    shared = _Shared(prompt)
    drafter_generator = None
    if generator is not None and not params.greedy:
        seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
        drafter_generator = torch.Generator(device=generator.device).manual_seed(seed)
    drafter_busy: list[tuple[float, float]] = []
    verifier_busy: list[tuple[float, float]] = []
    proposer.start()
    drafting = functools.partial(
        _draft,
        shared,
        proposer,
        params,
        drafter_generator,
        eos,
        drafter_stats,
        drafter_busy,
        schedule.max_ahead,
        limit,
    )
    seq = shared.verified  # only this thread appends to it, under the lock
    scored = VerifierCache(verifier, stats)
    calls = CostLine()  # the verifier's decoding calls: tokens scored, seconds
    cap = min(schedule.gamma, schedule.max_ahead)
    auto = functools.partial(auto_block, stats, drafter_stats, calls, gamma=cap, wait=schedule.waits)
    stop = functools.partial(_stop, shared)
    with beside(drafting, stop, stop, (verifier.device, proposer.drafter.device), schedule.pin_cores):
        done = False
        while not done:
            draft = _take_block(shared, schedule, auto, eos, limit)
            n_seq, k = len(seq), len(draft)
            prefill = not scored.prefilled
            out = scored.score(seq, draft)
            end = time.perf_counter()
            verifier_busy.append((end - out.seconds, end))
            if not prefill:
                calls.add(scored.context_length + k, out.seconds)
            verdict = LOSSLESS.verify(out.logits, draft, params, generator, eos)
            settled = settle_block(stats, draft, verdict, eos, limit - n_seq)
            done = settled.done
            with shared.cond:
                seq.extend(settled.tokens)
                stats.discarded += _republish(
                    shared, k, verdict.accepted, settled.tokens[verdict.accepted :], done
                )
                shared.cond.notify_all()
            if not done:
                scored.keep(n_seq, draft, verdict.path)
    if shared.error is not None:
        raise shared.error
    stats.drafter_calls = drafter_stats.drafter_calls
    stats.drafter_time = drafter_stats.drafter_time
    stats.drafter_prefill_calls = drafter_stats.drafter_prefill_calls
    stats.drafter_prefill_time = drafter_stats.drafter_prefill_time
    stats.discarded += drafter_stats.discarded
    stats.overlap_time = interval_overlap(verifier_busy, drafter_busy)
    stats.new_tokens = len(seq) - len(prompt)
    stats.wall_time = time.perf_counter() - t_start
    return DecodeResult(torch.tensor(seq[len(prompt) :], dtype=torch.long), stats)
