"""Evaluation runs: drafters x decoders x temperatures x gammas x seeds over one prompt set.

:func:`evaluate_drafters` is the one entry point the training methods and ``scripts/evaluate.py``
share. For every temperature and seed it first runs the autoregressive baseline on the verifier, then
every drafter under every decoder and gamma, all in this process, on the same prompts, so ``speedup``
compares like with like. Per seed, the prompts' :class:`~train.decoding.DecodeStats` are pooled and
summarised into the metric contract (ARCHITECTURE.md); the figures reported are mean / std / n over
seeds. At temperature 0 every speculative output is checked token for token against the verifier's
greedy output (``greedy_match``); a mismatch raises :class:`GreedyMismatchError`.

Outputs (when ``out_dir`` is given): ``results.json`` (schema in docs/evaluation.md), ``results.md``
(the Markdown table), ``block_efficiency_vs_gamma.png`` and ``per_position_acceptance.png``; with a
``WandbLogger`` among ``loggers`` the table and plots also go to W&B, and every logger receives the
scalar means under ``eval/...``.

``main(cfg)`` is the body of ``scripts/evaluate.py`` (conf/eval.yaml).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from train.config import ConfigError, require
from train.decoding import (
    AutoregressiveDecoder,
    DecodeStats,
    SamplingParams,
    SpeculativeDecoder,
    aggregate,
    param_count,
    speedup,
    summarize,
)
from train.decoding.sampling import LENIENCES

log = logging.getLogger(__name__)

__all__ = [
    "CONTRACT_METRICS",
    "DECODERS",
    "RESULTS_SCHEMA",
    "EvalConfig",
    "GreedyMismatchError",
    "build_decoder",
    "build_prompts",
    "by_temperature",
    "evaluate_drafters",
    "find_run",
    "format_metric",
    "log_results",
    "main",
    "plot_results",
    "results_table",
    "scalar_metrics",
    "temperature_key",
    "to_jsonable",
    "write_outputs",
]

RESULTS_SCHEMA = "draftsmith.eval/1"

#: Decoders an evaluation can name in ``eval.decoders``. Tree, blockwise and asynchronous decoders
#: join here with their own keyword arguments in :func:`build_decoder`.
DECODERS: tuple[str, ...] = ("sd",)

#: The metric contract's names (ARCHITECTURE.md), in table order.
CONTRACT_METRICS: tuple[str, ...] = (
    "acceptance_rate",
    "expected_acceptance",
    "block_efficiency",
    "accepted_per_block",
    "per_position_acceptance",
    "simulated_block_efficiency",
    "mbsu",
    "cost_ratio",
    "tokens_per_second",
    "speedup",
)

_BASELINE_METRICS = (
    "tokens_per_second",
    "new_tokens",
    "verifier_calls",
    "wall_time",
    "verifier_time",
    "loop_overhead",
)
_PROMPT_SPREAD_METRICS = ("acceptance_rate", "block_efficiency", "tokens_per_second")


class GreedyMismatchError(RuntimeError):
    """A speculative decoder's output at temperature 0 differs from the verifier's greedy output."""


@dataclass
class EvalConfig:
    """What one evaluation measures (``eval.*`` in conf/eval.yaml). Validated on construction.

    The defaults fit the main DistillSpec job's budget on the embedded tiny pair (two drafters,
    T in {0, 1}, gamma 4, two seeds: 24 s measured on 2 shared CPU cores, docs/evaluation.md).
    """

    #: Sampling temperatures; 0 is greedy and checks ``greedy_match``.
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    #: Draft lengths per block.
    gammas: list[int] = field(default_factory=lambda: [4])
    #: Seeds of the sampling generators; figures are mean / std over them.
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    #: Decoders to run for every drafter (see :data:`DECODERS`).
    decoders: list[str] = field(default_factory=lambda: ["sd"])
    #: Prompts cut from the data config's test split (used by :func:`build_prompts`).
    num_prompts: int = 8
    #: Prompt length in tokens, BOS included.
    prompt_len: int = 64
    #: New tokens per prompt (generation also stops at EOS).
    max_new_tokens: int = 64
    #: Warping applied identically to verifier and drafter; 0 / 1.0 disable top-k / top-p.
    top_k: int = 0
    top_p: float = 1.0
    #: Lossy DistillSpec acceptance (null = lossless); eps = 1 is lossless for every lenience.
    lenience: str | None = None
    eps: float = 1.0
    #: Raise when a temperature-0 output differs from greedy decoding (false: record and warn).
    strict_greedy: bool = True
    #: One short untimed generation per model first, so lazy initialisation is not timed.
    warmup: bool = True
    #: torch intra-op threads during the evaluation, restored afterwards (null: leave torch's setting).
    #: 1 suits small latency-bound models on CPU: with more, OpenMP spin-waiting on a busy machine
    #: slowed the tiny pair's evaluation tenfold (docs/evaluation.md). Set null for large models.
    num_threads: int | None = 1
    #: Progress bar over prompts; plots written next to results.json.
    progress: bool = True
    plots: bool = True

    def __post_init__(self) -> None:
        self.temperatures = [float(t) for t in _as_list(self.temperatures, "eval.temperatures")]
        self.gammas = list(_as_list(self.gammas, "eval.gammas"))
        self.seeds = list(_as_list(self.seeds, "eval.seeds"))
        self.decoders = [str(d) for d in _as_list(self.decoders, "eval.decoders")]
        for t in self.temperatures:
            require(
                math.isfinite(t) and t >= 0,
                "eval.temperatures",
                "finite numbers >= 0 (0 = greedy)",
                self.temperatures,
            )
        require(
            len(set(self.temperatures)) == len(self.temperatures),
            "eval.temperatures",
            "distinct",
            self.temperatures,
        )
        for g in self.gammas:
            require(_is_int(g) and g >= 1, "eval.gammas", "integers >= 1", self.gammas)
        require(len(set(self.gammas)) == len(self.gammas), "eval.gammas", "distinct", self.gammas)
        for s in self.seeds:
            require(_is_int(s) and s >= 0, "eval.seeds", "integers >= 0", self.seeds)
        require(len(set(self.seeds)) == len(self.seeds), "eval.seeds", "distinct", self.seeds)
        for d in self.decoders:
            require(d in DECODERS, "eval.decoders", f"a list of names from {list(DECODERS)}", self.decoders)
        require(
            _is_int(self.num_prompts) and self.num_prompts >= 1,
            "eval.num_prompts",
            "an integer >= 1",
            self.num_prompts,
        )
        require(
            _is_int(self.prompt_len) and self.prompt_len >= 2,
            "eval.prompt_len",
            "an integer >= 2 (BOS + one token)",
            self.prompt_len,
        )
        require(
            _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
            "eval.max_new_tokens",
            "an integer >= 1",
            self.max_new_tokens,
        )
        require(
            _is_int(self.top_k) and self.top_k >= 0, "eval.top_k", "an integer >= 0 (0 = off)", self.top_k
        )
        require(
            isinstance(self.top_p, int | float) and 0 < self.top_p <= 1,
            "eval.top_p",
            "in (0, 1] (1 = off)",
            self.top_p,
        )
        require(
            self.lenience is None or self.lenience in LENIENCES,
            "eval.lenience",
            f"null or one of {sorted(LENIENCES)}",
            self.lenience,
        )
        require(
            isinstance(self.eps, int | float) and 0 < self.eps <= 1,
            "eval.eps",
            "in (0, 1] (1 = lossless)",
            self.eps,
        )
        require(
            self.num_threads is None or (_is_int(self.num_threads) and self.num_threads >= 1),
            "eval.num_threads",
            "null or an integer >= 1",
            self.num_threads,
        )

    def sampling_params(self, temperature: float) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_k=self.top_k, top_p=float(self.top_p))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _as_list(value: Any, key: str) -> list[Any]:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return [value]
    require(
        isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0,
        key,
        "a non-empty list",
        value,
    )
    return list(value)


def temperature_key(t: float) -> str:
    """The string key of a temperature in reports: ``0``, ``1``, ``0.7``."""
    return f"{float(t):g}"


# ----------------------------------------------------------------------------- prompts


def build_prompts(
    tokenizer: Any,
    data: Any = None,
    num_prompts: int = 8,
    prompt_len: int = 64,
    seed: int = 0,
    split: str = "test",
) -> list[torch.Tensor]:
    """Evaluation prompts, each a (1, T) LongTensor starting with BOS, cut from ``data``'s ``split``.

    ``data`` is a :class:`train.data.sources.DataSourceConfig` (None: the embedded stdlib corpus).
    One window of ``prompt_len`` tokens per document at a seeded random offset
    (:func:`train.data.lm.make_prompts`), so the set is the same for a given seed.
    """
    from train.data.lm import make_prompts
    from train.data.sources import DataSourceConfig, load_text_dataset

    data = data if data is not None else DataSourceConfig()
    splits = load_text_dataset(data, tokenizer)
    ds = make_prompts(
        splits[split],
        tokenizer,
        prompt_len,
        max_prompts=num_prompts,
        seed=seed,
        continuation_len=None,
        mode="random",
    )
    if len(ds) == 0:
        raise ValueError(
            f"no {split} document of data {data.name!r} holds {prompt_len} tokens; lower eval.prompt_len"
        )
    if len(ds) < num_prompts:
        log.warning("only %d of %d prompts could be cut from the %s split", len(ds), num_prompts, split)
    return [torch.tensor([ids], dtype=torch.long) for ids in ds["input_ids"]]


# ----------------------------------------------------------------------------- running


def build_decoder(
    name: str, verifier: torch.nn.Module, drafter: torch.nn.Module, gamma: int, cfg: EvalConfig
) -> Any:
    """The decoder called ``name`` (one of :data:`DECODERS`) for this verifier/drafter pair."""
    if name == "sd":
        return SpeculativeDecoder(verifier, drafter, gamma=gamma, lenience=cfg.lenience, eps=cfg.eps)
    raise ConfigError(f"eval.decoders: unknown decoder {name!r}; known: {list(DECODERS)}")


def _generator(seed: int, prompt_index: int) -> torch.Generator:
    # One stream per (seed, prompt): a prompt's draws do not depend on which prompts ran before it.
    return torch.Generator().manual_seed(seed * 1_000_003 + prompt_index)


def _normalise_prompts(prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"prompt {i} must be a LongTensor of shape (1, T), got {type(p).__name__}")
        p = p.reshape(1, -1) if p.dim() == 1 else p
        if p.dim() != 2 or p.shape[0] != 1 or p.shape[1] == 0:
            raise ValueError(f"prompt {i} must have shape (1, T) with T >= 1, got {tuple(p.shape)}")
        out.append(p.long())
    return out


def _check_context(models: Mapping[str, torch.nn.Module], longest: int, max_new_tokens: int) -> None:
    for role, model in models.items():
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and longest + max_new_tokens > limit:
            raise ConfigError(
                f"eval.max_new_tokens: the longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) "
                f"exceeds the {role}'s max_position_embeddings ({limit})"
            )


class _Progress:
    """One rich progress bar over every (pass, prompt); silent when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("eval", total=total)

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)


def _run_pass(
    decoder: Any,
    prompts: list[torch.Tensor],
    params: SamplingParams,
    cfg: EvalConfig,
    eos_token_id: Any,
    seed: int,
    progress: _Progress,
) -> tuple[list[DecodeStats], list[list[int]]]:
    stats, tokens = [], []
    for i, prompt in enumerate(prompts):
        result = decoder.generate(
            prompt,
            max_new_tokens=cfg.max_new_tokens,
            params=params,
            eos_token_id=eos_token_id,
            generator=_generator(seed, i),
        )
        stats.append(result.stats)
        tokens.append(result.tokens.tolist())
        progress.advance()
    return stats, tokens


def _pool(stats: list[DecodeStats]) -> DecodeStats:
    pooled = stats[0]
    for s in stats[1:]:
        pooled = pooled.merge(s)
    return pooled


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _model_name(model: torch.nn.Module) -> str | None:
    name = getattr(model, "name_or_path", None) or getattr(
        getattr(model, "config", None), "_name_or_path", None
    )
    return str(name) if name else None


def evaluate_drafters(
    verifier: torch.nn.Module,
    drafters: Mapping[str, torch.nn.Module],
    prompts: Sequence[torch.Tensor],
    cfg: EvalConfig | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    loggers: Sequence[Any] | None = None,
    step: int | None = None,
) -> dict[str, Any]:
    """Evaluate every drafter against ``verifier``; return the results dictionary (results.json).

    verifier: a causal LM (eval mode is set here; parameters are not changed).
    drafters: {name: causal LM sharing the verifier's tokenizer}, e.g. ``{"before": d0, "after": d1}``.
    prompts: LongTensors of shape (1, T) (or (T,)), e.g. from :func:`build_prompts`.
    cfg: :class:`EvalConfig` (None: the defaults). eos_token_id: stops generation (included in output).
    out_dir: where results.json, results.md and the plots go (None: nothing is written).
    loggers: Lightning loggers; each gets the ``eval/...`` scalar means at ``step``, a ``WandbLogger``
    also the table and the plots.

    Read the figures with :func:`find_run` / :func:`by_temperature`; render them with
    :func:`results_table`. Raises :class:`GreedyMismatchError` when a temperature-0 output differs
    from greedy decoding (unless ``cfg.strict_greedy`` is false).
    """
    cfg = cfg or EvalConfig()
    if not drafters:
        raise ValueError("drafters must name at least one drafter model")
    prompt_list = _normalise_prompts(prompts)
    _check_context(
        {"verifier": verifier, **{f"drafter {n!r}": m for n, m in drafters.items()}},
        max(p.shape[1] for p in prompt_list),
        cfg.max_new_tokens,
    )
    started = time.perf_counter()
    threads_before = torch.get_num_threads()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    models = [verifier, *drafters.values()]
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        results = _evaluate(verifier, dict(drafters), prompt_list, cfg, eos_token_id)
    finally:
        for m, mode in zip(models, modes, strict=True):
            m.train(mode)
        torch.set_num_threads(threads_before)
    results["elapsed_seconds"] = time.perf_counter() - started
    if out_dir is not None:
        write_outputs(results, out_dir, plots=cfg.plots)
    if loggers:
        log_results(results, loggers, out_dir=out_dir, step=step)
    return results


def _evaluate(
    verifier: torch.nn.Module,
    drafters: dict[str, torch.nn.Module],
    prompts: list[torch.Tensor],
    cfg: EvalConfig,
    eos_token_id: Any,
) -> dict[str, Any]:
    v_params = param_count(verifier)
    c_param = {name: param_count(d) / v_params for name, d in drafters.items()}
    ar = AutoregressiveDecoder(verifier)
    decoders = {
        (name, dec, g): build_decoder(dec, verifier, d, g, cfg)
        for name, d in drafters.items()
        for dec in cfg.decoders
        for g in cfg.gammas
    }
    if cfg.warmup:
        warm = prompts[0][:, : min(prompts[0].shape[1], 8)]
        for decoder in [ar, *decoders.values()]:
            decoder.generate(warm, max_new_tokens=min(4, cfg.max_new_tokens), params=SamplingParams())

    n_passes = len(cfg.temperatures) * len(cfg.seeds) * (1 + len(decoders))
    baseline_seeds: dict[float, list[dict[str, Any]]] = {t: [] for t in cfg.temperatures}
    per_seed: dict[tuple[str, str, float, int], list[dict[str, Any]]] = {}
    per_prompt: dict[tuple[str, str, float, int], list[dict[str, Any]]] = {}
    mismatches: dict[tuple[str, str, float, int], list[int]] = {}
    with _Progress(n_passes * len(prompts), cfg.progress) as progress:
        for t in cfg.temperatures:
            params = cfg.sampling_params(t)
            for seed in cfg.seeds:
                progress.describe(f"ar T={temperature_key(t)} seed={seed}")
                ar_stats, ar_tokens = _run_pass(ar, prompts, params, cfg, eos_token_id, seed, progress)
                ar_summary = summarize(_pool(ar_stats))
                baseline_seeds[t].append({"seed": seed, **{k: ar_summary[k] for k in _BASELINE_METRICS}})
                ar_tps = float(ar_summary["tokens_per_second"])  # type: ignore[arg-type]
                for (name, dec, g), decoder in decoders.items():
                    key = (name, dec, t, g)
                    progress.describe(f"{dec} {name} T={temperature_key(t)} gamma={g} seed={seed}")
                    stats, tokens = _run_pass(decoder, prompts, params, cfg, eos_token_id, seed, progress)
                    summary = summarize(_pool(stats), c_param[name])
                    summary["speedup"] = speedup(float(summary["tokens_per_second"]), ar_tps)  # type: ignore[arg-type]
                    per_seed.setdefault(key, []).append({"seed": seed, **summary})
                    per_prompt.setdefault(key, []).extend(summarize(s) for s in stats)
                    if t == 0.0:
                        bad = [i for i, (a, b) in enumerate(zip(tokens, ar_tokens, strict=True)) if a != b]
                        mismatches.setdefault(key, []).extend(bad)
                        if bad:
                            i = bad[0]
                            msg = (
                                f"{dec} with drafter {name!r}, gamma={g}, seed={seed}: temperature-0 output differs "
                                f"from the verifier's greedy output on {len(bad)} of {len(prompts)} prompts "
                                f"(prompt {i}, first at new token {_first_difference(tokens[i], ar_tokens[i])})"
                            )
                            if cfg.strict_greedy:
                                raise GreedyMismatchError(msg)
                            log.warning(msg)

    runs = []
    for (name, dec, t, g), seeds in per_seed.items():
        metrics = aggregate({k: v for k, v in s.items() if k != "seed"} for s in seeds)
        spread = aggregate({k: p[k] for k in _PROMPT_SPREAD_METRICS} for p in per_prompt[(name, dec, t, g)])
        runs.append(
            {
                "drafter": name,
                "decoder": dec,
                "temperature": t,
                "gamma": g,
                "n_prompts": len(prompts),
                "seeds": list(cfg.seeds),
                "greedy_match": (not mismatches[(name, dec, t, g)]) if t == 0.0 else None,
                "metrics": metrics,
                "per_seed": seeds,
                "prompt_spread": spread,
            }
        )
    lengths = [p.shape[1] for p in prompts]
    return {
        "schema": RESULTS_SCHEMA,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": asdict(cfg),
        "environment": {
            "device": str(next(verifier.parameters()).device),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "models": {
            "verifier": {"name": _model_name(verifier), "params": v_params},
            "drafters": {
                name: {"name": _model_name(d), "params": param_count(d), "c_param": c_param[name]}
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
                "metrics": aggregate({k: v for k, v in s.items() if k != "seed"} for s in seeds),
                "per_seed": seeds,
            }
            for t, seeds in baseline_seeds.items()
        ],
        "runs": runs,
    }


# ----------------------------------------------------------------------------- reading results


def find_run(
    results: Mapping[str, Any],
    drafter: str,
    temperature: float,
    gamma: int | None = None,
    decoder: str = "sd",
) -> dict[str, Any]:
    """The run entry of ``results["runs"]`` for this drafter / temperature / gamma (None: the only or first gamma)."""
    for run in results["runs"]:
        if (
            run["drafter"] == drafter
            and run["decoder"] == decoder
            and float(run["temperature"]) == float(temperature)
            and (gamma is None or run["gamma"] == gamma)
        ):
            return dict(run)
    raise KeyError(
        f"no run for drafter={drafter!r} decoder={decoder!r} temperature={temperature} gamma={gamma}"
    )


def by_temperature(
    results: Mapping[str, Any], drafter: str, gamma: int | None = None, decoder: str = "sd"
) -> dict[str, dict[str, Any]]:
    """{temperature key ("0", "1"): {metric: {"mean", "std", "n"}, ..., "n_prompts", "greedy_match", "gamma"}}.

    The metric contract per temperature for one drafter: what a run's ``report.json`` holds under
    ``before`` / ``after``.
    """
    out: dict[str, dict[str, Any]] = {}
    for t in results["config"]["temperatures"]:
        run = find_run(results, drafter, t, gamma, decoder)
        entry = {k: run["metrics"][k] for k in CONTRACT_METRICS if k in run["metrics"]}
        entry.update(
            n_prompts=run["n_prompts"],
            n_seeds=len(run["seeds"]),
            gamma=run["gamma"],
            greedy_match=run["greedy_match"],
        )
        out[temperature_key(t)] = entry
    return out


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def format_metric(metric: Mapping[str, Any] | None, digits: int = 3) -> str:
    """``mean ± std`` of an aggregated metric (``[m1, m2, ...]`` for list-valued ones; n/a when missing)."""
    if not metric:
        return "n/a"
    mean, std = metric.get("mean"), metric.get("std")
    if isinstance(mean, list):
        return "[" + ", ".join(_fmt(m, 2) for m in mean) + "]"
    if std is None or (isinstance(std, float) and math.isnan(std)):
        return _fmt(mean, digits)
    return f"{_fmt(mean, digits)} ± {_fmt(std, digits)}"


_TABLE_COLUMNS = (
    ("acceptance_rate", 3),
    ("expected_acceptance", 3),
    ("block_efficiency", 2),
    ("simulated_block_efficiency", 2),
    ("mbsu", 2),
    ("cost_ratio", 3),
    ("tokens_per_second", 0),
    ("speedup", 2),
)


def results_table(results: Mapping[str, Any]) -> str:
    """The Markdown table of a results dictionary: one row per drafter x decoder x temperature x gamma."""
    head = ["drafter", "decoder", "T", "gamma", *(key for key, _ in _TABLE_COLUMNS), "greedy match"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 4 + ["---:"] * len(_TABLE_COLUMNS) + ["---"]) + "|",
    ]
    for run in results["runs"]:
        m = run["metrics"]
        gm = run.get("greedy_match")
        cells = [
            run["drafter"],
            run["decoder"],
            temperature_key(run["temperature"]),
            str(run["gamma"]),
            *(format_metric(m.get(key), digits) for key, digits in _TABLE_COLUMNS),
            "n/a" if gm is None else ("yes" if gm else "**NO**"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    base = ", ".join(
        f"T={temperature_key(b['temperature'])}: {format_metric(b['metrics'].get('tokens_per_second'), 0)} tok/s"
        for b in results.get("baseline", [])
    )
    n_prompts = results.get("prompts", {}).get("n", "?")
    seeds = results.get("config", {}).get("seeds", [])
    max_new = results.get("config", {}).get("max_new_tokens", "?")
    lines += [
        "",
        f"Mean ± std over {len(seeds)} seed{'' if len(seeds) == 1 else 's'}; {n_prompts} prompts, up to {max_new} new tokens each, one at a time. "
        f"Autoregressive baseline (verifier alone, same prompts and run): {base}.",
    ]
    pp = [
        (
            r["drafter"],
            r["decoder"],
            r["temperature"],
            r["gamma"],
            r["metrics"].get("per_position_acceptance"),
        )
        for r in results["runs"]
    ]
    if pp:
        lines += ["", "Per-position acceptance P(draft i accepted | earlier accepted), mean over seeds:", ""]
        lines += [
            f"- {d} ({dec}, T={temperature_key(t)}, gamma={g}): {format_metric(v)}" for d, dec, t, g, v in pp
        ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- outputs


def to_jsonable(value: Any) -> Any:
    """A copy with NaN/inf as None (null), so results.json is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    return value


def write_outputs(
    results: dict[str, Any], out_dir: str | os.PathLike[str], plots: bool = True
) -> dict[str, Any]:
    """Write results.md, the plots and results.json into ``out_dir``; record the file names in ``results["files"]``."""
    os.makedirs(out_dir, exist_ok=True)
    files: dict[str, Any] = {"json": "results.json", "table": "results.md", "plots": []}
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(results_table(results))
    if plots:
        files["plots"] = [os.path.basename(p) for p in plot_results(results, out_dir)]
    results["files"] = files
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(to_jsonable(results), f, indent=2, allow_nan=False)
        f.write("\n")
    return files


def plot_results(results: Mapping[str, Any], out_dir: str | os.PathLike[str]) -> list[str]:
    """Two PNGs: block efficiency vs gamma (per drafter and temperature, with the gamma + 1 ceiling)
    and per-position acceptance (one panel per temperature, a line per drafter and gamma). Colour
    names the drafter (and decoder) in both. Returns their paths."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    runs = list(results["runs"])
    labels = sorted({(r["drafter"], r["decoder"]) for r in runs})
    colour = {lab: f"C{i % 10}" for i, lab in enumerate(labels)}
    temps = sorted({float(r["temperature"]) for r in runs})
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v", "P"]
    gammas = sorted({int(r["gamma"]) for r in runs})
    paths = []

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(
        gammas,
        [g + 1 for g in gammas],
        color="0.5",
        ls="--",
        marker="_",
        ms=18,
        lw=1,
        label="ceiling gamma + 1",
    )
    for lab in labels:
        for ti, t in enumerate(temps):
            pts = sorted(
                (
                    r["gamma"],
                    _nan(r["metrics"]["block_efficiency"]["mean"]),
                    _nan(r["metrics"]["block_efficiency"]["std"]),
                )
                for r in runs
                if (r["drafter"], r["decoder"]) == lab and float(r["temperature"]) == t
            )
            if pts:
                ax.errorbar(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    yerr=[p[2] for p in pts],
                    color=colour[lab],
                    ls=styles[ti % len(styles)],
                    marker=markers[ti % len(markers)],
                    capsize=3,
                    label=f"{lab[0]} ({lab[1]}) T={temperature_key(t)}",
                )
    ax.set_xlabel("gamma (draft tokens per block)")
    ax.set_ylabel("block efficiency tau")
    ax.set_xticks(gammas)
    ax.set_ylim(bottom=0.9)
    ax.set_title("Block efficiency vs gamma (mean ± std over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "block_efficiency_vs_gamma.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(temps), figsize=(4.2 * len(temps) + 0.8, 4.0), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for r in runs:
            pp = r["metrics"].get("per_position_acceptance")
            if float(r["temperature"]) != t or not pp:
                continue
            lab = (r["drafter"], r["decoder"])
            gi = gammas.index(int(r["gamma"]))
            ys = [_nan(v) for v in pp["mean"]]
            ax.errorbar(
                range(1, len(ys) + 1),
                ys,
                yerr=[_nan(v) for v in pp["std"]],
                color=colour[lab],
                ls=styles[gi % len(styles)],
                marker=markers[gi % len(markers)],
                capsize=3,
                label=f"{lab[0]} ({lab[1]}) gamma={r['gamma']}",
            )
        ax.set_title(f"T = {temperature_key(t)}")
        ax.set_xlabel("draft position i")
        ax.set_xticks(range(1, max(gammas) + 1))
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("P(position i accepted | earlier accepted)")
    fig.suptitle("Per-position acceptance (mean ± std over seeds)")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "per_position_acceptance.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _nan(v: Any) -> float:
    return float("nan") if v is None else float(v)


def scalar_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """Flat ``eval/<drafter>/<decoder>/T<t>/gamma<g>/<metric>`` means (and ``eval/ar/T<t>/tokens_per_second``)."""
    out: dict[str, float] = {}
    for r in results["runs"]:
        prefix = f"eval/{r['drafter']}/{r['decoder']}/T{temperature_key(r['temperature'])}/gamma{r['gamma']}"
        for k in CONTRACT_METRICS:
            v = r["metrics"].get(k, {}).get("mean")
            if isinstance(v, int | float) and math.isfinite(v):
                out[f"{prefix}/{k}"] = float(v)
    for b in results.get("baseline", []):
        v = b["metrics"]["tokens_per_second"]["mean"]
        if isinstance(v, int | float) and math.isfinite(v):
            out[f"eval/ar/T{temperature_key(b['temperature'])}/tokens_per_second"] = float(v)
    return out


def log_results(
    results: Mapping[str, Any],
    loggers: Sequence[Any],
    out_dir: str | os.PathLike[str] | None = None,
    step: int | None = None,
) -> None:
    """Scalar means to every logger; to a ``WandbLogger`` also ``eval/results`` (a ``wandb.Table``) and
    the plots in ``out_dir`` as ``wandb.Image``."""
    from lightning.pytorch.loggers import WandbLogger

    scalars = scalar_metrics(results)
    for logger in loggers:
        if scalars:
            logger.log_metrics(scalars, step=step)
        if not isinstance(logger, WandbLogger):
            continue
        import wandb

        columns: list[str | int] = ["drafter", "decoder", "temperature", "gamma", "n_prompts", "greedy_match"]
        columns += [
            f"{k}_{s}" for k in CONTRACT_METRICS if k != "per_position_acceptance" for s in ("mean", "std")
        ]
        rows = []
        for r in results["runs"]:
            row = [
                r["drafter"],
                r["decoder"],
                r["temperature"],
                r["gamma"],
                r["n_prompts"],
                r["greedy_match"],
            ]
            for k in CONTRACT_METRICS:
                if k != "per_position_acceptance":
                    m = r["metrics"].get(k, {})
                    row += [m.get("mean"), m.get("std")]
            rows.append(row)
        payload: dict[str, Any] = {"eval/results": wandb.Table(columns=columns, data=rows)}
        for name in (results.get("files") or {}).get("plots", []):
            if out_dir is not None:
                payload[f"eval/{os.path.splitext(name)[0]}"] = wandb.Image(os.path.join(out_dir, name))
        logger.experiment.log(payload)


# ----------------------------------------------------------------------------- scripts/evaluate.py


def _drafter_label(source: str) -> str:
    """A short table name for a drafter source: ``org/name``, or a run's ``<run>/drafter``."""
    path = os.path.normpath(source)
    base = os.path.basename(path)
    if base == "drafter" and os.path.dirname(path):
        return f"{os.path.basename(os.path.dirname(path))}/drafter"
    return base if os.path.isdir(os.path.expanduser(source)) else source


def main(cfg: Any) -> dict[str, Any]:
    """``scripts/evaluate.py``: validate the whole config, load the pair, evaluate, write the run directory."""
    from omegaconf import OmegaConf

    from train.config import check_model_source
    from train.run import instantiate_group

    OmegaConf.resolve(cfg)
    gamma, gammas = cfg.get("gamma"), cfg.get("gammas")
    if gammas is None:
        require(_is_int(gamma) and gamma >= 1, "gamma", "an integer >= 1", gamma)
        gammas = [gamma]
    cfg.eval.gammas = gammas
    drafter_source = cfg.get("drafter")
    if drafter_source is not None:
        check_model_source("drafter", str(drafter_source))
        cfg.model.drafter = str(drafter_source)
    eval_cfg: EvalConfig = instantiate_group(cfg, "eval")
    paths = instantiate_group(cfg, "paths")
    model_cfg = instantiate_group(cfg, "model")
    data_cfg = instantiate_group(cfg, "data")
    logger_cfg = instantiate_group(cfg, "logger")

    run_dir = paths.run_dir
    os.makedirs(run_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(run_dir, "config.yaml"))
    if model_cfg.tiny is not None:
        from train.models.tiny import ensure_tiny_pair

        ensure_tiny_pair(model_cfg.tiny)
    from train.models.loading import load_pair

    pair = load_pair(model_cfg, freeze_drafter=True)
    name = _drafter_label(str(drafter_source)) if drafter_source is not None else "drafter"
    prompts = build_prompts(
        pair.tokenizer, data_cfg, eval_cfg.num_prompts, eval_cfg.prompt_len, seed=int(cfg.get("seed", 0))
    )
    loggers: list[Any] = []
    if logger_cfg is not None:
        from train.trainer import build_loggers

        config: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        loggers = build_loggers(logger_cfg, run_dir, str(cfg.get("name", "eval")), config=config)
    results = evaluate_drafters(
        pair.verifier,
        {name: pair.drafter},
        prompts,
        eval_cfg,
        eos_token_id=pair.tokenizer.eos_token_id,
        out_dir=run_dir,
        loggers=loggers,
        step=0,
    )
    for logger in loggers:
        logger.finalize("success")
    print(results_table(results))
    print(f"Evaluation written to {run_dir} ({results['elapsed_seconds']:.1f}s)")
    return results
