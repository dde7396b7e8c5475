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
