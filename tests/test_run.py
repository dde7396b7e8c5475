"""The run orchestration on a tiny random pair: run directory, loggers, checkpoints, resume, NaN guard."""

from __future__ import annotations

import csv
import re
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

from tests.conftest import CONF_DIR
from train.cli.train_command import FinishedRunError, main
from train.progress import short_metric_name
from train.training.callbacks import NonFiniteLossError


def run_cfg(tmp_path: Path, pair: Path, data: Path, run: str, extra: list[str] | None = None) -> DictConfig:
    overrides = [
        "method=pretrain",
        "model.tiny=null",
        f"model.verifier={pair / 'verifier'}",
        f"model.drafter={pair / 'drafter'}",
        "data=local",
        "data.name=jsonl",
        f"data.data_files={data}",
        "data.validation_fraction=0.2",
        "data.test_fraction=0.1",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.log_every_n_steps=1",
        "trainer.limit_val_batches=2",
        "trainer.enable_progress_bar=false",
        "method.seq_len=32",
        "method.batch_size=4",
        "callbacks.model_checkpoint.every_n_train_steps=2",
        "~callbacks.progress_bar",
        f"paths.root_dir={tmp_path}",
        "name=unit",
    ] + (extra or [])
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.run_dir = str(tmp_path / "checkpoints" / "unit" / run)
    return cfg


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_run_writes_config_checkpoints_csv_and_offline_wandb(
    tmp_path: Path, tiny_pair_dir: Path, text_file: Path
) -> None:
    main(run_cfg(tmp_path, tiny_pair_dir, text_file, "a"))
    run_dir = tmp_path / "checkpoints" / "unit" / "a"
    assert (run_dir / "config.yaml").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt"]  # retention: one file
    assert (run_dir / "model" / "config.json").is_file()
    rows = read_metrics(run_dir)
    assert any(r.get("train/loss") for r in rows) and any(r.get("val/loss") for r in rows)
    (offline,) = list((run_dir / "wandb").glob("offline-run-*"))
    (records,) = list(offline.glob("run-*.wandb"))  # the offline run's record log (protobuf, uncompressed)
    keys = (b"train/loss", b"val/loss", b"val/perplexity")
    deadline = time.monotonic() + 60  # W&B's service process may still be writing under a loaded machine
    while not all(key in (logged := records.read_bytes()) for key in keys) and time.monotonic() < deadline:
        time.sleep(0.5)
    for key in keys:
        assert key in logged, key
    # The frozen verifier never enters a training checkpoint.
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    n_drafter = sum(p.numel() for p in state["state_dict"].values())
    assert n_drafter < 100_000  # drafter only (the verifier is ~4x larger)


def test_resume_continues_from_last_checkpoint(tmp_path: Path, tiny_pair_dir: Path, text_file: Path) -> None:
    main(run_cfg(tmp_path, tiny_pair_dir, text_file, "first", ["logger=csv"]))
    main(
        run_cfg(
            tmp_path,
            tiny_pair_dir,
            text_file,
            "second",
            ["logger=csv", "ckpt_path=last", "trainer.max_steps=6"],
        )
    )
    steps = [
        int(r["step"])
        for r in read_metrics(tmp_path / "checkpoints" / "unit" / "second")
        if r.get("train/loss")
    ]
    assert steps and min(steps) >= 4, steps  # started where the first run stopped


def test_resume_without_checkpoint_is_a_clear_error(
    tmp_path: Path, tiny_pair_dir: Path, text_file: Path
) -> None:
    with pytest.raises(FileNotFoundError, match="ckpt_path=last"):
        main(run_cfg(tmp_path, tiny_pair_dir, text_file, "x", ["logger=none", "ckpt_path=last"]))


def test_non_finite_loss_stops_naming_the_step(
    tmp_path: Path, tiny_pair_dir: Path, text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from train.methods.pretrain.module import PretrainModule

    original = PretrainModule._loss

    def poisoned(self, batch):  # finite for two steps, then NaN
        loss = original(self, batch)
        return loss * float("nan") if self.training and self.global_step >= 2 else loss

    monkeypatch.setattr(PretrainModule, "_loss", poisoned)
    with pytest.raises(NonFiniteLossError, match="global step 2.*last good checkpoint: .*last.ckpt"):
        main(run_cfg(tmp_path, tiny_pair_dir, text_file, "nan", ["logger=none"]))
    state = torch.load(
        tmp_path / "checkpoints" / "unit" / "nan" / "checkpoints" / "last.ckpt",
        map_location="cpu",
        weights_only=False,
    )
    assert all(torch.isfinite(t).all() for t in state["state_dict"].values())


def test_resuming_a_finished_run_says_so_and_stops(
    tmp_path: Path, tiny_pair_dir: Path, text_file: Path
) -> None:
    main(run_cfg(tmp_path, tiny_pair_dir, text_file, "done", ["logger=csv"]))
    with pytest.raises(FinishedRunError, match=r"global step 4, and trainer.max_steps=4.*already finished"):
        main(run_cfg(tmp_path, tiny_pair_dir, text_file, "again", ["logger=csv", "ckpt_path=last"]))
    assert not (tmp_path / "checkpoints" / "unit" / "again").exists()  # nothing half-made left behind


def test_terminal_shows_the_plan_a_step_bar_and_the_run_directory(
    tmp_path: Path, tiny_pair_dir: Path, text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = run_cfg(
        tmp_path, tiny_pair_dir, text_file, "bar", ["logger=csv", "trainer.enable_progress_bar=true"]
    )
    with open_dict(cfg):
        cfg.callbacks.progress_bar = {"_target_": "train.progress.StepProgressBar"}
    main(cfg)
    out = capsys.readouterr().out
    run_dir = tmp_path / "checkpoints" / "unit" / "bar"
    assert out.startswith("unit: PretrainConfig on DataSourceConfig data, 4 steps on 1 cpu device (seed 0)")
    assert f"Run directory: {run_dir}" in out
    assert "4/4" in out and "Epoch" not in out and "v_num" not in out  # one bar over max_steps


def test_short_metric_names() -> None:
    assert short_metric_name("train/loss") == "loss"
    assert short_metric_name("train/expected_acceptance") == "accept"
    assert short_metric_name("val/expected_acceptance") == "val_accept"
    assert short_metric_name("val/perplexity") == "val_perplexity"


class _Trained(torch.nn.Module):
    """A method module as the finish step sees it (:class:`train.report.Finishable`)."""

    reference_drafter = None
    artifact_dir = "drafter"
    card_base = "drafter"

    def __init__(self) -> None:
        super().__init__()
        self.drafter = torch.nn.Linear(2, 2)

    def drafters_to_evaluate(self) -> dict:
        return {}

    def evaluation_verifier(self, verifier: torch.nn.Module) -> torch.nn.Module:
        return verifier

    def export(self, out_dir: str) -> str:
        return out_dir

    def report_summary(self) -> dict:
        return {}

    def report_sections(self) -> list:
        return []


def _finish_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, root: str, devices: tuple) -> dict:
    """finish_run after a fit on ``root`` (the trainer's strategy.root_device) that Lightning's teardown
    left on the CPU; returns where the module, the verifier and the evaluation were when finish ran."""
    from types import SimpleNamespace

    import train.cli.train_command as run_module
    from train.cli.train_command import finish_run

    seen: dict = {}

    def fake_finish(module, verifier, tokenizer, context):
        seen.update(
            module=module.drafter.weight.device.type,
            verifier=verifier.weight.device.type,
            device=str(context.device),
            drafter_device=str(context.drafter_device),
        )

    monkeypatch.setattr(run_module, "finish", fake_finish)
    module, pair = _Trained(), SimpleNamespace(verifier=torch.nn.Linear(2, 2), tokenizer=None)
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device(root)),
        is_global_zero=True,
        loggers=[],
        global_step=2,
    )
    spec = SimpleNamespace(devices=devices, run_dir=str(tmp_path), eval=None, data=None, seed=0, name="unit")
    finish_run(module, trainer, spec, pair, {})  # type: ignore[arg-type]
    return seen


def test_the_finish_step_runs_on_the_training_device_after_teardown_moved_the_module(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Lightning's teardown leaves the module on the CPU; the finish step moves it (and the verifier,
    for Medusa-2 a child of it) back to the device training ran on, and evaluates there."""
    seen = _finish_on(monkeypatch, tmp_path, "meta", (None, None))
    assert seen == {"module": "meta", "verifier": "meta", "device": "meta", "drafter_device": "None"}


def test_device_chooses_where_the_finish_step_evaluates(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``python train.py ... device=X drafter_device=Y``: the finish step evaluates on X, drafters on Y."""
    seen = _finish_on(monkeypatch, tmp_path, "cpu", (torch.device("meta"), torch.device("cpu")))
    assert seen == {"module": "meta", "verifier": "meta", "device": "meta", "drafter_device": "cpu"}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("device=cuda", "device=cuda: CUDA is not available on this machine (use device=cpu)"),
        ("drafter_device=cuda:1", "drafter_device=cuda:1: CUDA is not available"),
        ("device=gpu0", "device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu0'"),
    ],
)
def test_a_finish_device_the_machine_lacks_fails_at_validation_naming_the_key(
    tmp_path: Path,
    tiny_pair_dir: Path,
    text_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    override: str,
    message: str,
) -> None:
    from train.cli.train_command import load_spec
    from train.config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = run_cfg(tmp_path, tiny_pair_dir, text_file, "dev", [override])
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_spec(cfg)
    assert load_spec(run_cfg(tmp_path, tiny_pair_dir, text_file, "dev", [])).devices == (None, None)
