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
