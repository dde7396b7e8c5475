"""The drafter's side in a second thread (:func:`beside`), as the asynchronous schedule
(:mod:`train.decoding.async_loop`) and the probe of its costs (:mod:`train.decoding.overlap_probe`) run it.

PyTorch releases the GIL inside its kernels, so two Python threads run two models at once. On a CPU the
two sides share the intra-op threads set (half each, one each of two cores; ``pin_cores`` pins each
thread to its own core); on a GPU the second side works on a CUDA stream of its own.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["beside", "drafter_stream"]


def drafter_stream(device: torch.device) -> Any:
    """The context the drafter thread drafts in: on a GPU a CUDA stream of its own, so its kernels are not
    queued behind the verifier's on the default stream (and its clock, which waits for its own stream,
    does not count the verifier's work as its own); elsewhere nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device=device))


def _on_the_side(
    work: Callable[[], None],
    fail: Callable[[BaseException], None],
    pin: int | None,
    threads: int | None,
    device: torch.device,
) -> None:
    """The second thread: ``work`` on core ``pin`` with ``threads`` intra-op threads (None: as set), on a
    stream of its own on a GPU (:func:`drafter_stream`); an error goes to ``fail``."""
    try:
        if pin is not None:
            os.sched_setaffinity(0, {pin})
        if threads is not None:
            torch.set_num_threads(threads)
        with (
            torch.inference_mode(),
            drafter_stream(device),
        ):  # grad mode and the current stream are per thread
            work()
    except BaseException as err:  # noqa: BLE001 -- handed to the calling thread, which raises it
        fail(err)


@contextlib.contextmanager
def beside(
    work: Callable[[], None],
    stop: Callable[[], None],
    fail: Callable[[BaseException], None],
    devices: tuple[torch.device, torch.device],
    pin_cores: tuple[int, int] | None,
) -> Iterator[None]:
    """``work`` (the drafter's side) running in a second thread while the block runs in this one
    (``devices``: this side's, the second's): on a CPU the two share the intra-op threads set (half
    each, one each of two cores; each pinned to its core with ``pin_cores``); an error in ``work`` goes
    to ``fail``; on leaving, ``stop()``, the thread is joined and this thread's settings restored."""
    threads_before = torch.get_num_threads()
    split = None
    if devices[0].type == "cpu" and devices[1].type == "cpu":
        split = 1 if pin_cores is not None else max(1, threads_before // 2)
    pin = None if pin_cores is None else pin_cores[1]
    thread = threading.Thread(
        target=_on_the_side, args=(work, fail, pin, split, devices[1]), name="draftsmith-drafter", daemon=True
    )
    previous_affinity: Any = None
    if pin_cores is not None:
        previous_affinity = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {pin_cores[0]})
    if split is not None:
        torch.set_num_threads(split)
    thread.start()
    try:
        yield
    finally:
        stop()
        thread.join()
        if previous_affinity is not None:
            os.sched_setaffinity(0, previous_affinity)
        torch.set_num_threads(threads_before)
