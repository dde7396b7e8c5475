"""``scripts/leaderboard.py`` end to end on a micro pair: it trains every method it misses (passing its
model/paths overrides on), reuses them on a second run, and writes one table with every drafter kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import MICRO_PAIR, REPO_ROOT

TRAINING_OVERRIDES = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "method.batch_size=4",
    "eval.num_prompts=1",
    "eval.max_new_tokens=8",
    "eval.seeds=[0]",
    "eval.plots=false",
    "~callbacks.progress_bar",
    "logger=csv",
]
MICRO_TRAINING = "train_overrides=[" + ",".join(f"'{o}'" for o in TRAINING_OVERRIDES) + "]"


def _leaderboard(tmp_path: Path, run: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "scripts/leaderboard.py",
        "model=tiny",
        "data=stdlib",
        "eval.prompt_len=64",
        f"paths.tiny_dir={tmp_path / 'tiny'}",
        *MICRO_PAIR,
        MICRO_TRAINING,
        "eval.num_prompts=2",
        "eval.max_new_tokens=12",
        "eval.seeds=[0,1]",
        "eval.progress=false",
        "eval.plots=false",
        f"hydra.run.dir={tmp_path / run}",
    ]
    env = {**os.environ, "DRAFTSMITH_ROOT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=env)


@pytest.mark.slow
def test_leaderboard_trains_what_is_missing_then_reuses_it(tmp_path):
    proc = _leaderboard(tmp_path, "first")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    board = json.loads((tmp_path / "first" / "leaderboard.json").read_text())
    assert set(board["artifacts"]) == {
        "distillspec_tiny",
        "steering_tiny",
        "medusa_tiny",
        "medusa2_tiny",
        "eagle3_tiny",
        "dflash_tiny",
    }
    seen = {(r["drafter"], r["decoder"].split("@")[0]) for r in board["rows"]}
    for pair in [
        ("-", "ar"),
        ("pretrained", "sd"),
        ("distillspec", "sd"),
        ("steered", "sd"),
        ("distillspec", "specinfer"),
        ("distillspec", "rsd_c"),
        ("distillspec", "rsd_s"),
        ("distillspec", "async"),
        ("medusa-1", "medusa"),
        ("medusa-1", "bpd"),
        ("medusa-2", "medusa"),
        ("eagle3", "eagle3_8"),
        ("dflash", "dflash"),
    ]:
        assert pair in seen, pair
    assert all(r["n"] == 2 for r in board["rows"]) and {r["temperature"] for r in board["rows"]} == {0.0, 1.0}
    assert all(set(r["projected"]) == {"c=0.05", "c=0.1"} for r in board["rows"])
    text = (tmp_path / "first" / "leaderboard.md").read_text()
    assert "a model, not a measurement" in text and "medusa-2" in text
    assert (tmp_path / "first" / "eval_main" / "results.json").is_file()
    assert proc.stdout.count("Training what the leaderboard needs") == 6

    again = _leaderboard(tmp_path, "second")  # every artifact is found: nothing trains
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "Training what the leaderboard needs" not in again.stdout
    assert (
        json.loads((tmp_path / "second" / "leaderboard.json").read_text())["artifacts"] == board["artifacts"]
    )


def test_auto_experiments_follow_the_pair_and_a_bad_list_names_the_key():
    from omegaconf import OmegaConf

    from train.cli.leaderboard_command import experiment_names, validate
    from train.config import ConfigError

    class Model:
        def __init__(self, tiny):
            self.tiny = tiny

    auto = OmegaConf.create({"experiments": "auto"})
    assert experiment_names(auto, Model(None)) == [
        "distillspec",
        "steering",
        "medusa",
        "medusa2",
        "eagle3",
        "dflash",
        "dspark",
    ]
    assert experiment_names(auto, Model(object()))[0] == "distillspec_tiny"
    assert experiment_names(OmegaConf.create({"experiments": ["medusa"]}), Model(None)) == ["medusa"]
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="leaderboard", overrides=["experiments=[medusa,nope]"], return_hydra_config=True
        )
    with open_dict(cfg):
        cfg.paths.run_dir = "/tmp/unused"
        del cfg["hydra"]
    with pytest.raises(ConfigError, match="experiments"):
        validate(cfg)
