"""scripts/gpu_smoke.py: every stage is a command that composes and validates like a documented one."""

from __future__ import annotations

import shlex

import pytest

from tests.doc_commands import parse
from tests.test_docs_commands import load_script, validate_hydra_command

smoke = load_script("scripts/gpu_smoke.py")


@pytest.mark.parametrize("gpus", [1, 2])
def test_every_stage_composes_and_validates(gpus, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device=cuda is checked at validation
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    plan = smoke.stages(gpus)
    labels = [label for label, _ in plan]
    assert {f"{m} bf16 (trainer=gpu)" for m in smoke.METHODS} <= set(labels)
    assert any("FSDP" in label for label in labels) and "evaluate device=cuda" in labels
    for label, argv in plan:
        command = parse(f"gpu_smoke:{label}", "python " + shlex.join(argv[1:]))
        assert command is not None, label
        validate_hydra_command(command)


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert smoke.main([]) == 2
    assert "No CUDA device" in capsys.readouterr().out
