"""Lightning callbacks of our own: stopping cleanly on a non-finite loss or on a signal (SIGTERM, Ctrl-C,
SLURM's requeue signal), and requeueing a SLURM job once its checkpoint is written."""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss; the weights were not updated with it."""


def nonfinite_losses(loss: torch.Tensor, module: L.LightningModule) -> dict[int, float]:
    """``{rank: loss}`` for every rank whose loss is NaN or infinite, the same on every rank.

    Under DDP or FSDP a rank that raised alone would leave the others waiting in the next all-reduce
    until the process group's timeout, so every rank calls this (one all-gather of one number) and all
    raise together or none does. Outside a trainer, or on one device, only this loss is looked at."""
    value = loss.detach().float().sum().reshape(1)
    trainer = module._trainer
    if trainer is not None and trainer.world_size > 1:
        value = trainer.strategy.all_gather(value)
    return {rank: v for rank, v in enumerate(value.reshape(-1).tolist()) if not math.isfinite(v)}


def describe_nonfinite(losses: dict[int, float], module: L.LightningModule) -> str:
    """``nan`` on one device; ``nan on rank 1 of 2`` (each bad rank) under data parallelism."""
    world_size = module._trainer.world_size if module._trainer is not None else 1
    if world_size <= 1:
        return ", ".join(str(v) for v in losses.values())
    return ", ".join(f"{v} on rank {rank} of {world_size}" for rank, v in losses.items())


class NonFiniteLossGuard(L.Callback):
    """Stop before a non-finite loss reaches the optimizer, naming the step and the last good checkpoint.

    Raising in ``on_before_backward`` means no gradient or weight update comes from the bad batch, so
    the last checkpoint written by ``ModelCheckpoint`` (and the in-memory weights) stay good. The ranks
    decide together (:func:`nonfinite_losses`): every rank raises the same error, none hangs.
    """

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        bad = nonfinite_losses(loss, pl_module)
        if not bad:
            return
        last = _last_checkpoint(trainer)
        where = f"last good checkpoint: {last}" if last else "no checkpoint was written yet"
        raise NonFiniteLossError(
            f"non-finite loss ({describe_nonfinite(bad, pl_module)}) at global step "
            f"{trainer.global_step} (epoch {trainer.current_epoch}); {where}. Lower the learning rate or "
            "check the data, then resume with ckpt_path=last."
        )


def _last_checkpoint(trainer: L.Trainer) -> Any:
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, ModelCheckpoint) and (cb.last_model_path or cb.best_model_path):
            return cb.last_model_path or cb.best_model_path
    return None


class GracefulStop(L.Callback):
    """On SIGTERM, SIGINT or SLURM's requeue signal during training: stop after the current step and save
    it to ``last.ckpt``.

    SIGTERM goes through Lightning's own handling (``trainer.received_sigterm``: the loops finish the
    step, all ranks agree, then raise ``SIGTERMException``). SIGINT is routed into the same path instead
    of Lightning's default (a ``KeyboardInterrupt`` anywhere, even halfway through an optimizer step);
    a second Ctrl-C interrupts at once. So is SLURM's requeue signal (SIGUSR1 unless
    ``SLURMEnvironment(requeue_signal=...)`` says otherwise) when ``auto_requeue`` is on: Lightning's own
    handler saves a checkpoint inside the signal handler, mid-step, which under DDP waits at a barrier
    and under FSDP in an all-gather that the other ranks may never reach; here the handler only sets
    flags, the step finishes, and ``requeue`` tells the caller to requeue the job once the checkpoint
    is written (:func:`requeue_slurm_job`). ``on_exception`` then writes the current step to
    ``<ModelCheckpoint.dirpath>/last.ckpt`` (so ``ckpt_path=last``, ``ckpt_path=<run_dir>`` and a requeued
    start find it); ``signum``, ``requeue`` and ``checkpoint`` tell the caller what happened.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.signum: int | None = None
        """The signal that stopped training (None: not stopped by a signal)."""
        self.requeue = False
        """Whether that signal was SLURM's requeue signal: the caller requeues the job."""
        self.checkpoint: str | None = None
        """The checkpoint written at the step where the signal arrived (None: nothing to save)."""
        self._signals: Any = None  # Lightning's signal connector, whose received_sigterm the loops read

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._on_sigint)
        self._take_over_requeue(trainer)

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the sanity check runs after Lightning registered its handlers and before on_train_start: its
        # requeue handler would save (and wait for the other ranks) inside the signal handler
        self._take_over_requeue(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_over_requeue(trainer)  # trainer.validate before fit (validate_before) too

    def _take_over_requeue(self, trainer: L.Trainer) -> None:
        """Our requeue handler in place of Lightning's (registered by now; Lightning restores the previous
        handlers at teardown). A requeue flagged before training stops it at its first step boundary."""
        if threading.current_thread() is threading.main_thread():
            requeue_signal = slurm_requeue_signal(trainer)
            if requeue_signal is not None:
                self._signals = trainer._signal_connector
                signal.signal(requeue_signal, self._on_requeue_signal)
                if self.requeue:  # flagged in an earlier run of this trainer (validate before fit), whose
                    self._signals.received_sigterm = True  # flag the next run's registration cleared

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        lightning_handler = signal.getsignal(signal.SIGTERM)
        if self.signum is not None or not callable(lightning_handler):
            raise KeyboardInterrupt  # second Ctrl-C, or no graceful path: stop now
        self.signum = signum
        print("\nCtrl-C: saving at the end of this step (press again to stop at once)", flush=True)
        lightning_handler(signal.SIGTERM, frame)

    def _on_requeue_signal(self, signum: int, frame: FrameType | None) -> None:
        """Flags only: no collective, no file, nothing that waits for the other ranks. Lightning's own
        SIGTERM handler is not called either (under DDP it broadcasts from inside the handler); its flag is
        set, which the loops read at the step boundary, where rank 0's is broadcast to every rank."""
        if self.signum is not None or self._signals is None:
            return  # already stopping, or not training
        self.signum, self.requeue = signum, True
        self._signals.received_sigterm = True

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if isinstance(exception, SIGTERMException):
            if self.signum is None:
                self.signum = int(signal.SIGTERM)
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.signum is not None:  # the signal came during the last step: training ended normally
            self._save(trainer)

    def _save(self, trainer: L.Trainer) -> None:
        if trainer.sanity_checking or trainer.global_step == 0:
            return  # nothing trained yet: the run restarts from the beginning
        self.checkpoint = os.path.abspath(self._last_path(trainer))
        trainer.save_checkpoint(self.checkpoint)  # every rank calls it; rank 0 writes

    def _last_path(self, trainer: L.Trainer) -> str:
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, ModelCheckpoint) and cb.dirpath:
                return os.path.join(cb.dirpath, cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION)
        return os.path.join(self.run_dir, "checkpoints", "last.ckpt")


def slurm_requeue_signal(trainer: L.Trainer) -> int | None:
    """The signal SLURM sends before the time limit when Lightning's ``SLURMEnvironment`` has
    ``auto_requeue`` on (its ``requeue_signal``, SIGUSR1 by default); None otherwise."""
    environment = getattr(trainer._accelerator_connector, "cluster_environment", None)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return int(environment.requeue_signal or signal.SIGUSR1)
    return None


def slurm_job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The id ``scontrol requeue`` takes: ``<array job>_<task>`` for a job-array task, else
    ``SLURM_JOB_ID`` (None off SLURM)."""
    array_job = environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ.get("SLURM_JOB_ID")


def requeue_slurm_job(
    environ: Mapping[str, str] = os.environ, call: Callable[[list[str]], int] | None = None
) -> str | None:
    """Put this SLURM job back in the queue (``scontrol requeue <job>``; SLURM then ends this start).
    ``call`` runs the command (``subprocess.call``). Returns the job id, or None when there is no job to
    requeue or ``scontrol`` failed (both logged)."""
    job = slurm_job_id(environ)
    if job is None or not re.fullmatch(r"[0-9_]+", job):
        log.warning(
            "SLURM's requeue signal arrived, but no usable SLURM job id is set (%r): not requeued", job
        )
        return None
    try:
        code = (call or subprocess.call)(["scontrol", "requeue", job])
    except OSError as err:
        code = -1
        log.warning("scontrol requeue %s could not run: %s", job, err)
    if code != 0:
        log.warning("scontrol requeue %s failed (exit %s): requeue the job by hand", job, code)
        return None
    return job
