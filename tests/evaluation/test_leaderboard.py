"""The leaderboard's table and projection (train/evaluation/leaderboard.py); the orchestration that
trains missing artifacts runs end to end in a slow test (tests/scripts/test_leaderboard_script.py)."""

from __future__ import annotations

import math

import pytest

from train.evaluation import evaluate_drafters
from train.evaluation.leaderboard import leaderboard_markdown, leaderboard_rows, projected_speedup


def test_projection_by_hand():
    # tau 3, 4 drafter calls at c = 0.1, 5 verifier tokens at kappa 0.01: 3 / (0.4 + 1 + 0.04)
    assert projected_speedup(3.0, 4.0, 5.0, 0.1, 0.01) == pytest.approx(3.0 / 1.44)
    assert projected_speedup(1.0, 0.0, 1.0, 0.05) == 1.0  # autoregressive
    assert projected_speedup(2.5, 0.0, 26.0, 0.1, 0.02) == pytest.approx(2.5 / 1.5)  # heads: c irrelevant
    assert math.isnan(projected_speedup(float("nan"), 1.0, 2.0, 0.1))
    with pytest.raises(ValueError):
        projected_speedup(2.0, 1.0, 2.0, -0.1)


@pytest.fixture(scope="module")
def results(verifier, drafter, prompts):
    cfg = {
        "decoders": ["sd"],
        "gammas": [2],
        "temperatures": [0.0, 1.0],
        "seeds": [0, 1],
        "max_new_tokens": 8,
        "progress": False,
        "plots": False,
        "warmup": False,
    }
    return evaluate_drafters(verifier, {"d": drafter}, prompts[:2], cfg)


def test_rows_hold_the_measured_contract_and_a_projection_per_seed(results):
    rows = leaderboard_rows({"tiny": results}, costs=(0.05, 0.1), kappa=0.01)
    assert [(r["decoder"], r["temperature"]) for r in rows] == [
        ("ar", 0.0),
        ("sd@g2", 0.0),
        ("ar", 1.0),
        ("sd@g2", 1.0),
    ]
    sd = rows[1]
    assert sd["n"] == 2 and sd["lossless"] and sd["metrics"]["block_efficiency"]["n"] == 2
    expected = [
        projected_speedup(
            s["block_efficiency"], s["drafter_calls_per_verifier_call"], s["verifier_tokens_per_call"], 0.1
        )
        for s in next(r for r in results["runs"] if r["temperature"] == 0.0)["per_seed"]
    ]
    assert sd["projected"]["c=0.1"]["mean"] == pytest.approx(sum(expected) / 2)
    assert sd["projected"]["c=0.05"]["mean"] > sd["projected"]["c=0.1"]["mean"]
    heads_rows = leaderboard_rows({"tiny": results}, heads_drafters=("d",))
    assert heads_rows[1]["projected"]["c=0.05"]["mean"] == pytest.approx(
        heads_rows[1]["projected"]["c=0.1"]["mean"]
    )


def test_markdown_labels_the_projection_and_gives_one_table_per_temperature(results):
    text = leaderboard_markdown(leaderboard_rows({"tiny": results}))
    assert text.count("### T = ") == 2 and "projected speedup c=0.05" in text
    assert "a model, not a measurement" in text and "| tiny | d | sd@g2 |" in text
