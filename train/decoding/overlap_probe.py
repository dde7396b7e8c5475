"""The pair's step costs while both models compute at once (:func:`together_costs`), for the
asynchronous decoder's choice whether to overlap at all (:func:`~train.decoding.async_policy.overlap_pays`).

The drafter steps without pause in a second thread, set up exactly as the asynchronous schedule sets
it up (:func:`~train.decoding.async_loop.beside`: on a CPU half the intra-op threads each, pinned with
``pin_cores``; on a GPU a stream of its own), while this thread times the verifier's forwards over
1 .. K tokens after a cached prefix as :func:`~train.decoding.cost_probe.time_forwards` does alone;
the drafter's step is the median of its steps meanwhile. Where the two share cores or a device, both
cost more than alone; on two devices, about the same. Cached like the costs alone
(:func:`~train.decoding.cost_probe.remembered`), under their key and the core pinning.
"""

from __future__ import annotations

import functools
import hashlib
import statistics
import threading
import time

import torch

from train.decoding.cache import crop_cache
from train.decoding.cost_probe import (
    MEASURED_TOKENS,
    PREFIX_TOKENS,
    cost_key,
    random_tokens,
    remembered,
    time_forwards,
)
from train.decoding.costs import StepCosts
from train.decoding.model_call import TimedModel
from train.decoding.side_thread import beside

__all__ = ["measure_together", "together_costs"]


def _draft_steps(
    drafter: TimedModel, stop: threading.Event, started: threading.Event, times: list[float]
) -> None:
    """Drafter steps after a cached prefix, one token each with its distribution drawn as a drafter step
    draws it, until ``stop``; each step's seconds appended to ``times``."""
    support = drafter.support is not None
    cache = drafter(random_tokens(drafter, PREFIX_TOKENS), None, support_only=support).cache
    token = random_tokens(drafter, 2)[1:]
    started.set()
    while not stop.is_set():
        start = time.perf_counter()
        out = drafter(token, cache, logits_to_keep=1, support_only=support)
        float(torch.softmax(out.logits[-1].float(), dim=-1).max())
        times.append(time.perf_counter() - start)
        cache = out.cache
        crop_cache(cache, PREFIX_TOKENS)


def measure_together(
    verifier: TimedModel,
    drafter: TimedModel,
    max_tokens: int,
    pin_cores: tuple[int, int] | None = None,
    repeats: int = 3,
) -> StepCosts:
    """Measure (no cache): the verifier's forwards over 1 .. ``max_tokens`` tokens while the drafter steps
    in a second thread, and the drafter's step meanwhile (module docstring)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    stop, started = threading.Event(), threading.Event()
    times: list[float] = []
    errors: list[BaseException] = []
    work = functools.partial(_draft_steps, drafter, stop, started, times)
    devices = (verifier.device, drafter.device)
    with torch.inference_mode(), beside(work, stop.set, errors.append, devices, pin_cores):
        while not started.wait(0.05):
            if errors:
                break
        steps_before = len(times)
        (medians,) = time_forwards(verifier, list(range(1, max_tokens + 1)), repeats)
        during = times[steps_before:]
    if errors:
        raise errors[0]
    if not during:
        raise RuntimeError("the drafter took no step while the verifier was timed: no overlap to measure")
    verify = [max(medians[: n + 1]) for n in range(len(medians))]  # as measure_step_costs: no dips
    return StepCosts(verify=tuple(verify), draft=statistics.median(during))


def together_costs(
    verifier: TimedModel, drafter: TimedModel, max_tokens: int, pin_cores: tuple[int, int] | None = None
) -> StepCosts:
    """:func:`measure_together` for checks of 1 .. ``max_tokens`` tokens (at least
    :data:`~train.decoding.cost_probe.MEASURED_TOKENS`), measured once per machine, setting, pair and
    pinning (module docstring)."""
    max_tokens = max(max_tokens, MEASURED_TOKENS)
    alone = cost_key(verifier.model, drafter.model, max_tokens)
    key = hashlib.sha256(f"{alone}:together:{pin_cores}".encode()).hexdigest()[:20]
    costs, _ = remembered(key, lambda: (measure_together(verifier, drafter, max_tokens, pin_cores), None))
    return costs
