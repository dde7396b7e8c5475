"""The tiny-pair cache: built on first use, reused when current, rebuilt (with a reason) when stale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import train.pairs.tiny as tiny
from train.pairs.tiny import TinyModelRecipe, TinyPairConfig, ensure_tiny_pair, stale_reason


def micro_recipe(tmp_path: Path, **changes) -> TinyPairConfig:
    spec = dict(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_steps=2, lr=1e-3)
    fields = dict(
        out_dir=str(tmp_path / "tiny"),
        corpus_dir=str(tmp_path / "corpus"),
        verifier=TinyModelRecipe(**spec),
        drafter=TinyModelRecipe(**spec | {"hidden_size": 8, "train_fraction": 0.3}),
        vocab_size=300,
        seq_len=64,
        batch_size=2,
        val_blocks=2,
    )
    return TinyPairConfig(**(fields | changes))


@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record builds instead of training (the real build is covered by the slow main-job test)."""
    calls: list[str] = []

    def build(cfg: TinyPairConfig, trainer_cfg=None) -> dict:
        calls.append(cfg.recipe_hash())
        out = Path(cfg.out_dir)
        for role in ("verifier", "drafter"):
            (out / role).mkdir(parents=True, exist_ok=True)
            (out / role / "config.json").write_text("{}")
        manifest = {"recipe_hash": cfg.recipe_hash()}
        (out / tiny.MANIFEST).write_text(json.dumps(manifest))
        return manifest

    monkeypatch.setattr(tiny, "build_tiny_pair", build)
    return calls


def test_built_on_first_use_then_reused(tmp_path: Path, fake_build: list[str]) -> None:
    cfg = micro_recipe(tmp_path)
    assert "no tiny pair" in (stale_reason(cfg) or "")
    ensure_tiny_pair(cfg)
    ensure_tiny_pair(cfg)
    assert len(fake_build) == 1
    assert stale_reason(cfg) is None


def test_changed_recipe_rebuilds_with_a_reason(
    tmp_path: Path, fake_build: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    ensure_tiny_pair(micro_recipe(tmp_path))
    changed = micro_recipe(tmp_path, seq_len=32)
    assert "another recipe" in (stale_reason(changed) or "")
    with caplog.at_level("WARNING"):
        ensure_tiny_pair(changed)
    assert len(fake_build) == 2 and "model.tiny.* changed" in caplog.text


def test_missing_model_folder_is_stale(tmp_path: Path, fake_build: list[str]) -> None:
    cfg = micro_recipe(tmp_path)
    ensure_tiny_pair(cfg)
    (Path(cfg.out_dir) / "drafter" / "config.json").unlink()
    assert "lacks its drafter" in (stale_reason(cfg) or "")


def test_recipe_hash_ignores_locations(tmp_path: Path) -> None:
    a = micro_recipe(tmp_path)
    b = micro_recipe(tmp_path / "elsewhere")
    assert a.recipe_hash() == b.recipe_hash()


def test_real_micro_build(tmp_path: Path) -> None:
    """A whole (micro) build: corpus, tokenizer, both models, manifest with the reported figures."""
    manifest = tiny.build_tiny_pair(micro_recipe(tmp_path))
    out = Path(tmp_path / "tiny")
    assert json.loads((out / tiny.MANIFEST).read_text())["recipe_hash"] == manifest["recipe_hash"]
    for role in ("verifier", "drafter"):
        assert (out / role / "model.safetensors").is_file() and (out / role / "tokenizer.json").is_file()
    metrics = manifest["metrics"]
    assert metrics["verifier_perplexity"] > 1 and metrics["drafter_perplexity"] > 1
    assert 0 < metrics["expected_acceptance"] <= 1
    assert manifest["parameters"]["verifier"] > manifest["parameters"]["drafter"]
    assert "expected acceptance" in tiny.format_report(manifest)


def test_the_builder_trains_on_this_ranks_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any rank may win the build lock: rank 3 builds on GPU 3, not on GPU 0 (rank 0's). CUDA is faked
    and the trainer recorded, so nothing trains."""
    import torch
    from datasets import Dataset

    from tests.conftest import tiny_llama
    from train.config import TrainerConfig

    class Built(Exception):
        pass

    def trainer(**kwargs):
        raise Built(kwargs["devices"])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(tiny.L, "Trainer", trainer)
    monkeypatch.setenv("LOCAL_RANK", "3")
    cfg = micro_recipe(tmp_path)
    blocks = Dataset.from_dict({"input_ids": [[1] * 8] * 4})
    gpu = TrainerConfig(accelerator="gpu")
    with pytest.raises(Built) as built:
        tiny._fit(tiny_llama(hidden=16), cfg.verifier, cfg, blocks, gpu, str(tmp_path), "verifier")
    assert built.value.args[0] == [3]
