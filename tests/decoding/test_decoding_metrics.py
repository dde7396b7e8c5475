"""Tests for the metric contract functions."""

from __future__ import annotations

import math

import pytest
import torch

from train.decoding import (
    DecodeStats,
    acceptance_rate,
    accepted_per_block,
    aggregate,
    block_efficiency,
    cost_ratio,
    expected_acceptance,
    loop_overhead,
    mbsu,
    param_count,
    per_position_acceptance,
    simulated_block_efficiency,
    speedup,
    summarize,
    tokens_per_second,
    verifier_tokens_per_call,
)


def make_stats() -> DecodeStats:
    return DecodeStats(
        max_draft=3,
        drafted=12,
        accepted=6,
        verifier_calls=4,
        drafter_calls=12,
        new_tokens=10,
        position_drafted=[4, 4, 4],
        position_tested=[4, 3, 2],
        position_accepted=[3, 2, 1],
        tested=9,
        sum_expected_acceptance=4.5,
        wall_time=2.0,
        drafter_time=0.6,
        verifier_time=1.2,
    )


def test_position_lists_grow_with_the_deepest_draft():
    s = DecodeStats(max_draft=2)
    assert s.position_drafted == s.position_tested == s.position_accepted == []
    s.count_depths(drafted=5, tested=3, accepted=2)  # deeper than gamma (a tree, an async block)
    s.count_depths(drafted=1, tested=1, accepted=0)
    assert s.position_drafted == [2, 1, 1, 1, 1]
    assert s.position_tested == [2, 1, 1, 0, 0]
    assert s.position_accepted == [1, 1, 0, 0, 0]
    merged = s.merge(DecodeStats(position_drafted=[1], position_tested=[1], position_accepted=[1]))
    assert merged.position_drafted == [3, 1, 1, 1, 1] and merged.position_accepted == [2, 1, 0, 0, 0]


def test_cost_ratio_leaves_the_prefill_out():
    s = make_stats()
    s.verifier_prefill_calls, s.verifier_prefill_time = 1, 0.6  # the prompt: 0.6 s of the 1.2 s
    s.drafter_prefill_calls, s.drafter_prefill_time = 1, 0.16
    # decoding steps only: drafter 0.44 s / 11 calls, verifier 0.6 s / 3 calls
    assert cost_ratio(s) == pytest.approx((0.44 / 11) / (0.6 / 3))


def test_verifier_tokens_per_call_and_mbsu_use_what_was_run():
    s = make_stats()
    s.verifier_tokens = 14  # e.g. blocks of 4 + 4 + 4 + 2 scored tokens
    assert verifier_tokens_per_call(s) == 3.5
    s.drafter_calls = 8  # fewer drafter steps than gamma * blocks (EOS, short last block)
    assert summarize(s, c_param=0.1)["mbsu"] == pytest.approx(2.5 / (0.1 * 8 / 4 + 1))


def test_basic_metrics():
    s = make_stats()
    assert acceptance_rate(s) == 0.5
    assert expected_acceptance(s) == 0.5
    assert block_efficiency(s) == 2.5
    assert accepted_per_block(s) == 1.5
    assert per_position_acceptance(s) == [0.75, 2 / 3, 0.5]
    assert tokens_per_second(s) == 5.0
    # mean drafter step 0.05 s, mean verifier step 0.3 s
    assert cost_ratio(s) == pytest.approx(0.05 / 0.3)
    assert loop_overhead(s) == pytest.approx(2.0 / 1.8 - 1)
    assert s.forward_time == pytest.approx(1.8)


def test_empty_stats_give_nan_not_errors():
    s = DecodeStats(max_draft=2)
    assert math.isnan(acceptance_rate(s))
    assert math.isnan(block_efficiency(s))
    assert math.isnan(cost_ratio(s))
    assert all(math.isnan(x) for x in per_position_acceptance(s))
    out = summarize(s)
    assert math.isnan(out["simulated_block_efficiency"])


@pytest.mark.parametrize(("a", "gamma"), [(0.0, 4), (0.3, 1), (0.6, 4), (0.9, 7), (0.999999, 3)])
def test_simulated_block_efficiency(a, gamma):
    expected = sum(a**i for i in range(gamma + 1))
    assert simulated_block_efficiency(a, gamma) == pytest.approx(expected)


def test_simulated_block_efficiency_edges():
    assert simulated_block_efficiency(1.0, 4) == 5.0
    assert simulated_block_efficiency(0.0, 4) == 1.0
    with pytest.raises(ValueError):
        simulated_block_efficiency(1.5, 4)
    with pytest.raises(ValueError):
        simulated_block_efficiency(0.5, -1)


def test_mbsu_and_speedup():
    assert mbsu(3.0, 0.1, 5) == pytest.approx(2.0)
    assert mbsu(3.0, 0.0, 5) == 3.0
    assert speedup(30.0, 10.0) == 3.0
    assert math.isnan(speedup(1.0, 0.0))


def test_summarize_contains_contract_names():
    s = make_stats()
    out = summarize(s, c_param=0.1)
    for name in (
        "acceptance_rate",
        "expected_acceptance",
        "block_efficiency",
        "accepted_per_block",
        "per_position_acceptance",
        "simulated_block_efficiency",
        "mbsu",
        "cost_ratio",
        "tokens_per_second",
    ):
        assert name in out
    assert out["mbsu"] == pytest.approx(2.5 / 1.3)
    assert out["simulated_block_efficiency"] == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert "mbsu" not in summarize(s)


def test_merge_adds_counts():
    s = make_stats().merge(make_stats())
    assert s.drafted == 24 and s.new_tokens == 20 and s.position_tested == [8, 6, 4]
    assert acceptance_rate(s) == 0.5
    assert s.wall_time == 4.0


def test_aggregate():
    rows = [
        {"tau": 2.0, "pos": [1.0, 0.5]},
        {"tau": 4.0, "pos": [0.0, float("nan")]},
        {"tau": float("nan"), "pos": [0.5, 0.5]},
    ]
    out = aggregate(rows)
    assert out["tau"]["mean"] == 3.0
    assert out["tau"]["std"] == pytest.approx(math.sqrt(2.0))
    assert out["tau"]["n"] == 2
    assert out["pos"]["mean"] == [0.5, 0.5]
    assert out["pos"]["n"] == [3, 2]
    single = aggregate([{"x": 1.5}])
    assert single["x"]["mean"] == 1.5 and single["x"]["n"] == 1
    assert math.isnan(single["x"]["std"])  # one seed: the spread is undefined, not 0


def test_param_count_counts_tied_once():
    lin = torch.nn.Linear(4, 3)
    assert param_count(lin) == 15
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert param_count(torch.nn.ModuleList([emb, head])) == 40
