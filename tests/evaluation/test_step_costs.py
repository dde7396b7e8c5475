"""The evaluator's step costs and bound (train/evaluation/step_costs.py)."""

from __future__ import annotations

import pytest

from train.decoding import DecodeStats
from train.decoding.costs import StepCosts
from train.evaluation.step_costs import break_even_tau, run_bound


def test_the_bound_reads_the_runs_acceptance_and_drafter_steps():
    stats = DecodeStats(drafted=20, drafter_calls=22, drafter_prefill_calls=2)
    stats.position_drafted, stats.position_tested, stats.position_accepted = [10, 10], [10, 8], [8, 4]
    costs = StepCosts(verify=(1.0, 1.05, 1.1), draft=0.1)
    # acceptance 0.8, 0.5; one drafter step per draft: n = 1: 1.8 / 1.15; n = 2: 2.2 / 1.3
    assert run_bound(stats, costs) == pytest.approx(2.2 / 1.3)
    stats.drafter_calls = stats.drafter_prefill_calls  # copied drafts only: no drafter cost
    assert run_bound(stats, costs) == pytest.approx(2.2 / 1.1)
    assert run_bound(DecodeStats(), costs) == 1.0  # nothing drafted: plain decoding


def test_break_even_interpolates_the_check():
    costs = {"verify": [0.1, 0.16, 0.18], "draft": 0.0}
    assert break_even_tau(costs, 1.0, 0.0) == pytest.approx(1.0)
    assert break_even_tau(costs, 2.5, 0.2) == pytest.approx(1.7 + 0.2)
