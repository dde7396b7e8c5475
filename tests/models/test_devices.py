"""Where entry points decode: ``device`` / ``drafter_device`` resolved and checked before anything loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from train.config import ConfigError
from train.models.loading import one_local_device, place_pair, resolve_device, resolve_devices


def test_auto_is_cuda_when_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device(None) == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


def test_cuda_without_cuda_is_a_config_error_naming_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="drafter_device=cuda:1: CUDA is not available"):
        resolve_devices("cpu", "cuda:1")
    with pytest.raises(ConfigError, match="^device must be"):
        resolve_device("gpu0")


def test_a_cuda_index_past_the_devices_present_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="device=cuda:1: this machine has 1 CUDA device"):
        resolve_device("cuda:1")


def test_the_pair_is_placed_on_two_devices():
    pair = SimpleNamespace(verifier=torch.nn.Linear(2, 2), drafter=torch.nn.Linear(2, 2))
    place_pair(pair, torch.device("meta"))  # type: ignore[arg-type]
    assert pair.verifier.weight.device.type == pair.drafter.weight.device.type == "meta"
    pair = SimpleNamespace(verifier=torch.nn.Linear(2, 2), drafter=torch.nn.Linear(2, 2))
    place_pair(pair, torch.device("cpu"), torch.device("meta"))  # type: ignore[arg-type]
    assert (pair.verifier.weight.device.type, pair.drafter.weight.device.type) == ("cpu", "meta")


def test_the_evaluate_script_loads_its_models_on_the_configured_device(monkeypatch, tmp_path):
    """scripts/evaluate.py hands the resolved devices to the loaded pair before evaluating."""
    import train.cli.evaluate_command as cli

    placed = {}

    def fake_place(pair, device, drafter_device=None):
        placed.update(device=device, drafter_device=drafter_device)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "load_pair", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(cli, "place_pair", fake_place)
    monkeypatch.setattr(cli, "ensure_built_pair", lambda *a, **k: None)
    run = SimpleNamespace(
        eval=None,
        model=SimpleNamespace(tiny=None),
        logger=None,
        paths=SimpleNamespace(run_dir=str(tmp_path)),
        kinds={"model"},
        devices=(torch.device("meta"), None),
    )
    monkeypatch.setattr(cli, "validate", lambda cfg: run)
    from omegaconf import OmegaConf

    with pytest.raises(SystemExit):
        cli.main(OmegaConf.create({}))
    assert placed == {"device": torch.device("meta"), "drafter_device": None}


def test_a_one_device_job_uses_this_ranks_gpu(monkeypatch):
    """The pair build inside a multi-process run: GPU LOCAL_RANK (SLURM_LOCALID under srun), modulo the
    GPUs this process sees (one per task: that one); the CPU or no CUDA: Lightning's plain ``1``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert one_local_device("gpu", {"LOCAL_RANK": "3"}) == [3]
    assert one_local_device("auto", {"SLURM_LOCALID": "5"}) == [5]
    assert one_local_device("cuda", {}) == [0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert one_local_device("gpu", {"LOCAL_RANK": "3"}) == [0]
    assert one_local_device("cpu", {"LOCAL_RANK": "3"}) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert one_local_device("auto", {"LOCAL_RANK": "3"}) == 1
