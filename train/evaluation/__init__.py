"""Evaluation runs: drafters x decoders x temperatures x seeds over one prompt set (docs/evaluation.md).

One concern per module: ``eval_config`` (:class:`EvalConfig`, decoder configs, :func:`build_eval_config`),
``prompts`` (:func:`build_prompts`), ``runner`` (:func:`evaluate_drafters`, the paired timing loop),
``greedy`` (the temperature-0 check and low-precision ties), ``results`` (the results dictionary: schema,
aggregation, :func:`find_run`, :func:`by_temperature`), ``results_table`` (its Markdown rendering),
``intervals``, ``plots``, ``outputs``, ``tracking`` (loggers, W&B), ``leaderboard``, ``task_metrics``.
"""

from train.evaluation.decoder_build import build_decoders
from train.evaluation.eval_config import (
    EvalConfig,
    build_eval_config,
    known_decoder_configs,
    load_decoder_config,
)
from train.evaluation.greedy import GreedyMismatchError
from train.evaluation.outputs import write_outputs
from train.evaluation.plots import plot_results
from train.evaluation.prompts import build_prompts
from train.evaluation.results import (
    CONTRACT_METRICS,
    RESULTS_SCHEMA,
    by_temperature,
    find_run,
    temperature_key,
    to_jsonable,
)
from train.evaluation.results_table import METRIC_LEGEND, results_table, slower_than_baseline
from train.evaluation.runner import Generation, evaluate_drafters
from train.evaluation.tracking import log_results, scalar_metrics
from train.tables import format_metric

__all__ = [
    "METRIC_LEGEND",
    "slower_than_baseline",
    "CONTRACT_METRICS",
    "RESULTS_SCHEMA",
    "EvalConfig",
    "GreedyMismatchError",
    "build_decoders",
    "build_eval_config",
    "build_prompts",
    "by_temperature",
    "Generation",
    "evaluate_drafters",
    "find_run",
    "format_metric",
    "known_decoder_configs",
    "load_decoder_config",
    "log_results",
    "plot_results",
    "results_table",
    "scalar_metrics",
    "temperature_key",
    "to_jsonable",
    "write_outputs",
]
