"""The shared finish step (train/report.py): export first, evaluation, report.json / report.md, card."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import train.report as report_module
from tests.conftest import make_tokenizer, tiny_llama
from train.evaluation import EvalConfig
from train.methods.distillspec.config import DistillSpecConfig
from train.methods.distillspec.module import DistillSpecModule
from train.report import EvaluationError, Finishable, RunContext, build_report, finish, report_markdown

PROMPTS = [torch.tensor([[256, 10, 20, 30, 40]]), torch.tensor([[256, 50, 60, 70]])]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def module() -> DistillSpecModule:
    cfg = DistillSpecConfig(
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), batch_size=2, num_prompts=2
    )
    return DistillSpecModule(
        tiny_llama(hidden=32, seed=1),
        tiny_llama(hidden=64, seed=0),
        make_tokenizer(),
        cfg,
        pretrained=lambda: tiny_llama(hidden=32, seed=2),
    )


def _run(module: DistillSpecModule, run_dir: Path, eval_cfg: EvalConfig | None) -> dict:
    return finish(
        module,
        module.verifier,
        module.tokenizer,
        RunContext(run_dir, eval_cfg, name="unit", config={"name": "unit", "method": {"divergence": "fkl"}}),
    )


def test_distillspec_implements_the_protocol(module):
    assert isinstance(module, Finishable)
    assert module.reference_drafter == "before"
    assert list(module.drafters_to_evaluate()) == ["before", "after"]
    assert module.report_summary()["method"] == "distillspec"


def test_export_happens_before_evaluation(module, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("evaluator exploded")

    monkeypatch.setattr(report_module, "build_prompts", lambda *a, **k: PROMPTS)
    monkeypatch.setattr(report_module, "evaluate_drafters", broken)
    drafter = tmp_path / "run" / "drafter"
    with pytest.raises(EvaluationError, match="evaluator exploded") as err:
        _run(module, tmp_path / "run", EvalConfig(temperatures=[0.0], seeds=[0], progress=False))
    assert str(drafter) in str(err.value)
    assert isinstance(err.value.__cause__, RuntimeError)
    assert (drafter / "model.safetensors").is_file() and (drafter / "config.json").is_file()
    assert "# unit drafter" in (drafter / "README.md").read_text()  # the card, with the config already
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["drafter_dir"] == str(drafter) and "evaluator exploded" in report["evaluation_error"]


class _Heads(torch.nn.Linear):
    drafter_kind = "heads"


@pytest.mark.parametrize(
    ("device", "drafter_device", "expected"),
    [
        ("meta", None, {"verifier": "meta", "after": "meta", "heads": "meta"}),
        (None, "meta", {"verifier": "cpu", "after": "meta", "heads": "cpu"}),  # heads sit with the verifier
    ],
)
def test_the_evaluation_runs_on_the_device_it_is_given(
    module, tmp_path, monkeypatch, device, drafter_device, expected
):
    """RunContext(device=, drafter_device=): the verifier and the drafters the finish step evaluates
    (reloaded or merged copies, made on the CPU) are placed there before the evaluation."""
    seen: dict[str, str] = {}

    def record(verifier, drafters, *args, **kwargs):
        seen["verifier"] = next(verifier.parameters()).device.type
        seen.update({label: next(d.parameters()).device.type for label, d in drafters.items()})
        raise RuntimeError("recorded")

    monkeypatch.setattr(report_module, "build_prompts", lambda *a, **k: PROMPTS)
    monkeypatch.setattr(report_module, "evaluate_drafters", record)
    monkeypatch.setattr(report_module, "eos_token_ids", lambda *a: [257])
    monkeypatch.setattr(
        module, "drafters_to_evaluate", lambda: {"after": torch.nn.Linear(2, 2), "heads": _Heads(2, 2)}
    )
    with pytest.raises(EvaluationError, match="recorded"):
        finish(
            module,
            module.verifier,
            module.tokenizer,
            RunContext(
                tmp_path / "run",
                EvalConfig(temperatures=[0.0], seeds=[0], progress=False),
                device=device,
                drafter_device=drafter_device,
            ),
        )
    assert seen == expected


def test_no_eval_config_exports_and_reports_without_figures(module, tmp_path):
    report = _run(module, tmp_path, None)
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    assert "drafters" not in report and report["method"]["divergence"] == "fkl"
    assert "No evaluation was run" in (tmp_path / "report.md").read_text()


def test_finish_evaluates_reports_and_refreshes_the_card(module, tmp_path, monkeypatch):
    monkeypatch.setattr(report_module, "build_prompts", lambda *a, **k: PROMPTS)
    cfg = EvalConfig(
        temperatures=[0.0, 1.0],
        gammas=[1, 2],
        seeds=[0],
        max_new_tokens=6,
        progress=False,
        warmup=False,
        plots=False,
    )
    report = _run(module, tmp_path, cfg)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["reference"] == "before" and set(on_disk["drafters"]) == {"before", "after"}
    assert len(on_disk["decoders"]) == 2
    for label in on_disk["decoders"]:
        for t in ("0", "1"):
            before = on_disk["drafters"]["before"][label][t]["block_efficiency"]["mean"]
            after = on_disk["drafters"]["after"][label][t]["block_efficiency"]["mean"]
            assert on_disk["ratios"]["after"][label][t]["block_efficiency"] == pytest.approx(after / before)
    for name in ("before", "after"):
        for t, best in report["best"][name].items():
            speedups = {lb: report["drafters"][name][lb][t]["speedup"]["mean"] for lb in report["decoders"]}
            assert speedups[best["decoder"]] == max(speedups.values()) and best["gamma"] in (1, 2)
    text = (tmp_path / "report.md").read_text()
    assert "## Best measured speedup" in text and "## Ratios to `before`" in text
    assert (tmp_path / "eval" / "results.json").is_file()
    card = (tmp_path / "drafter" / "README.md").read_text()
    assert "| after |" in card and "No evaluation was attached" not in card
    assert (tmp_path / "drafter" / "eval_results.json").is_file()


def _results() -> dict:
    """A hand-made evaluate_drafters result: two gammas, two temperatures, before and after."""
    speed = {("before", 1): 0.6, ("before", 4): 0.5, ("after", 1): 0.7, ("after", 4): 0.9}
    tau = {("before", 1): 1.4, ("before", 4): 1.6, ("after", 1): 1.7, ("after", 4): 2.4}
    runs = []
    for name in ("before", "after"):
        for gamma in (1, 4):
            for t in (0.0, 1.0):
                bump = 0.1 * t
                metrics = {
                    "block_efficiency": {"mean": tau[name, gamma] + bump, "std": 0.0, "n": 2},
                    "accepted_per_block": {"mean": tau[name, gamma] + bump - 1, "std": 0.0, "n": 2},
                    "speedup": {"mean": speed[name, gamma] + bump, "std": 0.01, "n": 2},
                }
                runs.append(
                    {
                        "drafter": name,
                        "decoder": f"sd@g{gamma}",
                        "decoder_config": {"name": "sd", "gamma": gamma},
                        "gamma": gamma,
                        "temperature": t,
                        "n_prompts": 8,
                        "seeds": [0, 1],
                        "metrics": metrics,
                        "greedy_match": True if t == 0.0 else None,
                        "per_seed": [],
                        "prompt_spread": {},
                    }
                )
    return {
        "config": {"temperatures": [0.0, 1.0], "seeds": [0, 1], "max_new_tokens": 64},
        "prompts": {"n": 8},
        "baseline": [],
        "runs": runs,
        "elapsed_seconds": 3.0,
    }


def test_report_names_the_best_gamma_and_the_ratios():
    report = build_report(_results(), reference="before")
    assert report["decoders"] == ["sd@g1", "sd@g4"]
    assert report["best"]["after"]["0"]["decoder"] == "sd@g4" and report["best"]["after"]["0"]["gamma"] == 4
    assert report["best"]["before"]["1"]["decoder"] == "sd@g1"
    ratio = report["ratios"]["after"]["sd@g4"]["0"]
    assert ratio["block_efficiency"] == pytest.approx(2.4 / 1.6)
    assert ratio["speedup"] == pytest.approx(0.9 / 0.5)
    assert "before" not in report["ratios"]
    text = report_markdown(
        {"name": "x", "drafter_dir": "/d", "method": {"method": "distillspec"}, **report}, _results()
    )
    # accepted tokens per block (the SD^2 paper's figure): 1.4 / 0.6
    assert "| after | sd@g4 | 0 | 1.500 | 2.333 | 1.800 |" in text
    assert "| after | 0 | sd@g4 | 4 | 0.90 ± 0.01 | 2.40 ± 0.00 |" in text


def test_report_without_a_reference_has_no_ratios():
    report = build_report(_results(), reference=None)
    assert report["ratios"] == {} and set(report["best"]) == {"before", "after"}


def _mixed_results() -> dict:
    """An EAGLE-3 run's result: the trained drafter ran the ``eagle3`` decoder only, the pair's drafter
    ``sd@g2`` only (no decoder takes both kinds)."""
    runs = []
    for name, decoder, gamma, speed, tau in (
        ("eagle3", "eagle3", 3, 1.3, 2.5),
        ("pair drafter", "sd@g2", 2, 0.9, 1.8),
    ):
        for t in (0.0, 1.0):
            runs.append(
                {
                    "drafter": name,
                    "decoder": decoder,
                    "decoder_config": {"name": decoder.split("@")[0], "gamma": gamma},
                    "gamma": gamma,
                    "temperature": t,
                    "n_prompts": 8,
                    "seeds": [0, 1],
                    "metrics": {
                        "block_efficiency": {"mean": tau - 0.1 * t, "std": 0.0, "n": 2},
                        "accepted_per_block": {"mean": tau - 1 - 0.1 * t, "std": 0.0, "n": 2},
                        "speedup": {"mean": speed - 0.1 * t, "std": 0.0, "n": 2},
                    },
                    "greedy_match": True if t == 0.0 else None,
                    "per_seed": [],
                    "prompt_spread": {},
                }
            )
    return {
        "config": {"temperatures": [0.0, 1.0], "seeds": [0, 1], "max_new_tokens": 64},
        "prompts": {"n": 8},
        "baseline": [],
        "runs": runs,
        "elapsed_seconds": 1.0,
    }


@pytest.mark.parametrize("reference", [None, "pair drafter", "eagle3"])
def test_report_of_drafters_that_ran_different_decoders(reference):
    results = _mixed_results()
    report = build_report(results, reference=reference)
    assert report["decoders"] == ["eagle3", "sd@g2"]
    assert {name: list(per) for name, per in report["drafters"].items()} == {
        "eagle3": ["eagle3"],
        "pair drafter": ["sd@g2"],
    }
    assert set(report["drafters"]["eagle3"]["eagle3"]) == {"0", "1"}
    assert report["drafters"]["eagle3"]["eagle3"]["0"]["speedup"]["mean"] == pytest.approx(1.3)
    assert report["drafters"]["pair drafter"]["sd@g2"]["1"]["block_efficiency"]["mean"] == pytest.approx(1.7)
    assert (
        report["best"]["eagle3"]["0"]["decoder"] == "eagle3" and report["best"]["eagle3"]["0"]["gamma"] == 3
    )
    assert report["best"]["pair drafter"]["1"]["decoder"] == "sd@g2"
    # no decoder in common: nothing to take a ratio of
    other = {"pair drafter": "eagle3", "eagle3": "pair drafter"}.get(reference or "")
    assert report["ratios"] == ({other: {}} if reference else {})
    text = report_markdown(
        {"name": "x", "drafter_dir": "/d", "method": {"method": "eagle3"}, **report}, results
    )
    assert "| eagle3 | 0 | eagle3 | 3 | 1.30 ± 0.00 | 2.50 ± 0.00 |" in text
    assert "| pair drafter | 1 | sd@g2 | 2 | 0.80 ± 0.00 | 1.70 ± 0.00 |" in text
    assert "| eagle3 | sd@g2 |" not in text and "| pair drafter | eagle3 |" not in text
