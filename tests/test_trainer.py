"""The trainer helpers that only matter on GPUs, checked on the CPU with Lightning's real strategy objects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel

from train.training.trainer import full_weights_on_rank_zero


def test_fsdp_gathers_the_full_weights_on_rank_zero_for_the_finish_step(monkeypatch):
    """Under FSDP every rank enters one summon_full_params on the wrapped model: rank 0 only, read-only."""
    calls = []

    class Summon:
        def __init__(self, module, **kwargs):
            calls.append((module, kwargs))

        def __enter__(self):
            calls.append("enter")

        def __exit__(self, *exc):
            calls.append("exit")

    monkeypatch.setattr(FullyShardedDataParallel, "summon_full_params", Summon)
    model = torch.nn.Linear(2, 2)
    strategy = FSDPStrategy()
    strategy.model = model
    with full_weights_on_rank_zero(SimpleNamespace(strategy=strategy)):  # type: ignore[arg-type]
        calls.append("finish")
    assert calls == [(model, {"writeback": False, "rank0_only": True}), "enter", "finish", "exit"]


def test_other_strategies_are_left_alone(monkeypatch):
    def summon(*args, **kwargs):
        raise AssertionError("no gathering outside FSDP")

    monkeypatch.setattr(FullyShardedDataParallel, "summon_full_params", summon)
    for strategy in (DDPStrategy(), SimpleNamespace(model=None)):
        with full_weights_on_rank_zero(SimpleNamespace(strategy=strategy)):  # type: ignore[arg-type]
            pass


def test_wandb_prints_no_run_history_or_summary(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    from train.config import LoggerConfig
    from train.training.trainer import build_loggers, close_loggers

    loggers = build_loggers(LoggerConfig(offline=True), str(tmp_path), "quiet")
    for step in range(3):
        loggers[-1].log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    close_loggers(loggers)
    out = capfd.readouterr()
    assert "wandb" not in (out.out + out.err).lower()


def test_fsdp_refuses_a_module_of_several_dtypes_before_training_and_says_what_to_change():
    """Issue 43, item 9: FSDP1 flattens the module as one unit of one dtype; a bfloat16 base beside float32
    adapters (LoRA on a bfloat16 drafter) used to fail deep inside ``fit``."""
    from train.config import ConfigError, TrainerConfig
    from train.training.trainer import check_fsdp_dtypes

    mixed = torch.nn.ModuleDict(
        {
            "base": torch.nn.Linear(4, 4).to(torch.bfloat16).requires_grad_(False),
            "adapter": torch.nn.Linear(4, 2),
        }
    )
    for strategy in (FSDPStrategy(), "fsdp"):
        with pytest.raises(
            ConfigError, match=r"trainer=fsdp: .*bfloat16: 2 tensors, e.g. base.weight.*model.dtype=float32"
        ):
            check_fsdp_dtypes(mixed, TrainerConfig(strategy=strategy))
    check_fsdp_dtypes(mixed, TrainerConfig(strategy="ddp"))  # DDP replicates each parameter as it is
    check_fsdp_dtypes(mixed.float(), TrainerConfig(strategy=FSDPStrategy()))  # one dtype: fine
