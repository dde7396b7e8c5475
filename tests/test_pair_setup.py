"""train.cli.pair_setup: what the research scripts decode with, for a pair folder and for a heads run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

import train.cli.pair_setup as pair_setup_module
from train.cli.pair_setup import conf_data, heads_setup, newest_heads, pair_setup


def test_a_pair_without_the_real_pairs_manifest_runs_like_the_tiny_pair(tmp_path: Path) -> None:
    setup = pair_setup(str(tmp_path / "tiny"))
    assert (setup.verifier, setup.drafter) == (
        str(tmp_path / "tiny" / "verifier"),
        str(tmp_path / "tiny" / "drafter"),
    )
    assert (setup.dtype, setup.prompt_len, setup.tie_ulps, setup.real_pair) == ("float32", 64, 4.0, False)
    assert setup.data.name == "stdlib" and os.path.isabs(setup.data.corpus_dir)


@pytest.mark.parametrize(("dtype", "ulps"), [("bfloat16", 16.0), ("float32", 4.0)])
def test_the_real_pair_runs_in_the_best_dtype_on_held_out_chat_prompts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, ulps: float
) -> None:
    (tmp_path / "pair.json").write_text("{}")
    monkeypatch.setattr(pair_setup_module, "best_dtype", lambda: dtype)
    setup = pair_setup(str(tmp_path))
    assert (setup.dtype, setup.tie_ulps, setup.prompt_len, setup.real_pair) == (dtype, ulps, 256, True)
    assert setup.data == conf_data("chat") and setup.data.name == "chat"
    assert setup.answers == str(tmp_path / "answers")


def _run(root: Path, answers: str | None, merged: bool = False) -> Path:
    """A run directory holding heads/ and the config.yaml a training run saves (the keys read)."""
    run = root / "run"
    (run / "heads").mkdir(parents=True)
    if merged:
        (run / "verifier").mkdir()
    config = {
        "model": {"verifier": "/v", "drafter": "/d", "dtype": "bfloat16", "smollm2": {"out_dir": "/pair"}},
        "data": {"_target_": "train.data.sources.DataSourceConfig", "name": "chat", "seed": 3},
        "eval": {"prompt_len": 200, "tie_ulps": 16.0},
        "method": {"answers": answers},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run / "heads"


def test_heads_read_their_runs_verifier_dtype_data_prompts_and_answers(tmp_path: Path) -> None:
    setup = heads_setup(str(_run(tmp_path, "pair")))
    assert (setup.verifier, setup.drafter, setup.dtype, setup.prompt_len, setup.tie_ulps) == (
        "/v",
        "/d",
        "bfloat16",
        200,
        16.0,
    )
    assert (setup.data.name, setup.data.seed, setup.answers, setup.real_pair) == (
        "chat",
        3,
        "/pair/answers",
        True,
    )


def test_medusa2s_merged_verifier_and_an_explicit_one_win(tmp_path: Path) -> None:
    heads = _run(tmp_path, "/cached", merged=True)
    assert heads_setup(str(heads)).verifier == str(heads.parent / "verifier")
    assert heads_setup(str(heads), verifier="/mine").verifier == "/mine"
    assert heads_setup(str(heads)).answers == "/cached"


def test_heads_without_a_run_config_fall_back_to_the_tiny_pair(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_ROOT", str(tmp_path))
    setup = heads_setup(str(tmp_path / "loose" / "heads"))
    assert setup.verifier == str(tmp_path / "checkpoints" / "tiny" / "verifier")
    assert (setup.dtype, setup.prompt_len, setup.answers, setup.data.name) == ("float32", 64, None, "stdlib")


def test_newest_heads_is_the_last_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTSMITH_ROOT", str(tmp_path))
    assert newest_heads() is None
    for i, experiment in enumerate(("medusa2", "medusa")):
        folder = tmp_path / "checkpoints" / experiment / "run" / "heads"
        folder.mkdir(parents=True)
        os.utime(folder, (i, i))
    assert newest_heads() == str(tmp_path / "checkpoints" / "medusa" / "run" / "heads")
    assert newest_heads("medusa2") == str(tmp_path / "checkpoints" / "medusa2" / "run" / "heads")
