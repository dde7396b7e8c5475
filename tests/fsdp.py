"""FSDP on the CPU for tests: a fake FSDP trainer for hook unit tests, and a real one for gloo processes.

Lightning refuses ``strategy="fsdp"`` without a GPU (its accelerator connector checks the exact type
``FSDPStrategy``) and hands FSDP no device on the CPU, which FSDP then refuses. :class:`CPUFSDPStrategy`
gets past both, so Lightning's own FSDP strategy and precision plugin run in CPU processes with gloo.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDP strategy on CPU processes (``accelerator="cpu"``, gloo).

    A subclass passes the connector's GPU check; the module is wrapped here with ``device_id=cpu`` (FSDP
    refuses a CPU module without one) and Lightning keeps an already wrapped model as it is."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        wrapped = FullyShardedDataParallel(
            model,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        return super()._setup_model(wrapped)


class RecordingRoot(torch.nn.Module):
    """Stands in for the FSDP root module: records ``clip_grad_norm_`` calls."""

    sharding_strategy = ShardingStrategy.FULL_SHARD

    def __init__(self) -> None:
        super().__init__()
        self.process_group = object()
        self.clipped: list[float] = []

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        self.clipped.append(max_norm)
        return torch.tensor(0.0)


def fake_fsdp_trainer(root: torch.nn.Module, clip: float = 1.0) -> Any:
    """What a module's ``trainer`` holds under ``trainer=fsdp``: Lightning's real FSDPStrategy and
    FSDPPrecision (``bf16-mixed``, whose ``clip_grad_by_norm`` raises), ``root`` as the wrapped model."""
    precision = FSDPPrecision("bf16-mixed")
    strategy = FSDPStrategy(precision_plugin=precision)
    strategy.model = root
    return SimpleNamespace(
        strategy=strategy,
        precision_plugin=precision,
        gradient_clip_val=clip,
        gradient_clip_algorithm=GradClipAlgorithmType.NORM,
    )


@contextmanager
def gloo_rank(rank: int, world_size: int, folder: str | os.PathLike[str]) -> Iterator[None]:
    """Inside, this process is rank ``rank`` of a one-node gloo group: it has the environment a launcher
    gives (Lightning reads it and starts no processes of its own) and the process group, met through a
    file in ``folder`` rather than a TCP port another test on the machine could take first (Lightning
    uses a group that is already there). On the way out the ranks meet once more and the group is
    destroyed (a process that exits with its group alive may abort); a rank whose work finished then
    leaves at once with ``os._exit(0)``: the interpreter's shutdown runs gloo's and FSDP's native
    destructors, which now and then abort ("terminate called without an active exception", SIGABRT
    after a finished run, seen in CI) and would fail a test whose results were already written."""
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    store = Path(folder).resolve() / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(worker: Any, folder: str | os.PathLike[str], nprocs: int = 2, timeout_s: float = 120) -> None:
    """``worker(rank, folder)`` in ``nprocs`` spawned processes (each enters :func:`gloo_rank` itself);
    fails the test when a rank still runs after ``timeout_s`` (it hangs in a collective)."""
    import time

    import pytest
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=(str(folder),), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"a rank still runs after {timeout_s:.0f} s: it hangs in a collective")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
