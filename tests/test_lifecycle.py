"""What real clusters do to a run: a second job in the same run directory, SIGTERM / Ctrl-C, no
network for W&B, and configs rejected after Hydra made the run directory."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import wandb
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.loggers import WandbLogger
from omegaconf import open_dict

import train.cli.train_command as run_module
from tests.conftest import CONF_DIR, REPO_ROOT
from tests.test_run import read_metrics, run_cfg
from train.cli.train_command import main, resume_command
from train.config import ConfigError, LoggerConfig, instantiate_group
from train.rundir import LOCK_NAME, RunDirLock, RunDirLocked, remove_if_unused
from train.training.trainer import build_loggers, close_loggers


class SignalAtStep(L.Callback):
    """Test helper: the process sends itself ``signum`` once ``step`` optimizer steps are done."""

    def __init__(self, step: int, signum: int) -> None:
        self.step = step
        self.signum = signum

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- one live run per run directory ---------------------------------------------------------------


def test_lock_is_exclusive_and_names_its_holder(tmp_path: Path) -> None:
    with RunDirLock(str(tmp_path)):
        holder = json.loads((tmp_path / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(RunDirLocked, match=rf"host {socket.gethostname()}, PID {os.getpid()}, since 20"):
            RunDirLock(str(tmp_path)).acquire()
    assert not (tmp_path / LOCK_NAME).exists()  # released on exit


def test_lock_is_released_on_error(tmp_path: Path) -> None:
    with pytest.raises(ZeroDivisionError), RunDirLock(str(tmp_path)):
        _ = 1 / 0
    assert not (tmp_path / LOCK_NAME).exists()


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pid = dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "since": 0.0}))
    with caplog.at_level(logging.WARNING), RunDirLock(str(tmp_path)):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"PID {pid}" in caplog.text and "gone" in caplog.text


def test_lock_of_another_host_blocks(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": dead_pid(), "since": 0.0}))
    with pytest.raises(RunDirLocked, match="host elsewhere"):
        RunDirLock(str(tmp_path)).acquire()


def test_lock_of_an_earlier_run_of_a_requeued_slurm_job_is_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    earlier = {"host": "node-a", "pid": 1, "since": 0.0, "slurm_job_id": "42", "slurm_restart_count": 0}
    (tmp_path / LOCK_NAME).write_text(json.dumps(earlier))
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")  # the same incarnation: maybe alive elsewhere
    with pytest.raises(RunDirLocked, match="host node-a"):
        RunDirLock(str(tmp_path)).acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: the earlier one is gone
    with RunDirLock(str(tmp_path)):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["slurm_restart_count"] == 1


def test_second_run_in_a_held_run_directory_fails_at_once(
    tmp_path: Path, tiny_pair_dir: Path, text_file: Path
) -> None:
    cfg = run_cfg(tmp_path, tiny_pair_dir, text_file, "shared", ["logger=none"])
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True)
    with RunDirLock(str(run_dir)):  # the first run, still alive
        with pytest.raises(RunDirLocked, match=f"in use by another run .*PID {os.getpid()}"):
            main(cfg)
        assert (run_dir / LOCK_NAME).is_file() and not (run_dir / "config.yaml").exists()


# --- no half-made run directories -------------------------------------------------------------------


def fake_hydra_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What Hydra leaves before our code runs: ``.hydra/`` and an empty job log."""
    run_dir = tmp_path / "checkpoints" / "unit" / "hydra-made"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("{}\n")
    (run_dir / "train.log").write_text("")
    monkeypatch.setattr(run_module, "hydra_task", lambda: (str(run_dir), ["name=unit"]))
    return run_dir


def test_rejected_config_removes_the_run_directory_hydra_made(
    tmp_path: Path, tiny_pair_dir: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = fake_hydra_dir(tmp_path, monkeypatch)
    cfg = run_cfg(tmp_path, tiny_pair_dir, text_file, "hydra-made", ["trainer.max_steps=0"])
    with pytest.raises(ConfigError, match="trainer.max_steps"):
        main(cfg)
    assert not run_dir.exists()


def test_run_failing_before_training_removes_its_run_directory(
    tmp_path: Path, tiny_pair_dir: Path, text_file: Path
) -> None:
    cfg = run_cfg(tmp_path, tiny_pair_dir, text_file, "x", ["logger=none", "ckpt_path=last"])
    with pytest.raises(FileNotFoundError, match="ckpt_path=last"):
        main(cfg)  # config.yaml was written and the lock taken, then resuming found nothing
    assert not Path(cfg.paths.run_dir).exists()


def test_a_directory_with_anything_else_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = fake_hydra_dir(tmp_path, monkeypatch)
    old = time.time() - 3600 * 24  # before this process started: another run's
    for extra in ("checkpoints", "csv", LOCK_NAME):
        (run_dir / extra).mkdir()
        assert not remove_if_unused(str(run_dir)), extra
        (run_dir / extra).rmdir()
    (run_dir / "config.yaml").write_text("{}\n")
    os.utime(run_dir / "config.yaml", (old, old))
    assert not remove_if_unused(str(run_dir))
    os.utime(run_dir / "config.yaml")
    os.utime(run_dir / ".hydra", (old, old))  # a reused directory: Hydra rewrote files in an old .hydra/
    assert not remove_if_unused(str(run_dir))
    os.utime(run_dir / ".hydra")
    (run_dir / "train.log").write_text("[INFO] - Seed set to 0\n")  # this run's own lines
    assert remove_if_unused(str(run_dir)) and not run_dir.exists()


# --- SIGTERM / SIGINT --------------------------------------------------------------------------------


def test_resume_command_replaces_ckpt_path(monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = ["experiment=distillspec", "ckpt_path=last", "method.lr=1e-4", "data.note=a b"]
    monkeypatch.setattr(run_module, "hydra_task", lambda: ("/runs/x", overrides))
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert resume_command("/runs/x/checkpoints/last.ckpt") == (
        "python train.py experiment=distillspec method.lr=1e-4 'data.note=a b' "
        "ckpt_path=/runs/x/checkpoints/last.ckpt"
    )


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_the_current_step_and_prints_the_resume_command(
    tmp_path: Path, tiny_pair_dir: Path, text_file: Path, signum: int, code: int
) -> None:
    cmd = [
        sys.executable,
        "train.py",
        "method=pretrain",
        "model.tiny=null",
        f"model.verifier={tiny_pair_dir / 'verifier'}",
        f"model.drafter={tiny_pair_dir / 'drafter'}",
        "data=local",
        "data.name=jsonl",
        f"data.data_files={text_file}",
        "trainer.max_steps=20",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false",
        "~callbacks.progress_bar",
        "callbacks.model_checkpoint.every_n_train_steps=2",
        "method.seq_len=32",
        "method.batch_size=4",
        "logger=csv",
        "name=sig",
        "+callbacks.signal._target_=tests.test_lifecycle.SignalAtStep",
        "+callbacks.signal.step=3",
        f"+callbacks.signal.signum={int(signum)}",
    ]
    env = os.environ | {"DRAFTSMITH_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-4000:]
    (run_dir,) = [p for p in (tmp_path / "checkpoints" / "sig").iterdir() if p.is_dir()]
    last = run_dir / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=False)
    assert state["global_step"] == 3  # the step the signal came at, not the periodic save at step 2
    resume = f"ckpt_path={last}"
    (line,) = [ln.strip() for ln in proc.stdout.splitlines() if resume in ln]
    assert line.startswith("python train.py method=pretrain ") and line.endswith(resume)
    assert line.count("ckpt_path=") == 1
    assert not (run_dir / "model").exists()  # the finish step was skipped
    assert not (run_dir / LOCK_NAME).exists()
    if signum != signal.SIGTERM:
        return
    # The printed checkpoint resumes: training continues from step 3.
    cfg = run_cfg(tmp_path, tiny_pair_dir, text_file, "resumed", ["logger=csv", "trainer.max_steps=5"])
    with open_dict(cfg):
        cfg.ckpt_path = str(last)
    main(cfg)
    steps = [
        int(r["step"])
        for r in read_metrics(tmp_path / "checkpoints" / "unit" / "resumed")
        if r.get("train/loss")
    ]
    assert steps and min(steps) >= 3, steps


def test_trainer_plugins_reach_lightning() -> None:
    slurm = "{_target_:lightning.fabric.plugins.environments.SLURMEnvironment,auto_requeue:false}"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"trainer.plugins=[{slurm}]"])
    (plugin,) = instantiate_group(cfg, "trainer").trainer_kwargs()["plugins"]
    assert isinstance(plugin, SLURMEnvironment) and not plugin.auto_requeue


# --- tracking never stops training -------------------------------------------------------------------


def test_wandb_that_cannot_start_online_falls_back_to_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # restored afterwards (Lightning sets it offline)
    real_init = wandb.init
    tries: list[dict] = []

    def no_network(**kwargs: object):
        tries.append(dict(kwargs))
        if os.environ.get("WANDB_MODE") not in ("offline", "dryrun"):
            raise wandb.errors.CommError("Network error (ConnectTimeout), entering retry loop.")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", no_network)
    cfg = LoggerConfig(wandb=True, csv=False, init_timeout=5)
    assert not cfg.wandb_offline()
    with caplog.at_level(logging.WARNING):
        (logger,) = build_loggers(cfg, str(tmp_path), "unit", config={"a": 1})
    try:
        assert isinstance(logger, WandbLogger)
        assert len(tries) == 2 and all(
            t["settings"].init_timeout == 5  # type: ignore[attr-defined]
            for t in tries
        )
        assert "CommError" in caplog.text and "wandb sync" in caplog.text
        logger.log_metrics({"train/loss": 1.0}, step=0)
    finally:
        close_loggers([logger])
    assert list((tmp_path / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_failed_start_leaves_no_run_directory_through_train_py(tmp_path: Path, tiny_pair_dir: Path) -> None:
    env = os.environ | {"DRAFTSMITH_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "train.py", "name=bad", "trainer.max_steps=0"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "trainer.max_steps must be >= 1" in proc.stderr, proc.stderr[-2000:]
    assert not [p for p in (tmp_path / "checkpoints" / "bad").iterdir()]  # Hydra made one; it is gone
    # After validation: config.yaml written, the log has lines, then resuming finds no checkpoint.
    cmd = [sys.executable, "train.py", "name=bad", "ckpt_path=last", "model.tiny=null"]
    cmd += [f"model.{role}={tiny_pair_dir / role}" for role in ("verifier", "drafter")]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "ckpt_path=last: no checkpoints" in proc.stderr, proc.stderr[-2000:]
    assert not [p for p in (tmp_path / "checkpoints" / "bad").iterdir()]
