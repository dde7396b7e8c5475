"""CPU DDP (gloo) through the real entry point: both ranks train, only rank 0 writes outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.slow
def test_cpu_ddp_pretraining_two_processes(tmp_path: Path, tiny_pair_dir: Path) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 8}) for i in range(80))
    )
    cmd = [
        sys.executable,
        "train.py",
        "method=pretrain",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "~callbacks.progress_bar",
        "method.seq_len=32",
        "method.batch_size=4",
        "model.tiny=null",
        f"model.verifier={tiny_pair_dir / 'verifier'}",
        f"model.drafter={tiny_pair_dir / 'drafter'}",
        "data=local",
        "data.name=jsonl",
        f"data.data_files={data}",
        "logger=csv",
        "name=ddp",
    ]
    env = os.environ | {"DRAFTSMITH_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank 0/2: trained 4 steps" in out and "rank 1/2: trained 4 steps" in out, out[-4000:]
    run_dirs = [p for p in (tmp_path / "checkpoints" / "ddp").iterdir() if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs  # both processes share one run directory
    run_dir = run_dirs[0]
    assert (run_dir / "model" / "config.json").is_file()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / "csv" / "metrics.csv").is_file()
    # Rank 1 wrote no model and no logs of its own.
    assert len(list(tmp_path.rglob("metrics.csv"))) == 1
    assert len(list(tmp_path.rglob("model.safetensors"))) == 1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["medusa", "medusa2"])
def test_cpu_ddp_medusa_two_processes(method: str, tmp_path: Path, tiny_pair_dir: Path) -> None:
    """Medusa-1 and Medusa-2 (LoRA adapters, heads-only first steps: the adapters are unused then, so
    DDP needs ddp_find_unused_parameters_true) under two gloo processes, then rank 0's finish step."""
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 8}) for i in range(80))
    )
    cmd = [
        sys.executable,
        "train.py",
        f"method={method}",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        f"trainer.strategy={'ddp_find_unused_parameters_true' if method == 'medusa2' else 'ddp'}",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "trainer.enable_progress_bar=false",
        "~callbacks.progress_bar",
        "method.seq_len=32",
        "method.batch_size=4",
        "method.num_heads=2",
        "method.tree_nodes=4",
        *(
            ["method.backbone_frozen_steps=2", "method.lora.target_modules=[q_proj,v_proj]"]
            if method == "medusa2"
            else []
        ),
        "model.tiny=null",
        f"model.verifier={tiny_pair_dir / 'verifier'}",
        f"model.drafter={tiny_pair_dir / 'drafter'}",
        "data=local",
        "data.name=jsonl",
        f"data.data_files={data}",
        "eval.decoders=[medusa]",
        "eval.num_prompts=2",
        "eval.prompt_len=12",
        "eval.max_new_tokens=8",
        "eval.seeds=[0]",
        "eval.progress=false",
        "eval.plots=false",
        "logger=csv",
        f"name=ddp_{method}",
    ]
    env = os.environ | {"DRAFTSMITH_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    (run_dir,) = [p for p in (tmp_path / "checkpoints" / f"ddp_{method}").iterdir() if p.is_dir()]
    report = json.loads((run_dir / "report.json").read_text())
    label = "medusa-2" if method == "medusa2" else "medusa-1"
    assert report["method"]["method"] == label and len(report["method"]["tree"]) == 4
    runs = report["drafters"][label]["medusa"]
    assert runs["0"]["block_efficiency"]["mean"] >= 1.0
    assert (run_dir / "heads" / "config.json").is_file() and (
        run_dir / "heads_vllm" / "config.json"
    ).is_file()
    assert (run_dir / "verifier" / "config.json").is_file() == (method == "medusa2")
    assert len(list(tmp_path.rglob("heads_vllm"))) == 1  # rank 1 exported nothing
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert all(r["greedy_match"] for r in results["runs"] if r["temperature"] == 0.0)


@pytest.mark.slow
def test_cpu_ddp_distillspec_two_processes(tmp_path: Path, tiny_pair_dir: Path) -> None:
    """DistillSpec under two gloo processes: on-policy and verifier rollouts on each rank's own prompts,
    validation reduced across ranks, one export and one report from rank 0."""
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "\n".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 8}) for i in range(80))
    )
    cmd = [
        sys.executable,
        "train.py",
        "method=distillspec",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false",
        "~callbacks.progress_bar",
        "method.data_source=mixed_verifier",
        "method.validate_before=true",  # trainer.validate, then fit, under two processes
        "method.max_new_tokens=6",
        "method.prompt_len=12",
        "method.batch_size=4",
        "method.num_prompts=32",
        "method.num_val_prompts=4",
        "model.tiny=null",
        f"model.verifier={tiny_pair_dir / 'verifier'}",
        f"model.drafter={tiny_pair_dir / 'drafter'}",
        "data=local",
        "data.name=jsonl",
        f"data.data_files={data}",
        "eval.num_prompts=2",
        "eval.prompt_len=12",
        "eval.max_new_tokens=8",
        "eval.seeds=[0]",
        "eval.progress=false",
        "eval.plots=false",
        "logger=csv",
        "name=ddp_distillspec",
    ]
    env = os.environ | {"DRAFTSMITH_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    (run_dir,) = [p for p in (tmp_path / "checkpoints" / "ddp_distillspec").iterdir() if p.is_dir()]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["method"]["method"] == "distillspec" and set(report["drafters"]) == {"before", "after"}
    assert (run_dir / "drafter" / "config.json").is_file()
    assert len(list(tmp_path.rglob("report.json"))) == 1  # rank 1 reported nothing
    metrics = (run_dir / "csv" / "metrics.csv").read_text()
    assert "val/expected_acceptance" in metrics
    assert [e["step"] for e in report["method"]["validation"]] == [0, 2, 4]  # validated before training
