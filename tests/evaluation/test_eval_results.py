"""Reading the results: the legend and the explanation of a speedup below 1."""

from __future__ import annotations

from train.evaluation import METRIC_LEGEND, results_table, slower_than_baseline


def _metric(mean: float) -> dict:
    return {"mean": mean, "std": 0.01, "n": 2}


def _results(speedup: float) -> dict:
    metrics = {
        "speedup": _metric(speedup),
        "block_efficiency": _metric(1.64),
        "cost_ratio": _metric(0.25),
        "drafter_calls_per_verifier_call": _metric(4.0),
    }
    run = {"drafter": "before", "decoder": "sd@g4", "gamma": 4, "temperature": 0.0, "metrics": metrics}
    return {"runs": [run], "config": {"seeds": [0, 1]}, "prompts": {"n": 8}, "baseline": []}


def test_a_speedup_below_one_is_explained_from_the_runs_own_figures():
    (line,) = slower_than_baseline(_results(0.67))
    assert "speedup 0.67 < 1, slower than the verifier alone" in line
    # a block runs 4 drafter steps at 0.25 of a verifier step: break-even needs tau > 1 + 0.25 * 4 = 2
    assert "tau > 2.00 to break even; measured tau 1.64" in line
    assert slower_than_baseline(_results(1.2)) == []
    table = results_table(_results(0.67))
    assert "Slower than decoding without a drafter" in table and line in table
    assert METRIC_LEGEND in table and "below 1 means slower" in METRIC_LEGEND


def test_with_measured_step_costs_the_break_even_counts_the_check_and_the_bound_is_shown():
    results = _results(0.67)
    run = results["runs"][0]
    run["metrics"]["verifier_tokens_per_call"] = _metric(2.5)
    run["metrics"]["speedup_bound"] = _metric(1.12)
    # a check of 2 tokens costs 1.6 steps, of 3 tokens 1.8: 2.5 tokens (interpolated) 1.7
    results["step_costs"] = {"before": {"verify": [0.1, 0.16, 0.18, 0.2], "draft": 0.025}}
    results["environment"] = {"dtype": "float32", "torch_threads": 2}
    (line,) = slower_than_baseline(results)
    assert "checks 2.5 tokens at 1.70 verifier steps" in line
    assert "tau > 2.70 to break even; measured tau 1.64" in line  # 1.7 + 0.25 * 4
    assert "best fixed draft length would have reached 1.12x" in line
    table = results_table(results)
    assert "Step costs measured on this machine" in table and "float32, 2 threads" in table
    assert "100/160/180/200 ms (1.00/1.60/1.80/2.00 one-token steps)" in table
    assert "drafter step 25.0 ms (0.250 of a verifier step)" in table
    assert "speedup_bound" in table
