"""scripts/gpu_smoke.py: every stage is a command that composes and validates like a documented one; a
stage passes only when its evaluations ran on CUDA; without CUDA the script says so."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from tests.doc_commands import parse
from tests.test_docs_commands import load_script, validate_hydra_command

smoke = load_script("scripts/gpu_smoke.py")


@pytest.mark.parametrize("gpus", [1, 2])
def test_every_stage_composes_and_validates(gpus, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device=cuda is checked at validation
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # ${best_precision:}
    plan = smoke.stages(gpus)
    labels = [stage.label for stage in plan]
    assert {f"{m} bf16 (trainer=gpu)" for m in smoke.METHODS} <= set(labels)
    assert {f"{m} FSDP x{gpus}" for m in smoke.METHODS} <= set(labels)  # every method, on every GPU
    assert "evaluate device=cuda" in labels
    assert [s.skip for s in plan if "drafter_device" in s.label] == [None if gpus == 2 else "needs two GPUs"]
    for stage in plan:
        if stage.skip:  # validated where it runs (gpus=2)
            continue
        command = parse(f"gpu_smoke:{stage.label}", "python " + shlex.join(stage.argv[1:]))
        assert command is not None, stage.label
        validate_hydra_command(command)


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert smoke.main([]) == 2
    assert "No CUDA device" in capsys.readouterr().out


def _stage(root: Path, device: str | None, rc: int = 0) -> list[str]:
    """A stage command that writes one evaluation's results.json under ``root`` (made on ``device``;
    None: writes nothing) and exits ``rc``."""
    write = ""
    if device is not None:
        path = root / "checkpoints" / device.replace(":", "_") / "eval" / "results.json"
        payload = json.dumps(
            {"environment": {"device": device}, "runs": [{"metrics": {"speedup": {"mean": 0.9}}}]}
        )
        write = f"p = pathlib.Path({str(path)!r}); p.parent.mkdir(parents=True); p.write_text({payload!r}); "
    return [sys.executable, "-c", f"import pathlib, sys; {write}sys.exit({rc})"]


def test_a_stage_passes_only_when_its_evaluations_ran_on_cuda(tmp_path):
    """The stage's exit status is not enough: an evaluation that silently ran on the CPU fails it."""
    status, _, figure = smoke.run_stage("on gpu", _stage(tmp_path, "cuda:0"), tmp_path)
    assert (status, figure) == ("ok", "evaluated on cuda:0, best speedup 0.90x")
    status, _, figure = smoke.run_stage("on cpu", _stage(tmp_path, "cpu"), tmp_path)
    assert (status, figure) == ("FAILED (not on CUDA)", "evaluated on cpu, best speedup 0.90x")
    status, _, figure = smoke.run_stage("nothing", _stage(tmp_path, None), tmp_path)  # cuda:0's file is older
    assert (status, figure) == ("FAILED (not on CUDA)", "no results.json written")
    status, _, figure = smoke.run_stage("broken stage", _stage(tmp_path, None, rc=3), tmp_path)
    assert status == "FAILED (3)" and (tmp_path / "broken_stage.log").is_file()
