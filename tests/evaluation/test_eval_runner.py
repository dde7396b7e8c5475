"""evaluate_drafters: the metric contract over seeds, paired timing order, n = 1, EOS ids, outputs."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import train.evaluation.runner as runner
from tests.evaluation import fakes
from tests.evaluation.fakes import RecordingDecoder, inline
from train.config import ConfigError
from train.decoding import AutoregressiveDecoder
from train.evaluation import (
    CONTRACT_METRICS,
    EvalConfig,
    by_temperature,
    evaluate_drafters,
    find_run,
    results_table,
)
from train.evaluation.decoder_build import build_decoders
from train.evaluation.eval_config import load_decoder_config
from train.evaluation.eval_progress import progress_line

GAMMA = 4
# 3 blocks of gamma + 1 tokens: with a perfect drafter every block is full, so tau is exactly gamma + 1.
NEW_TOKENS = 3 * (GAMMA + 1)


def _cfg(**kw) -> EvalConfig:
    base = dict(temperatures=[0.0], seeds=[0, 1], max_new_tokens=NEW_TOKENS, progress=False, plots=False)
    return EvalConfig(**{**base, **kw})


def test_perfect_drafter_accepts_everything(verifier, prompts, tmp_path):
    # a gamma-4 chain every block: a drafter that costs what the verifier costs never pays for its drafts,
    # so sd's plain-step gate (plain_steps: auto) would rightly decode it as plain steps
    sd = {**load_decoder_config("sd"), "plain_steps": "never", "fallback_cut": False}
    results = evaluate_drafters(
        verifier,
        {"copy": copy.deepcopy(verifier)},
        prompts,
        _cfg(plots=True, decoders=[sd]),
        out_dir=tmp_path,
    )
    run = find_run(results, "copy", 0.0)
    m = run["metrics"]
    assert run["decoder"] == "sd" and run["gamma"] == GAMMA
    assert run["decoder_config"] == {
        "_target_": "train.decoding.SpeculativeDecoder",
        "gamma": 4,
        "lenience": None,
        "eps": 1.0,
        "confidence_threshold": 0.0,
        "lookup_tokens": 0,
        "lookup_max_ngram": 3,
        "lookup_min_ngram": 2,
        "plain_steps": "never",
        "fallback_cut": False,
    }
    assert m["acceptance_rate"]["mean"] == 1.0
    assert m["block_efficiency"] == {"mean": GAMMA + 1, "std": 0.0, "n": 2}
    assert m["accepted_per_block"]["mean"] == GAMMA
    assert m["per_position_acceptance"]["mean"] == [1.0] * GAMMA
    assert m["verifier_tokens_per_call"]["mean"] > 1
    assert math.isclose(m["mbsu"]["mean"], (GAMMA + 1) / (GAMMA + 1))  # c_param = 1 for a copy
    assert run["greedy_match"] is True and run["greedy_ties"] == [] and run["n_prompts"] == 3
    for key in CONTRACT_METRICS:
        assert set(m[key]) == {"mean", "std", "n"}, key
    assert len(run["per_seed"]) == 2 and {s["seed"] for s in run["per_seed"]} == {0, 1}
    # spread over (prompt, seed) beside the spread over seeds, speedup as per-prompt pairs
    assert run["prompt_spread"]["speedup"]["n"] == 3 * 2
    assert run["prompt_spread"]["block_efficiency"]["mean"] == GAMMA + 1

    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["schema"] == "draftsmith.eval/2"
    for key in (
        "config",
        "decoders",
        "timing",
        "environment",
        "models",
        "prompts",
        "baseline",
        "runs",
        "files",
    ):
        assert key in on_disk, key
    assert on_disk["timing"]["order"] == ["ar", "copy/sd"]
    # One gamma: bars, not a one-column curve over gamma (a gamma sweep gets the curve: tests/scripts).
    assert on_disk["files"]["plots"] == ["block_efficiency.png", "per_position_acceptance.png"]
    for name in on_disk["files"]["plots"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "results.md").read_text()
    assert "| copy | sd | 4 | 0 | 1.000 ± 0.000 |" in table and "Spread over prompts" in table


def test_several_decoders_temperatures_and_reading_helpers(verifier, drafter, prompts):
    cfg = _cfg(temperatures=[0.0, 1.0], decoders=["sd", "sd_g2"], max_new_tokens=6, warmup=False)
    results = evaluate_drafters(verifier, {"a": drafter, "b": drafter}, prompts, cfg, eos_token_id=257)
    assert len(results["runs"]) == 2 * 2 * 2
    assert [b["temperature"] for b in results["baseline"]] == [0.0, 1.0]
    for run in results["runs"]:
        m = run["metrics"]
        assert 1.0 <= m["block_efficiency"]["mean"] <= run["gamma"] + 1
        assert m["speedup"]["n"] == 2 and m["speedup"]["mean"] > 0
        assert run["greedy_match"] is (True if run["temperature"] == 0.0 else None)
    report = by_temperature(results, "a", "sd_g2")
    assert set(report) == {"0", "1"} and report["1"]["gamma"] == 2 and report["1"]["decoder"] == "sd_g2"
    assert report["0"]["greedy_match"] is True and set(CONTRACT_METRICS) <= set(report["0"])
    assert by_temperature(results, "a", gamma=4)["0"]["decoder"] == "sd"
    with pytest.raises(ValueError, match="pass decoder="):
        by_temperature(results, "a")  # two decoders: ambiguous
    with pytest.raises(KeyError):
        find_run(results, "a", 0.5, "sd")
    table = results_table(results)
    assert table.count("\n| a | sd | 4 |") == 2 and table.count("\n| a | sd_g2 | 2 |") == 2


def test_paired_timing_rotates_the_order_per_prompt(verifier, monkeypatch):
    class RecordingAR(AutoregressiveDecoder):
        def generate(self, input_ids, *args, **kwargs):
            fakes.CALLS.append(("ar", int(input_ids.shape[-1]), kwargs.get("eos_token_id")))
            return super().generate(input_ids, *args, **kwargs)

    monkeypatch.setattr(runner, "AutoregressiveDecoder", RecordingAR)
    fakes.CALLS.clear()
    prompts = [torch.full((1, n), 7) for n in (3, 4, 5, 6)]
    cfg = _cfg(
        decoders=[inline(RecordingDecoder, "x", tag="x"), inline(RecordingDecoder, "y", tag="y")],
        seeds=[0],
        max_new_tokens=2,
        warmup=False,
    )
    results = evaluate_drafters(verifier, {"d": verifier}, prompts, cfg)
    order = [(tag, n) for tag, n, _ in fakes.CALLS]
    # prompt i runs back to back, starting with entry i mod 3 of [ar, x, y]
    assert order == [
        ("ar", 3), ("x", 3), ("y", 3),
        ("x", 4), ("y", 4), ("ar", 4),
        ("y", 5), ("ar", 5), ("x", 5),
        ("ar", 6), ("x", 6), ("y", 6),
    ]  # fmt: skip
    assert results["timing"]["order"] == ["ar", "d/x", "d/y"]
    run = find_run(results, "d", 0.0, "x")
    assert run["gamma"] is None and run["decoder_config"] == {
        "_target_": "tests.evaluation.fakes.RecordingDecoder",
        "tag": "x",
    }
    assert run["prompt_spread"]["speedup"]["n"] == 4


def test_single_seed_has_undefined_std(verifier, drafter, prompts, tmp_path):
    results = evaluate_drafters(
        verifier, {"d": drafter}, prompts, _cfg(seeds=[0], max_new_tokens=4, warmup=False), out_dir=tmp_path
    )
    m = results["runs"][0]["metrics"]
    assert m["block_efficiency"]["n"] == 1 and math.isnan(m["block_efficiency"]["std"])
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["runs"][0]["metrics"]["block_efficiency"]["std"] is None
    assert on_disk["baseline"][0]["metrics"]["tokens_per_second"]["std"] is None
    assert "(n=1)" in (tmp_path / "results.md").read_text()


def test_every_eos_id_reaches_the_decoders(verifier, prompts):
    fakes.CALLS.clear()
    cfg = _cfg(decoders=[inline(RecordingDecoder, "rec")], seeds=[0], max_new_tokens=2, warmup=False)
    results = evaluate_drafters(verifier, {"d": verifier}, prompts, cfg, eos_token_id=[258, 257, 258])
    assert results["eos_token_ids"] == [257, 258]
    assert [eos for _, _, eos in fakes.CALLS] == [[257, 258]] * len(prompts)


def test_sampling_is_reproducible_per_seed(verifier, drafter, prompts):
    cfg = _cfg(temperatures=[1.0], decoders=["sd_g2"], seeds=[3], max_new_tokens=6, warmup=False)
    runs = [
        evaluate_drafters(verifier, {"d": drafter}, prompts, cfg)["runs"][0]["per_seed"][0] for _ in range(2)
    ]
    for key in ("accepted", "drafted", "new_tokens", "verifier_calls"):
        assert runs[0][key] == runs[1][key], key


def test_on_output_hands_out_every_timed_generation(verifier, drafter, prompts):
    """Every (entry, temperature, seed, prompt) once, warm-ups excluded, with the new tokens only; at
    T = 0 the speculative decoder's tokens are the baseline's."""
    got = []
    cfg = _cfg(temperatures=[0.0, 1.0], decoders=["sd_g2"], seeds=[0, 1], max_new_tokens=6)
    evaluate_drafters(verifier, {"d": drafter}, prompts, cfg, on_output=got.append)
    keys = [(g.drafter, g.decoder, g.temperature, g.seed, g.prompt_index) for g in got]
    expected = {
        (d, label, t, seed, i)
        for d, label in ((None, "ar"), ("d", "sd_g2"))
        for t in (0.0, 1.0)
        for seed in (0, 1)
        for i in range(len(prompts))
    }
    assert len(keys) == len(expected) and set(keys) == expected
    assert all(0 < len(g.tokens) <= 6 for g in got)
    tokens = {k: g.tokens for k, g in zip(keys, got, strict=True)}
    for seed in (0, 1):
        for i in range(len(prompts)):
            assert tokens[(None, "ar", 0.0, seed, i)] == tokens[("d", "sd_g2", 0.0, seed, i)]


def test_bad_inputs(verifier, drafter, prompts):
    with pytest.raises(ValueError, match="at least one drafter"):
        evaluate_drafters(verifier, {}, prompts, _cfg())
    with pytest.raises(ValueError, match="at least one prompt"):
        evaluate_drafters(verifier, {"d": drafter}, [], _cfg())
    with pytest.raises(ValueError, match=r"shape \(1, T\)"):
        evaluate_drafters(verifier, {"d": drafter}, [torch.zeros(1, 0, dtype=torch.long)], _cfg())
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        evaluate_drafters(verifier, {"d": drafter}, prompts, _cfg(max_new_tokens=510))
    with pytest.raises(ConfigError, match=r"eval\.decoders: unknown decoder config"):
        evaluate_drafters(verifier, {"d": drafter}, prompts, {"decoders": ["nope"]})


def test_modules_a_decoder_config_loads_sit_with_the_drafter(verifier):
    """A steering module or a refiner's rescoring LM that a decoder config loads (on the CPU) is moved
    to the drafter's device, not left on the CPU beside models on a GPU."""
    linear = {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2}
    cfg = _cfg(
        decoders=[
            inline(
                fakes.HoldingDecoder,
                "held",
                steering=linear,
                refiner={"_target_": "types.SimpleNamespace", "lm": linear, "k": 3},
            )
        ]
    )
    drafter = torch.nn.Linear(2, 2).to("meta")
    (decoder,) = build_decoders(verifier, drafter, cfg).values()
    assert decoder.loaded["steering"].weight.device.type == "meta"
    assert decoder.loaded["refiner"].lm.weight.device.type == "meta"
    assert decoder.loaded["refiner"].k == 3


def test_a_log_file_gets_plain_progress_lines(verifier, prompts, capsys, monkeypatch):
    """Off a terminal (CI, a log file) a live bar prints nothing until it ends: plain lines instead, at
    most one per tenth, the last one at the total."""
    for forcing in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):  # rich's "treat it as a terminal"
        monkeypatch.delenv(forcing, raising=False)
    evaluate_drafters(verifier, {"copy": copy.deepcopy(verifier)}, prompts, _cfg(progress=True))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    total = 2 * len(prompts) * 2  # two seeds x the prompts x (plain decoding, sd)
    assert 1 < len(lines) <= 10
    assert lines[0].startswith("eval T=0 seed=0: ")
    assert lines[-1].startswith(f"eval T=0 seed=1: {total}/{total} generations, ")
    assert "min left" in lines[-1]


def test_the_progress_line_estimates_what_is_left_from_the_rate_so_far():
    assert progress_line("T=1 seed=2", 30, 120, 600.0) == (
        "eval T=1 seed=2: 30/120 generations, 10 min elapsed, about 30 min left"
    )
