"""research.pairs: what the benchmarks and research scripts decode with, for a pair folder and a heads run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

import research.pairs as pair_setup_module
from research.pairs import (
    conf_data,
    heads_setup,
    load_pair,
    newest_eagle3,
    newest_heads,
    pair_setup,
    random_pair,
    random_prompts,
)
from tests.conftest import make_tokenizer, tiny_llama


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


def _finished(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_the_newest_finished_run_wins_by_its_start_time_across_experiments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule for every "newest run" (train.rundir.newest_artifact): finished (its artifact has a
    config.json), and newest by the run directory's name (its start time), not by file times."""
    monkeypatch.setenv("DRAFTSMITH_ROOT", str(tmp_path))
    checkpoints = tmp_path / "checkpoints"
    assert newest_heads() is None and newest_eagle3() is None
    older = _finished(checkpoints / "medusa2" / "2026-01-01_00-00-00" / "heads")
    newer = _finished(checkpoints / "medusa" / "2026-01-02_00-00-00" / "heads")
    (checkpoints / "medusa" / "2026-01-03_00-00-00" / "heads").mkdir(parents=True)  # unfinished
    os.utime(older, (10**9 * 2, 10**9 * 2))  # touched last: file times do not decide
    os.utime(newer, (0, 0))
    assert newest_heads() == str(newer)
    assert newest_heads("medusa2") == str(older)
    drafter = _finished(checkpoints / "eagle3" / "2026-01-01_00-00-00" / "eagle3")
    assert newest_eagle3() == str(drafter)


def test_a_pair_folder_loads_in_its_setups_dtype_with_its_prompts(tmp_path: Path) -> None:
    tokenizer = make_tokenizer()
    for role, hidden in (("verifier", 64), ("drafter", 32)):
        tiny_llama(hidden=hidden).save_pretrained(tmp_path / role)
        tokenizer.save_pretrained(tmp_path / role)
    setup = pair_setup(str(tmp_path))
    pair = load_pair(setup)
    assert pair.dtype == torch.float32 and pair.verifier.dtype == pair.drafter.dtype == torch.float32
    assert not pair.verifier.training and pair.verifier.config.hidden_size == 64
    assert load_pair(setup, with_drafter=False).drafter is None
    mixed = load_pair(setup, drafter=str(tmp_path / "verifier"))
    assert mixed.drafter.config.hidden_size == 64


def test_the_random_benchmark_pair_and_prompts_are_seeded() -> None:
    a, b = random_pair(vocab=64), random_pair(vocab=64)
    assert torch.equal(a[0].lm_head.weight, b[0].lm_head.weight)
    assert a[0].config.hidden_size == 512 and a[1].config.hidden_size == 128
    prompts = random_prompts(3, length=5, vocab=64)
    assert [p.shape for p in prompts] == [(1, 5)] * 3
    assert all(torch.equal(x, y) for x, y in zip(prompts, random_prompts(3, length=5, vocab=64), strict=True))
