"""SLURM requeue (issue 43, item 7): SLURM's requeue signal stops training at a step boundary, the step is
saved to ``last.ckpt`` outside the signal handler (Lightning's own handler saves inside it, mid-step: a
barrier under DDP, an all-gather under FSDP), then the job is requeued; the requeued start resumes from
that checkpoint in the same run directory and continues the same W&B run."""

from __future__ import annotations

import inspect
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from torch.utils.data import DataLoader, TensorDataset

import train.cli.train_command as run_module
from tests.test_lifecycle import SignalAtStep
from tests.test_run import read_metrics, run_cfg
from train.cli.train_command import main, stopped
from train.config import LoggerConfig
from train.training.callbacks import GracefulStop, requeue_slurm_job, slurm_job_id
from train.training.trainer import WANDB_ID_FILE, build_loggers, close_loggers, requeued_checkpoint

SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


@pytest.fixture
def on_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in SLURM_ENV.items():
        monkeypatch.setenv(key, value)
    for key in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)


class Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SaveStacks(L.Callback):
    """Records the call stack of every checkpoint save, to tell a save in a signal handler (its stack
    runs through the hook the signal interrupted) from one at a step boundary."""

    def __init__(self) -> None:
        self.stacks: list[list[str]] = []

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.stacks.append([frame.function for frame in inspect.stack()])


def test_the_requeue_signal_saves_at_the_step_boundary_not_in_the_handler(on_slurm, tmp_path: Path) -> None:
    stop, saves = GracefulStop(str(tmp_path)), SaveStacks()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=8,
        plugins=[SLURMEnvironment(auto_requeue=True)],
        callbacks=[SignalAtStep(3, int(signal.SIGUSR1)), stop, saves],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(SystemExit):  # Lightning's SIGTERMException: the loops stopped at the boundary
        trainer.fit(Linear(), train_dataloaders=DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=2))
    assert not list(tmp_path.glob("hpc_ckpt_*.ckpt"))  # Lightning's handler did not run
    assert stop.requeue and stop.signum == signal.SIGUSR1 and trainer.global_step == 3
    assert stop.checkpoint == str(tmp_path / "checkpoints" / "last.ckpt")
    assert torch.load(stop.checkpoint, map_location="cpu", weights_only=False)["global_step"] == 3
    assert len(saves.stacks) == 1 and "on_train_batch_end" not in saves.stacks[0]
    assert signal.getsignal(signal.SIGUSR1) is not stop._on_requeue_signal  # restored after fit


def test_requeue_off_leaves_the_signal_alone(on_slurm, tmp_path: Path) -> None:
    stop = GracefulStop(str(tmp_path))
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        plugins=[SLURMEnvironment(auto_requeue=False)],
        callbacks=[stop],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Linear(), train_dataloaders=DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    assert not stop.requeue and stop.signum is None


def test_requeue_runs_scontrol_with_the_job_or_array_task_id() -> None:
    calls: list[list[str]] = []

    def ok(cmd: list[str]) -> int:
        calls.append(cmd)
        return 0

    assert requeue_slurm_job({"SLURM_JOB_ID": "42"}, ok) == "42"
    array = {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm_job_id(array) == "40_3" and requeue_slurm_job(array, ok) == "40_3"
    assert calls == [["scontrol", "requeue", "42"], ["scontrol", "requeue", "40_3"]]
    assert requeue_slurm_job({}, ok) is None and len(calls) == 2  # off SLURM: nothing to requeue
    assert requeue_slurm_job({"SLURM_JOB_ID": "42"}, lambda cmd: 1) is None


def test_stopped_by_the_requeue_signal_says_so_and_exits(on_slurm, capsys) -> None:
    stop = GracefulStop("run")
    stop.signum, stop.requeue, stop.checkpoint = int(signal.SIGUSR1), True, "/runs/x/checkpoints/last.ckpt"
    with pytest.raises(SystemExit) as exit_info:
        stopped(stop, 3, is_global_zero=True)
    assert exit_info.value.code == 128 + signal.SIGUSR1
    out = capsys.readouterr().out
    assert "SIGUSR1 (SLURM's requeue signal) at global step 3" in out and "Requeueing SLURM job 4242" in out


def test_a_requeued_start_resumes_from_its_own_last_checkpoint(tmp_path: Path) -> None:
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    last.write_bytes(b"")
    assert requeued_checkpoint(str(tmp_path), {"SLURM_RESTART_COUNT": "1"}) == str(last)
    assert requeued_checkpoint(str(tmp_path), {"SLURM_RESTART_COUNT": "0"}) is None  # a first start
    assert requeued_checkpoint(str(tmp_path), {}) is None
    assert requeued_checkpoint(str(tmp_path / "elsewhere"), {"SLURM_RESTART_COUNT": "2"}) is None


def test_every_start_of_a_run_directory_logs_to_the_same_wandb_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    ids = []
    for _ in range(2):
        (logger,) = build_loggers(LoggerConfig(csv=False, offline=True), str(tmp_path), "unit")
        logger.log_metrics({"train/loss": 1.0}, step=len(ids))
        ids.append(logger.experiment.id)
        close_loggers([logger])
    assert ids[0] == ids[1] == (tmp_path / WANDB_ID_FILE).read_text().strip()
    # W&B names each start's folder by its start second and the run id: both starts wrote the same run
    # (one folder when they began within the same second, two otherwise)
    assert 1 <= len(list((tmp_path / "wandb").glob(f"offline-run-*-{ids[0]}"))) <= 2
    (other,) = build_loggers(LoggerConfig(csv=False, offline=True), str(tmp_path / "other"), "unit")
    try:
        assert other.experiment.id != ids[0]  # another run directory, another W&B run
    finally:
        close_loggers([other])


@pytest.mark.slow
def test_a_requeued_job_resumes_in_its_run_directory_and_its_wandb_run(
    on_slurm, tmp_path: Path, tiny_pair_dir: Path, text_file: Path, monkeypatch
) -> None:
    """Through ``main``: SIGUSR1 at step 3 saves that step, requeues the job (``scontrol`` recorded) and
    exits 138; the next start of the job (``SLURM_RESTART_COUNT=1``, the same run directory,
    ``ckpt_path`` unset) trains on from step 3 into the same W&B run."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    requeued: list[bool] = []
    monkeypatch.setattr(run_module, "requeue_slurm_job", lambda: requeued.append(True))
    slurm = "{_target_:lightning.fabric.plugins.environments.SLURMEnvironment,auto_requeue:true}"
    extra = ["trainer.max_steps=6", f"trainer.plugins=[{slurm}]"]
    signal_at_3 = [
        "+callbacks.signal._target_=tests.test_lifecycle.SignalAtStep",
        "+callbacks.signal.step=3",
        f"+callbacks.signal.signum={int(signal.SIGUSR1)}",
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(run_cfg(tmp_path, tiny_pair_dir, text_file, "job", extra + signal_at_3))
    assert exit_info.value.code == 128 + signal.SIGUSR1 and requeued == [True]
    run_dir = tmp_path / "checkpoints" / "unit" / "job"
    last = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 3
    assert not list(run_dir.glob("hpc_ckpt_*.ckpt"))
    wandb_id = (run_dir / WANDB_ID_FILE).read_text().strip()

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    main(run_cfg(tmp_path, tiny_pair_dir, text_file, "job", extra))  # ckpt_path unset, as in the job script
    steps = [int(r["step"]) for r in read_metrics(run_dir) if r.get("train/loss")]
    assert steps and min(steps) >= 3, steps  # the restart's CSV: the steps after the requeue
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{wandb_id}"))) == 2


class ValidatingLinear(Linear):
    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()


class SignalInSanityCheck(L.Callback):
    def on_validation_batch_end(  # noqa: ANN001
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ):
        if trainer.sanity_checking and batch_idx == 0:
            signal.raise_signal(signal.SIGUSR1)


def test_the_requeue_signal_during_the_sanity_check_only_flags_the_requeue(on_slurm, tmp_path: Path) -> None:
    """Before, our handler was installed at on_train_start, after the sanity check: a requeue signal during
    the sanity check ran Lightning's handler, which saves inside the handler (hpc_ckpt_1.ckpt)."""
    stop = GracefulStop(str(tmp_path))
    data = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=8,
        num_sanity_val_steps=2,
        plugins=[SLURMEnvironment(auto_requeue=True)],
        callbacks=[SignalInSanityCheck(), stop],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(SystemExit):
        trainer.fit(ValidatingLinear(), train_dataloaders=data, val_dataloaders=data)
    assert not list(tmp_path.glob("hpc_ckpt_*.ckpt"))  # Lightning's handler did not run
    # flagged only: training stops before its first step, with nothing to save, and the job is requeued
    assert stop.requeue and stop.signum == signal.SIGUSR1 and trainer.global_step == 0
    assert stop.checkpoint is None
