"""The results dictionary (results.json): its schema, how runs are aggregated, how to read and render it.

Per seed the prompts' :class:`~train.decoding.DecodeStats` are pooled and summarised into the metric
contract (docs/evaluation.md); a run's ``metrics`` are mean / std / n over seeds (std undefined, written
null, with one seed), its ``prompt_spread`` the same over every (prompt, seed). The schema is in
docs/evaluation.md. :func:`find_run` and :func:`by_temperature` read one run;
:mod:`train.evaluation.results_table` renders a results dictionary.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from train.decoding import DecodeStats, aggregate, param_count
from train.evaluation.decoder_build import TimedEntry
from train.hardware import load_average

__all__ = [
    "CONTRACT_METRICS",
    "PROMPT_SPREAD_METRICS",
    "RESULTS_SCHEMA",
    "by_temperature",
    "find_run",
    "pool",
    "results_document",
    "run_entry",
    "temperature_key",
    "to_jsonable",
]

RESULTS_SCHEMA = "draftsmith.eval/2"

#: The metric contract's names (docs/evaluation.md), in table order.
CONTRACT_METRICS: tuple[str, ...] = (
    "acceptance_rate",
    "expected_acceptance",
    "block_efficiency",
    "accepted_per_block",
    "per_position_acceptance",
    "simulated_block_efficiency",
    "verifier_tokens_per_call",
    "mbsu",
    "cost_ratio",
    "tokens_per_second",
    "speedup",
)

#: What the autoregressive baseline records per seed.
BASELINE_METRICS: tuple[str, ...] = (
    "tokens_per_second",
    "new_tokens",
    "verifier_calls",
    "wall_time",
    "verifier_time",
    "loop_overhead",
)

#: Per-prompt figures whose spread over (prompt, seed) is reported beside the spread over seeds;
#: ``speedup`` there is each prompt's paired ratio (decoder vs baseline on that prompt).
PAIRED_UNIT_FIELDS: tuple[str, ...] = (
    "seed",
    "prompt",
    "new_tokens",
    "verifier_calls",
    "drafted",
    "accepted",
    "wall_time",
    "ar_new_tokens",
    "ar_wall_time",
)
"""What ``results["runs"][i]["per_prompt"]`` keeps of each (seed, prompt) decode: the counts that pool into
block efficiency, acceptance and tokens/s, and the paired autoregressive decode's, so two drafters (or a
drafter and plain decoding) are compared prompt by prompt (:mod:`train.evaluation.intervals`)."""

PROMPT_SPREAD_METRICS: tuple[str, ...] = (
    "acceptance_rate",
    "block_efficiency",
    "tokens_per_second",
    "speedup",
)


def temperature_key(t: float) -> str:
    """The string key of a temperature in reports: ``0``, ``1``, ``0.7``."""
    return f"{float(t):g}"


def pool(stats: Sequence[DecodeStats]) -> DecodeStats:
    """The element-wise sum of several prompts' stats."""
    pooled = stats[0]
    for s in stats[1:]:
        pooled = pooled.merge(s)
    return pooled


def run_entry(
    entry: TimedEntry,
    decoder_config: Mapping[str, Any],
    temperature: float,
    n_prompts: int,
    per_seed: list[dict[str, Any]],
    per_prompt: list[dict[str, Any]],
    greedy_ties: list[dict[str, Any]],
    greedy_mismatches: list[dict[str, Any]],
) -> dict[str, Any]:
    """One ``results["runs"]`` entry for a drafter under a decoder (``entry``) from its per-seed summaries
    and per-(prompt, seed) figures. ``lossless`` is False when the decoder's output does not follow the
    verifier's distribution at this temperature (a lossy acceptance rule, whose decoder says
    ``lossless = False``, above temperature 0); tables then mark the decoder ``(lossy)``."""
    settings = {k: v for k, v in decoder_config.items() if k != "_target_"}
    gamma = settings.get("gamma")
    lossless = temperature == 0.0 or bool(getattr(entry.decoder, "lossless", True))
    return {
        "drafter": str(entry.drafter),
        "decoder": entry.label,
        "decoder_config": dict(decoder_config),
        "gamma": gamma if isinstance(gamma, int) else None,
        "temperature": temperature,
        "lossless": lossless,
        "n_prompts": n_prompts,
        "seeds": [s["seed"] for s in per_seed],
        "metrics": aggregate(
            {k: v for k, v in s.items() if k not in ("seed", "prompt_speedup")} for s in per_seed
        ),
        "greedy_match": (not greedy_mismatches) if temperature == 0.0 else None,
        "greedy_ties": greedy_ties,
        "greedy_mismatches": greedy_mismatches,
        "prompt_spread": aggregate({k: p[k] for k in PROMPT_SPREAD_METRICS if k in p} for p in per_prompt),
        "per_prompt": [{k: p[k] for k in PAIRED_UNIT_FIELDS if k in p} for p in per_prompt],
        "per_seed": per_seed,
    }


# ----------------------------------------------------------------------------- reading


def _decoder_for(results: Mapping[str, Any], drafter: str, decoder: str | None, gamma: int | None) -> str:
    runs = [r for r in results["runs"] if r["drafter"] == drafter]
    if not runs:
        known = sorted({r["drafter"] for r in results["runs"]})
        raise KeyError(f"no run for drafter {drafter!r}; drafters: {known}")
    if gamma is not None:
        runs = [r for r in runs if r["gamma"] == gamma]
    labels = list(dict.fromkeys(r["decoder"] for r in runs))
    if decoder is not None:
        if decoder not in labels:
            raise KeyError(
                f"no run for drafter {drafter!r} with decoder {decoder!r} (gamma={gamma}); decoders: {labels}"
            )
        return decoder
    if len(labels) != 1:
        message = f"drafter {drafter!r} ran with {len(labels)} decoders {labels} (gamma={gamma})"
        raise ValueError(f"{message}; pass decoder= one of them")
    return labels[0]


def find_run(
    results: Mapping[str, Any],
    drafter: str,
    temperature: float,
    decoder: str | None = None,
    *,
    gamma: int | None = None,
) -> dict[str, Any]:
    """The ``results["runs"]`` entry of ``drafter`` x ``decoder`` (a label) at ``temperature``.

    decoder None: the drafter's only decoder (among those with ``gamma``, when given); ValueError if
    several, KeyError if none.
    """
    label = _decoder_for(results, drafter, decoder, gamma)
    for run in results["runs"]:
        if (
            run["drafter"] == drafter
            and run["decoder"] == label
            and float(run["temperature"]) == float(temperature)
        ):
            return dict(run)
    raise KeyError(f"no run for drafter={drafter!r} decoder={label!r} temperature={temperature}")


def by_temperature(
    results: Mapping[str, Any], drafter: str, decoder: str | None = None, *, gamma: int | None = None
) -> dict[str, dict[str, Any]]:
    """{temperature key ("0", "1"): {metric: {"mean", "std", "n"}, ..., "n_prompts", "n_seeds", "gamma",
    "decoder", "greedy_match"}} for one drafter and decoder (None: its only one).

    The metric contract per temperature: what a training run's ``report.json`` holds per drafter.
    """
    label = _decoder_for(results, drafter, decoder, gamma)
    out: dict[str, dict[str, Any]] = {}
    for t in results["config"]["temperatures"]:
        run = find_run(results, drafter, t, label)
        entry = {k: run["metrics"][k] for k in CONTRACT_METRICS if k in run["metrics"]}
        entry.update(
            n_prompts=run["n_prompts"],
            n_seeds=len(run["seeds"]),
            gamma=run["gamma"],
            decoder=run["decoder"],
            greedy_match=run["greedy_match"],
        )
        out[temperature_key(t)] = entry
    return out


def to_jsonable(value: Any) -> Any:
    """A copy with NaN/inf as None (null), so results.json is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    return value


def results_document(
    verifier: torch.nn.Module,
    drafters: Mapping[str, torch.nn.Module],
    prompts: Sequence[torch.Tensor],
    cfg: Any,
    eos: list[int],
    order: Sequence[str],
    baseline: Mapping[float, list[dict[str, Any]]],
    runs: list[dict[str, Any]],
) -> dict[str, Any]:
    """The results dictionary of one evaluation (results.json; schema in docs/evaluation.md): the runs
    (:func:`run_entry`), the baseline's figures per temperature and seed, and what they were measured on
    (the config, the timing order, the machine, the models, the prompts)."""
    v_params = param_count(verifier)
    lengths = [p.shape[1] for p in prompts]
    return {
        "schema": RESULTS_SCHEMA,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": asdict(cfg),
        "decoders": cfg.decoder_configs,
        "eos_token_ids": eos,
        "timing": {
            "paired": True,
            "order": list(order),
            "rotation": "prompt i runs the entries starting with entry i mod n",
        },
        "environment": {
            # other work on the machine slows whichever decodes run beside it: the 1-minute load average
            # when the decoding ended (os.getloadavg; a 2-core machine above 2 was shared)
            "load_average_1min": load_average(),
            "device": str(next(verifier.parameters()).device),
            "dtype": str(next(verifier.parameters()).dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "models": {
            "verifier": {"name": _model_name(verifier), "params": v_params},
            "drafters": {
                name: {"name": _model_name(d), "params": param_count(d), "c_param": param_count(d) / v_params}
                for name, d in drafters.items()
            },
        },
        "prompts": {
            "n": len(prompts),
            "min_len": min(lengths),
            "max_len": max(lengths),
            "mean_len": sum(lengths) / len(lengths),
        },
        "baseline": [
            {
                "decoder": "ar",
                "temperature": t,
                "n_prompts": len(prompts),
                "seeds": list(cfg.seeds),
                "metrics": _aggregate_rows(seeds),
                "per_seed": seeds,
            }
            for t, seeds in baseline.items()
        ],
        "runs": runs,
    }


def _model_name(model: torch.nn.Module) -> str | None:
    name = getattr(model, "name_or_path", None) or getattr(
        getattr(model, "config", None), "_name_or_path", None
    )
    return str(name) if name else None


def _aggregate_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return aggregate({k: v for k, v in r.items() if k != "seed"} for r in rows)
