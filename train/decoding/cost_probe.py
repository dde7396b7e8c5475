"""The engine's own costs, measured on the machine at hand (:func:`step_costs`).

One verifier forward over 1 .. K new tokens after a cached prefix, and one drafter step, timed as the
decoders time them (:class:`~train.decoding.model_call.TimedModel`): a warm-up pass, then ``repeats``
passes with the token counts interleaved (so machine load hits them alike), the median of each. About
``repeats * (K + 1) + K`` verifier forwards: 1-3 seconds for a 135M verifier on 2 CPU cores. Where the
verifier's linear layers can stream (float32 on a CPU, ``DRAFTSMITH_CPU_LINEAR=auto``,
:mod:`train.models.streamed_linear`) every count is timed both ways, interleaved, and each row count
takes the faster product from then on (twice the forwards); the costs are the chosen ones.

The result is cached twice: in the process (one measurement per verifier, and a drafter step per pair,
and setting), and on disk in ``$DRAFTSMITH_COST_CACHE`` (default ``~/.cache/draftsmith/step_costs.json``),
keyed by what a cost depends on: the processor, torch's version and CPU capability, the device, the
dtype, torch's thread count, the CPU linear kernel (train/models/streamed_linear.py) and the verifier
(its name, size and shape; the checks, with the row counts that stream) or the pair (the drafter's step).
Every drafter of one verifier is weighed against the same check costs. A run on the same machine and
settings reuses them, so its draft lengths, and its sampled output for a seed, are the same run after
run. ``DRAFTSMITH_COST_CACHE=off`` measures every process afresh. A measurement taken under a Python
profiler or tracer (:func:`instrumented`) serves its own process only: it is not written to the disk cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from train.decoding.cache import crop_cache
from train.decoding.costs import StepCosts
from train.decoding.model_call import TimedModel
from train.models.draft_vocab import draft_support
from train.models.streamed_linear import ALL_ROWS, MAX_ROWS, MIN_ROWS, set_stream_rows, stream_rows
from train.models.streamed_linear import mode as linear_mode

__all__ = [
    "MEASURED_TOKENS",
    "cache_path",
    "chooses_kernel",
    "check_costs",
    "cost_key",
    "drafter_step_seconds",
    "faster_rows",
    "instrumented",
    "measure_step_costs",
    "random_tokens",
    "remembered",
    "step_costs",
    "steered_while_timed",
    "time_forwards",
    "with_drafter_step",
]

log = logging.getLogger(__name__)

#: Tokens in the cached prefix the forwards run after (a short chat prompt).
PREFIX_TOKENS = 128
#: Checks of at least 1 .. this many tokens are measured (chains of up to 8 drafts), so decoders of
#: different caps and the evaluator share one measurement.
MEASURED_TOKENS = 9
_MEMO: dict[str, tuple[StepCosts, frozenset[int] | None]] = {}


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _model_identity(model: torch.nn.Module | None) -> dict[str, Any]:
    if model is None:
        return {}
    config = getattr(model, "config", None)
    shape = {
        k: getattr(config, k, None)
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "intermediate_size",
            "vocab_size",
            "num_attention_heads",
        )
    }
    return {
        "name": str(getattr(config, "_name_or_path", "") or type(model).__name__),
        "params": sum(p.numel() for p in model.parameters()),
        "shape": shape,
        "dtype": str(next(model.parameters(), torch.empty(0)).dtype),
        "device": str(next(model.parameters(), torch.empty(0)).device),
        "support": _support_size(model),
    }


def _support_size(model: torch.nn.Module) -> int | None:
    ids = draft_support(model)
    return int(ids.numel()) if ids is not None else None


def cost_key(
    verifier: torch.nn.Module,
    drafter: torch.nn.Module | None,
    max_tokens: int,
    steering: Any = None,
    shape: str | None = None,
) -> str:
    """What a measurement depends on, hashed (module docstring); ``shape``: the draft's shape where a
    drafter step's cost depends on it (an EAGLE tree's width, a DFlash block)."""
    device = next(verifier.parameters()).device
    what = {
        "processor": _processor() if device.type == "cpu" else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        # the rows that may stream: a measurement made when one row could not is taken again
        "kernel": f"{linear_mode()} {MIN_ROWS}-{MAX_ROWS}",
        "verifier": _model_identity(verifier),
        "drafter": _model_identity(drafter),
        **({"steering": _model_identity(steering)} if steering is not None else {}),
        **({"shape": shape} if shape is not None else {}),
        "max_tokens": max_tokens,
        "prefix": PREFIX_TOKENS,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cache_path() -> Path | None:
    """The disk cache's file (None: ``DRAFTSMITH_COST_CACHE=off``)."""
    value = os.environ.get("DRAFTSMITH_COST_CACHE", "")
    if value.strip().lower() == "off":
        return None
    if value:
        return Path(value)
    return Path.home() / ".cache" / "draftsmith" / "step_costs.json"


def _read_disk() -> dict[str, Any]:
    path = cache_path()
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_disk(key: str, costs: StepCosts, rows: frozenset[int] | None) -> None:
    path = cache_path()
    if path is None:
        return
    data = _read_disk()
    data[key] = {**costs.to_dict(), **({"stream_rows": sorted(rows)} if rows is not None else {})}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as err:  # a read-only home costs a re-measurement, not the run
        log.warning("Could not cache the measured step costs in %s: %s", path, err)


def random_tokens(model: TimedModel, length: int) -> list[int]:
    """``length`` ids of ``model``'s vocabulary drawn with a fixed seed: the probes' prefix and tokens."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, max(1, model.embed_size), (length,), generator=generator).tolist()


def time_forwards(
    model: TimedModel,
    counts: list[int],
    repeats: int,
    support_only: bool = False,
    draw: bool = False,
    kernels: tuple[frozenset[int] | None, ...] = (None,),
) -> list[list[float]]:
    """Median seconds of a forward over each of ``counts`` new tokens after a cached prefix, one list per
    entry of ``kernels`` (the row counts that stream while it is timed, :func:`set_stream_rows`, the
    entries interleaved; None: the model as it is); ``draw``: with what a drafter step adds to its
    forward (its distribution, its top token and its confidence)."""
    prefix = random_tokens(model, PREFIX_TOKENS)
    cache = model(prefix, None, support_only=support_only).cache
    tokens = random_tokens(model, max(counts) + 1)[1:]
    times: list[dict[int, list[float]]] = [{n: [] for n in counts} for _ in kernels]
    for rep in range(repeats + 1):  # the first pass warms up
        for n in counts:
            for k, rows in enumerate(kernels):
                if rows is not None:
                    set_stream_rows(model.model, rows)
                start = time.perf_counter()
                out = model(tokens[:n], cache, logits_to_keep=n, support_only=support_only)
                if draw:
                    q = torch.softmax(out.logits[-1].float(), dim=-1)
                    float(q.max())
                seconds = time.perf_counter() - start if draw else out.seconds
                cache = out.cache
                crop_cache(cache, PREFIX_TOKENS)
                if rep:
                    times[k][n].append(seconds)
    return [[statistics.median(per[n]) for n in counts] for per in times]


def chooses_kernel(model: TimedModel) -> bool:
    """Whether the probe chooses ``model``'s linear product per row count (module docstring)."""
    param = next(model.model.parameters(), None)
    return (
        linear_mode() == "auto"
        and stream_rows(model.model) is not None
        and param is not None
        and param.device.type == "cpu"
        and param.dtype == torch.float32
    )


def faster_rows(counts: list[int], library: list[float], streamed: list[float]) -> frozenset[int]:
    """The row counts whose streamed forward was faster; counts past the largest measured take its
    choice."""
    rows = {n for n, a, b in zip(counts, library, streamed, strict=True) if n >= MIN_ROWS and b < a}
    if max(counts) in rows:
        rows |= set(range(max(counts) + 1, MAX_ROWS + 1))
    return frozenset(rows)


def measure_step_costs(
    verifier: TimedModel,
    drafter: TimedModel | None,
    max_tokens: int,
    repeats: int = 5,
    choose_kernel: bool = True,
) -> StepCosts:
    """Measure (no cache): the verifier's forward over 1 .. ``max_tokens`` tokens and a drafter step;
    with ``choose_kernel`` (and :func:`chooses_kernel`), each row count's faster linear product is
    chosen for the verifier (module docstring)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    counts = list(range(1, max_tokens + 1))
    with torch.inference_mode():
        if choose_kernel and chooses_kernel(verifier):
            library, streamed = time_forwards(verifier, counts, repeats, kernels=(frozenset(), ALL_ROWS))
            rows = faster_rows(counts, library, streamed)
            set_stream_rows(verifier.model, rows)
            medians = [min(a, b) for a, b in zip(library, streamed, strict=True)]
            log.info("Linear product per row count: streamed for %s, the library's otherwise", sorted(rows))
        else:
            (medians,) = time_forwards(verifier, counts, repeats)
        # more tokens never cost less: a dip is the machine's noise (a cheaper 4 than 1 would make
        # every block draft 3 tokens "for free"), so each count costs at least what fewer did
        verify = [max(medians[: n + 1]) for n in range(len(medians))]
    draft = drafter_step_seconds(drafter, repeats) if drafter is not None else 0.0
    return StepCosts(verify=tuple(verify), draft=draft)


def drafter_step_seconds(drafter: TimedModel, repeats: int = 5) -> float:
    """Measure (no cache): one drafter step after a cached prefix, with what a step adds to its forward
    (its distribution, top token and confidence); the median of ``repeats`` after a warm-up."""
    with torch.inference_mode():
        support = drafter.support is not None
        return time_forwards(drafter, [1], repeats, support_only=support, draw=True)[0][0]


def step_costs(
    verifier: TimedModel,
    drafter: TimedModel | None,
    max_tokens: int,
    steering: Any = None,
) -> StepCosts:
    """The pair's step costs for checks of 1 .. ``max_tokens`` tokens (at least :data:`MEASURED_TOKENS`):
    from the process's memo, else the disk cache, else measured now and cached (module docstring).
    ``steering`` (an SD^2 steering module): the drafter's step is timed steered, as it drafts
    (:func:`steered_while_timed`), and cached apart from the plain drafter's."""
    checks = check_costs(verifier, max_tokens)
    if drafter is None:
        return checks
    drafter_model = drafter.model

    def measure_step() -> float:
        with steered_while_timed(verifier.model, drafter_model, steering):
            return drafter_step_seconds(drafter)

    key = cost_key(verifier.model, drafter_model, max(max_tokens, MEASURED_TOKENS), steering)
    return with_drafter_step(checks, key, measure_step)


def check_costs(verifier: TimedModel, max_tokens: int) -> StepCosts:
    """The verifier's checks of 1 .. ``max_tokens`` tokens (at least :data:`MEASURED_TOKENS`), measured once
    per verifier and setting whatever the drafter (``draft`` 0): every decoder of one verifier weighs the
    same check costs (measured per pair, two drafters of one verifier were once given checks of 2 tokens
    at 1.03 and 1.17 one-token steps by two measurements, and their gates chose differently). Where the
    kernel is chosen per row count, the verifier is left with the choice the costs were measured with."""
    max_tokens = max(max_tokens, MEASURED_TOKENS)

    def measure_checks() -> tuple[StepCosts, frozenset[int] | None]:
        costs = measure_step_costs(verifier, None, max_tokens)
        return costs, stream_rows(verifier.model) if chooses_kernel(verifier) else None

    checks, rows = remembered(cost_key(verifier.model, None, max_tokens), measure_checks)
    if rows is not None and chooses_kernel(verifier):
        set_stream_rows(verifier.model, rows)
    return checks


def with_drafter_step(checks: StepCosts, key: str, measure: Callable[[], float]) -> StepCosts:
    """``checks`` with the drafter's step cached under ``key`` (:func:`cost_key` of the pair and what
    else the step depends on), ``measure()``d when neither the memo nor the disk has it."""
    step, _ = remembered(key, lambda: (StepCosts(verify=checks.verify, draft=measure()), None))
    return StepCosts(verify=checks.verify, draft=step.draft)


@contextlib.contextmanager
def steered_while_timed(
    verifier: torch.nn.Module, drafter: torch.nn.Module | None, steering: Any
) -> Iterator[None]:
    """With ``steering``, the drafter steered for the duration: its hooks attached and a guide computed
    from random verifier states set (the cost does not depend on their values); without,
    nothing. The drafter is left plain afterwards."""
    if steering is None or drafter is None:
        yield
        return
    param = next(steering.parameters())
    hidden = int(getattr(verifier, "config").hidden_size)  # noqa: B009 -- a model's config, typed Any
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(len(steering.verifier_layers), hidden, generator=generator)
    states = states.to(param.device, param.dtype)
    with torch.inference_mode(), steering.attach(drafter) as handle:
        handle.set(steering(states).to(next(drafter.parameters()).device))
        yield


def remembered(
    key: str, measure: Callable[[], tuple[StepCosts, frozenset[int] | None]]
) -> tuple[StepCosts, frozenset[int] | None]:
    """The costs (and streamed row counts) cached under ``key``: from the process's memo, else the disk
    cache, else ``measure()``d now and cached in both."""
    if key not in _MEMO:
        stored, rows = _stored(key)
        if stored is None:
            stored, rows = measure()
            if instrumented():
                log.warning(
                    "Step costs measured under a Python profiler or tracer, which slows every forward: "
                    "used by this process only, not cached in %s: %s",
                    cache_path(),
                    stored,
                )
            else:
                _write_disk(key, stored, rows)
                log.info("Measured step costs (cached under %s): %s", cache_path(), stored)
        _MEMO[key] = (stored, rows)
    return _MEMO[key]


def instrumented() -> bool:
    """Whether this thread runs under a Python profiler (cProfile) or tracer (coverage, a debugger): what
    it measures then is the instrument's cost too, which a later run must not inherit from the disk
    cache (a profiled evaluation once cached a drafter step of 4.0 ms for one of 2.1 ms)."""
    return sys.getprofile() is not None or sys.gettrace() is not None


def _stored(key: str) -> tuple[StepCosts | None, frozenset[int] | None]:
    """The disk cache's costs and streamed row counts under ``key`` (None, None: none usable)."""
    stored = _read_disk().get(key)
    if not isinstance(stored, dict):
        return None, None
    try:
        rows = stored.get("stream_rows")
        return StepCosts.from_dict(stored), (frozenset(int(n) for n in rows) if rows is not None else None)
    except (KeyError, TypeError, ValueError):
        return None, None
