"""Paired ratios with bootstrap intervals (train/evaluation/intervals.py) and the report's tables of them."""

from __future__ import annotations

import random

import pytest

from train.evaluation.intervals import bootstrap_ratio, describe, paired_ratios, speedup_interval


def _units(rate: float, calls_per_token: float, n: int, seed: int, noise: float = 0.0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for prompt in range(n):
        tokens = 40.0 + prompt
        seconds = tokens / rate * (1 + noise * rng.uniform(-1, 1))
        out.append(
            {
                "seed": 0,
                "prompt": prompt,
                "new_tokens": tokens,
                "verifier_calls": tokens * calls_per_token,
                "drafted": tokens,
                "accepted": tokens * 0.5,
                "wall_time": seconds,
                "ar_new_tokens": tokens,
                "ar_wall_time": tokens / 10.0,
            }
        )
    return out


def test_paired_ratios_are_ratios_of_pooled_sums_on_the_same_units() -> None:
    after = _units(rate=15.0, calls_per_token=0.5, n=12, seed=0)  # block efficiency 2
    before = _units(rate=10.0, calls_per_token=0.8, n=12, seed=1)  # block efficiency 1.25
    figures = paired_ratios(after, before)
    assert figures["block_efficiency"]["ratio"] == pytest.approx(2.0 / 1.25)
    assert figures["tokens_per_second"]["ratio"] == pytest.approx(1.5)
    assert figures["acceptance_rate"]["ratio"] == pytest.approx(1.0)
    for f in figures.values():  # noiseless units: a degenerate interval at the ratio
        assert f["low"] == pytest.approx(f["ratio"]) and f["high"] == pytest.approx(f["ratio"])
    # only units both sides decoded count, matched by (seed, prompt): drop one of before's
    for i, unit in enumerate(after):
        unit["verifier_calls"] = unit["new_tokens"] * (0.3 + 0.05 * i)  # block efficiency varies by prompt
    subset = paired_ratios(after, before[1:])["block_efficiency"]
    expected = paired_ratios(after[1:], before[1:])["block_efficiency"]["ratio"]
    assert subset["units"] == 11 and subset["ratio"] == pytest.approx(expected)


def test_the_interval_covers_the_true_ratio_and_excludes_one_when_the_gain_is_real() -> None:
    after = _units(rate=11.0, calls_per_token=0.5, n=16, seed=2, noise=0.2)
    before = _units(rate=10.0, calls_per_token=0.5, n=16, seed=3, noise=0.2)
    tps = paired_ratios(after, before)["tokens_per_second"]
    assert tps["low"] < 1.1 < tps["high"]
    clear = paired_ratios(_units(13.0, 0.5, 16, 4, 0.05), _units(10.0, 0.5, 16, 5, 0.05))["tokens_per_second"]
    assert clear["low"] > 1.0


def test_the_median_of_unit_ratios_ignores_a_slow_burst() -> None:
    """One decode slowed ten-fold by other work moves the pooled ratio, not the median per unit."""
    after = _units(rate=12.0, calls_per_token=0.5, n=9, seed=0)
    before = _units(rate=10.0, calls_per_token=0.5, n=9, seed=0)
    after[4]["wall_time"] *= 10
    tps = paired_ratios(after, before)["tokens_per_second"]
    assert tps["ratio"] < 1.0
    assert tps["median_unit_ratio"] == pytest.approx(1.2)


def test_speedup_interval_pairs_each_decode_with_its_autoregressive_one() -> None:
    units = _units(rate=15.0, calls_per_token=0.5, n=6, seed=0)
    assert speedup_interval(units)["ratio"] == pytest.approx(1.5)
    assert speedup_interval([{k: v for k, v in u.items() if not k.startswith("ar_")} for u in units]) == {}
    assert describe(speedup_interval(units)) == "1.50x [1.50, 1.50]"
    assert describe({}) == "-"


def test_bootstrap_is_seeded_and_ordered() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 10.0]

    def mean(idx):
        return sum(values[i] for i in idx) / len(idx)

    first = bootstrap_ratio(len(values), mean, resamples=500, seed=7)
    assert first == bootstrap_ratio(len(values), mean, resamples=500, seed=7)
    assert first[0] < sum(values) / 5 < first[1]
