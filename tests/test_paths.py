"""Default paths resolve from the package (or DRAFTSMITH_ROOT), not from the working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT
from train.paths import project_root


def test_root_is_the_variable_else_the_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DRAFTSMITH_ROOT", raising=False)
    assert project_root() == str(REPO_ROOT)
    monkeypatch.setenv("DRAFTSMITH_ROOT", str(tmp_path))
    assert project_root() == str(tmp_path)


def test_scripts_run_from_another_directory_use_the_project_paths(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DRAFTSMITH_ROOT"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "evaluate.py"),
            "--cfg",
            "job",
            "--resolve",
            "--package",
            "paths",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    paths = yaml.safe_load(proc.stdout)
    assert paths["root_dir"] == str(REPO_ROOT)
    assert paths["tiny_dir"] == str(REPO_ROOT / "checkpoints" / "tiny")
    assert not any(tmp_path.iterdir())  # nothing created under the working directory


def test_a_long_sweep_folder_name_is_cut_to_fit_and_stays_distinct():
    from train.paths import fitting_dirname

    short = "method.divergence=fkl"
    assert fitting_dirname(short) == short
    long_a = "eval.seeds=[0]," + "model.tiny.verifier.hidden_size=16," * 10 + "method.divergence=fkl"
    long_b = long_a.replace("fkl", "rkl")
    cut_a, cut_b = fitting_dirname(long_a), fitting_dirname(long_b)
    assert len(cut_a) == len(cut_b) == 120 and cut_a != cut_b and cut_a.startswith("eval.seeds=[0],")
