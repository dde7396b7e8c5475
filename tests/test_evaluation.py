"""Evaluation runs: the metric contract over seeds, the greedy check, outputs, loggers, bad config."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from tests.conftest import tiny_llama
from train.config import ConfigError
from train.evaluation import (
    CONTRACT_METRICS,
    EvalConfig,
    GreedyMismatchError,
    by_temperature,
    evaluate_drafters,
    find_run,
    results_table,
    scalar_metrics,
)

GAMMA = 4
# 3 blocks of gamma + 1 tokens: with a perfect drafter every block is full, so tau is exactly gamma + 1.
NEW_TOKENS = 3 * (GAMMA + 1)


@pytest.fixture(autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def verifier():
    return tiny_llama(hidden=32, seed=0)


@pytest.fixture(scope="module")
def drafter():
    return tiny_llama(hidden=32, seed=1)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (1, n), generator=g) for n in (5, 9, 12)]


def _cfg(**kw) -> EvalConfig:
    base = dict(temperatures=[0.0], gammas=[GAMMA], seeds=[0, 1], max_new_tokens=NEW_TOKENS, progress=False)
    return EvalConfig(**{**base, **kw})


def test_perfect_drafter_accepts_everything(verifier, prompts, tmp_path):
    results = evaluate_drafters(
        verifier, {"copy": copy.deepcopy(verifier)}, prompts, _cfg(), eos_token_id=None, out_dir=tmp_path
    )
    run = find_run(results, "copy", 0.0, GAMMA)
    m = run["metrics"]
    assert m["acceptance_rate"]["mean"] == 1.0
    assert m["block_efficiency"]["mean"] == GAMMA + 1
    assert m["accepted_per_block"]["mean"] == GAMMA
    assert m["per_position_acceptance"]["mean"] == [1.0] * GAMMA
    assert m["simulated_block_efficiency"]["mean"] == GAMMA + 1
    assert m["block_efficiency"] == {"mean": GAMMA + 1, "std": 0.0, "n": 2}
    assert run["greedy_match"] is True and run["n_prompts"] == 3
    assert math.isclose(m["mbsu"]["mean"], (GAMMA + 1) / (GAMMA + 1))  # c_param = 1 for a copy
    assert results["models"]["drafters"]["copy"]["c_param"] == 1.0
    for key in CONTRACT_METRICS:
        assert set(m[key]) == {"mean", "std", "n"}, key
    assert len(run["per_seed"]) == 2 and {s["seed"] for s in run["per_seed"]} == {0, 1}

    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["schema"] == "draftsmith.eval/1"
    for key in ("config", "environment", "models", "prompts", "baseline", "runs", "elapsed_seconds", "files"):
        assert key in on_disk, key
    assert on_disk["baseline"][0]["decoder"] == "ar"
    assert on_disk["baseline"][0]["metrics"]["tokens_per_second"]["n"] == 2
    assert on_disk["files"]["plots"] == ["block_efficiency_vs_gamma.png", "per_position_acceptance.png"]
    for name in on_disk["files"]["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "results.md").read_text()
    assert "| copy | sd | 0 | 4 | 1.000 ± 0.000 |" in table


def test_temperatures_gammas_and_reading_helpers(verifier, drafter, prompts):
    cfg = _cfg(temperatures=[0.0, 1.0], gammas=[1, 2], max_new_tokens=8, seeds=[0, 1], warmup=False)
    results = evaluate_drafters(verifier, {"a": drafter, "b": drafter}, prompts, cfg, eos_token_id=257)
    assert len(results["runs"]) == 2 * 2 * 2
    assert [b["temperature"] for b in results["baseline"]] == [0.0, 1.0]
    for run in results["runs"]:
        m = run["metrics"]
        assert 1.0 <= m["block_efficiency"]["mean"] <= run["gamma"] + 1
        assert 0.0 <= m["acceptance_rate"]["mean"] <= 1.0
        assert len(m["per_position_acceptance"]["mean"]) == run["gamma"]
        assert m["speedup"]["n"] == 2 and m["speedup"]["mean"] > 0
        assert run["greedy_match"] is (True if run["temperature"] == 0.0 else None)
    report = by_temperature(results, "a", gamma=2)
    assert set(report) == {"0", "1"}
    assert report["1"]["gamma"] == 2 and report["0"]["greedy_match"] is True
    assert set(CONTRACT_METRICS) <= set(report["0"])
    scalars = scalar_metrics(results)
    assert "eval/a/sd/T0/gamma2/block_efficiency" in scalars and "eval/ar/T1/tokens_per_second" in scalars
    assert results_table(results).count("\n| a | sd |") == 4
    with pytest.raises(KeyError):
        find_run(results, "a", 0.5)


def test_sampling_is_reproducible_per_seed(verifier, drafter, prompts):
    cfg = _cfg(temperatures=[1.0], gammas=[2], seeds=[3], max_new_tokens=8, warmup=False)
    runs = [
        evaluate_drafters(verifier, {"d": drafter}, prompts, cfg)["runs"][0]["per_seed"][0] for _ in range(2)
    ]
    for key in ("accepted", "drafted", "new_tokens", "verifier_calls"):
        assert runs[0][key] == runs[1][key], key


def test_greedy_mismatch_fails_loudly(verifier, drafter, prompts, monkeypatch):
    import train.evaluation as evaluation

    real = evaluation.build_decoder

    class Corrupt:
        def __init__(self, inner):
            self.inner = inner

        def generate(self, *args, **kwargs):
            result = self.inner.generate(*args, **kwargs)
            result.tokens = (result.tokens + 1) % 256
            return result

    monkeypatch.setattr(evaluation, "build_decoder", lambda *a, **k: Corrupt(real(*a, **k)))
    cfg = _cfg(max_new_tokens=4, seeds=[0], warmup=False)
    with pytest.raises(GreedyMismatchError, match="differs from the verifier's greedy output on 3 of 3"):
        evaluate_drafters(verifier, {"d": drafter}, prompts, cfg)
    results = evaluate_drafters(
        verifier,
        {"d": drafter},
        prompts,
        _cfg(max_new_tokens=4, seeds=[0], warmup=False, strict_greedy=False),
    )
    assert results["runs"][0]["greedy_match"] is False


def test_loggers_receive_scalars_table_and_images(verifier, drafter, prompts, tmp_path):
    class FakeWandb(WandbLogger):
        def __init__(self):  # no W&B run: record what would be sent
            self.metrics, self.payloads = [], []

        @property
        def experiment(self):
            return type("Run", (), {"log": lambda _, payload: self.payloads.append(payload)})()

        def log_metrics(self, metrics, step=None):
            self.metrics.append((metrics, step))

    wandb_logger = FakeWandb()
    csv_logger = CSVLogger(save_dir=str(tmp_path), name="csv", version="")
    cfg = _cfg(max_new_tokens=4, seeds=[0], warmup=False)
    evaluate_drafters(
        verifier, {"d": drafter}, prompts, cfg, out_dir=tmp_path, loggers=[csv_logger, wandb_logger], step=7
    )
    csv_logger.save()
    assert "eval/d/sd/T0/gamma4/block_efficiency" in (tmp_path / "csv" / "metrics.csv").read_text()
    ((metrics, step),) = wandb_logger.metrics
    assert step == 7 and "eval/ar/T0/tokens_per_second" in metrics
    (payload,) = wandb_logger.payloads
    import wandb

    assert isinstance(payload["eval/results"], wandb.Table)
    assert isinstance(payload["eval/block_efficiency_vs_gamma"], wandb.Image)
    assert isinstance(payload["eval/per_position_acceptance"], wandb.Image)


def test_eval_config_defaults_fit_the_main_job():
    cfg = EvalConfig()
    assert cfg.temperatures == [0.0, 1.0] and cfg.gammas == [4] and cfg.seeds == [0, 1]
    assert cfg.lenience is None and cfg.eps == 1.0 and cfg.decoders == ["sd"]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"gammas": [0]}, "eval.gammas"),
        ({"gammas": []}, "eval.gammas"),
        ({"temperatures": [-0.5]}, "eval.temperatures"),
        ({"seeds": [0, 0]}, "eval.seeds"),
        ({"decoders": ["magic"]}, "eval.decoders"),
        ({"num_prompts": 0}, "eval.num_prompts"),
        ({"prompt_len": 1}, "eval.prompt_len"),
        ({"max_new_tokens": 0}, "eval.max_new_tokens"),
        ({"top_p": 1.5}, "eval.top_p"),
        ({"top_k": -1}, "eval.top_k"),
        ({"lenience": "lax"}, "eval.lenience"),
        ({"eps": 0.0}, "eval.eps"),
        ({"num_threads": 0}, "eval.num_threads"),
    ],
)
def test_bad_eval_config_names_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        EvalConfig(**kwargs)


def test_bad_inputs(verifier, drafter, prompts):
    with pytest.raises(ValueError, match="at least one drafter"):
        evaluate_drafters(verifier, {}, prompts, _cfg())
    with pytest.raises(ValueError, match="at least one prompt"):
        evaluate_drafters(verifier, {"d": drafter}, [], _cfg())
    with pytest.raises(ValueError, match=r"shape \(1, T\)"):
        evaluate_drafters(verifier, {"d": drafter}, [torch.zeros(1, 0, dtype=torch.long)], _cfg())
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        evaluate_drafters(verifier, {"d": drafter}, prompts, _cfg(max_new_tokens=510))
