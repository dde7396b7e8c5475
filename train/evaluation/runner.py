"""Evaluation runs: drafters x decoders x temperatures x seeds over one prompt set, timed in pairs.

:func:`evaluate_drafters` is the one entry point the training runs and ``scripts/evaluate.py`` share.
For every temperature and seed, each prompt is decoded by the autoregressive baseline (the verifier
alone) and by every (drafter, decoder) back to back, the order rotated per prompt (prompt i starts
with entry i mod n), so a change of machine load hits every entry alike instead of biasing whichever
ran during it. Per seed, speedup = a decoder's tokens/s over the prompts / the baseline's tokens/s
over the same prompts; each prompt's own ratio (a pair) gives the spread over prompts.

At temperature 0 every output is compared with the baseline's greedy output
(:mod:`train.evaluation.greedy`): a low-precision tie is recorded in ``greedy_ties``, any other
difference raises :class:`~train.evaluation.greedy.GreedyMismatchError` (``eval.strict_greedy``).

With ``out_dir``: ``results.json`` (schema in docs/evaluation.md), ``results.md`` (the table) and
the plots; with ``loggers``: the scalar means, and for W&B the table and plots too.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from train.config import ConfigError
from train.decoding import (
    AutoregressiveDecoder,
    DecodeStats,
    SamplingParams,
    aggregate,
    param_count,
    speedup,
    summarize,
)
from train.decoding.costs import StepCosts
from train.evaluation.decoder_build import TimedEntry, build_decoders, drafter_kind
from train.evaluation.eval_config import EvalConfig, build_eval_config
from train.evaluation.eval_progress import EvalProgress
from train.evaluation.greedy import check_greedy
from train.evaluation.outputs import write_outputs
from train.evaluation.results import (
    BASELINE_METRICS,
    pool,
    results_document,
    run_entry,
    temperature_key,
)
from train.evaluation.step_costs import pair_costs, run_bound
from train.evaluation.tracking import log_results
from train.hardware import idle_cores

log = logging.getLogger(__name__)

__all__ = ["Generation", "evaluate_drafters"]


@dataclass(frozen=True)
class Generation:
    """One timed generation of an evaluation, handed to ``evaluate_drafters(on_output=...)``."""

    drafter: str | None
    """The drafter's name; None for the autoregressive baseline."""
    decoder: str
    """The decoder config's label (``"ar"`` for the baseline)."""
    temperature: float
    seed: int
    prompt_index: int
    tokens: list[int]
    """The new tokens (the prompt not included)."""


def _generator(seed: int, prompt_index: int) -> torch.Generator:
    # One stream per (seed, prompt): a prompt's draws do not depend on which prompts or entries ran before.
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


def _eos_ids(eos_token_id: int | Sequence[int] | None) -> list[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return sorted({int(e) for e in eos_token_id})


def _check_context(models: Mapping[str, torch.nn.Module], longest: int, max_new_tokens: int) -> None:
    for role, model in models.items():
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and longest + max_new_tokens > limit:
            raise ConfigError(
                f"eval.max_new_tokens: the longest prompt ({longest}) + max_new_tokens ({max_new_tokens}) "
                f"exceeds the {role}'s max_position_embeddings ({limit})"
            )


# more than 8 parameters: the evaluator's public entry: the pair, the prompts, the settings, where results
# go
def evaluate_drafters(
    verifier: torch.nn.Module,
    drafters: Mapping[str, torch.nn.Module],
    prompts: Sequence[torch.Tensor],
    cfg: EvalConfig | Mapping[str, Any] | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    loggers: Sequence[Any] | None = None,
    step: int | None = None,
    on_output: Callable[[Generation], None] | None = None,
) -> dict[str, Any]:
    """Evaluate every drafter under every decoder against ``verifier``; return the results (results.json).

    verifier: a causal LM (eval mode is set here; parameters are not changed).
    drafters: {name: drafter model}, e.g. ``{"before": d0, "after": d1}``; each decoder config is
    called ``factory(verifier, drafter)``.
    prompts: LongTensors of shape (1, T) (or (T,)), e.g. from :func:`build_prompts`.
    cfg: an :class:`EvalConfig` or an ``eval`` mapping (None: the defaults).
    eos_token_id: one id or several; generation stops after any of them (included in the output).
    out_dir: where results.json, results.md and the plots go (None: nothing is written).
    loggers: Lightning loggers; each gets the ``eval/...`` scalar means at ``step``, a ``WandbLogger``
    also the table and the plots.
    on_output: called with every timed generation's :class:`Generation` (the warm-up's are not),
    for metrics of the outputs themselves (a task score, a likelihood).

    Read the figures with :func:`find_run` / :func:`by_temperature`; render them with
    :func:`results_table`. Raises :class:`GreedyMismatchError` at a temperature-0 difference from
    greedy decoding that is not a low-precision tie (unless ``cfg.strict_greedy`` is false).
    """
    cfg = build_eval_config(cfg)
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
    if cfg.num_threads == "idle":
        torch.set_num_threads(idle_cores())
    elif cfg.num_threads is not None:
        torch.set_num_threads(int(cfg.num_threads))
    models = [verifier, *drafters.values()]
    modes = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        results = _evaluate(verifier, dict(drafters), prompt_list, cfg, _eos_ids(eos_token_id), on_output)
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


def _run_prompt(
    entries: list[TimedEntry],
    prompt: torch.Tensor,
    index: int,
    params: SamplingParams,
    cfg: EvalConfig,
    eos: list[int],
    seed: int,
    progress: EvalProgress,
) -> list[tuple[DecodeStats, list[int]]]:
    """Every entry on one prompt, back to back, from entry ``index mod n``; results in entry order."""
    n = len(entries)
    out: list[tuple[DecodeStats, list[int]] | None] = [None] * n
    for k in range(n):
        e = (index + k) % n
        result = entries[e].decoder.generate(
            prompt,
            max_new_tokens=cfg.max_new_tokens,
            params=params,
            eos_token_id=eos or None,
            generator=_generator(seed, index),
        )
        out[e] = (result.stats, result.tokens.reshape(-1).tolist())
        progress.advance()
    return [o for o in out if o is not None]


def _prompt_speedup(stats: DecodeStats, ar: DecodeStats) -> float:
    tps = stats.new_tokens / stats.wall_time if stats.wall_time else float("nan")
    ar_tps = ar.new_tokens / ar.wall_time if ar.wall_time else float("nan")
    return speedup(tps, ar_tps)


def _timed_entries(
    verifier: torch.nn.Module, drafters: dict[str, torch.nn.Module], cfg: EvalConfig
) -> list[TimedEntry]:
    """The baseline first, then every drafter under every decoder config that takes it."""
    entries = [TimedEntry(None, "ar", AutoregressiveDecoder(verifier))]
    for name, drafter in drafters.items():
        entries += [
            TimedEntry(name, label, dec) for label, dec in build_decoders(verifier, drafter, cfg).items()
        ]
    if len(entries) == 1:
        kinds = sorted({drafter_kind(d) for d in drafters.values()})
        raise ConfigError(
            f"eval.decoders: none of {list(cfg.decoder_configs)} takes the drafters given ({kinds}); "
            "`heads` (Medusa) need decoding=medusa, a drafter model needs sd or a tree decoder"
        )
    return entries


def _warm_up(entries: list[TimedEntry], prompt: torch.Tensor, max_new_tokens: int) -> None:
    warm = prompt[:, : min(prompt.shape[1], 8)]
    for entry in entries:
        entry.decoder.generate(warm, max_new_tokens=min(4, max_new_tokens), params=SamplingParams())


_Outcome = list[list[tuple[DecodeStats, list[int]]]]
"""One seed's generations: per prompt, per entry (in entry order), the stats and the new tokens."""


def _hand_out(
    on_output: Callable[[Generation], None],
    entries: list[TimedEntry],
    outcome: _Outcome,
    temperature: float,
    seed: int,
) -> None:
    for i, per_entry in enumerate(outcome):
        for entry, (_, tokens) in zip(entries, per_entry, strict=True):
            on_output(Generation(entry.drafter, entry.label, temperature, seed, i, tokens))


@dataclass
class _Tally:
    """What the timing loop gathers: the baseline's per-seed figures by temperature, and every other
    entry's per-seed summaries, per-prompt rows and temperature-0 ties and mismatches by
    (entry index, temperature)."""

    baseline: dict[float, list[dict[str, Any]]]
    per_seed: dict[tuple[int, float], list[dict[str, Any]]] = field(default_factory=dict)
    per_prompt: dict[tuple[int, float], list[dict[str, Any]]] = field(default_factory=dict)
    ties: dict[tuple[int, float], list[dict[str, Any]]] = field(default_factory=dict)
    mismatches: dict[tuple[int, float], list[dict[str, Any]]] = field(default_factory=dict)

    def add_baseline(self, temperature: float, seed: int, stats: list[DecodeStats]) -> float:
        """Record the baseline's figures for one seed; return its tokens/s over the prompts."""
        summary = summarize(pool(stats))
        self.baseline[temperature].append({"seed": seed, **{k: summary[k] for k in BASELINE_METRICS}})
        return float(summary["tokens_per_second"])  # type: ignore[arg-type]

    def add_seed(self, key: tuple[int, float], summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        self.per_prompt.setdefault(key, []).extend(rows)
        self.per_seed.setdefault(key, []).append(summary)

    def add_greedy(
        self, key: tuple[int, float], ties: list[dict[str, Any]], mismatches: list[dict[str, Any]]
    ) -> None:
        """Record one seed's temperature-0 ties and mismatches (:func:`check_greedy`)."""
        self.ties.setdefault(key, []).extend(ties)
        self.mismatches.setdefault(key, []).extend(mismatches)


def _prompt_row(stats: DecodeStats, ar: DecodeStats, pair: float, seed: int, prompt: int) -> dict[str, Any]:
    return {
        **summarize(stats),
        "speedup": pair,
        "seed": seed,
        "prompt": prompt,
        "ar_new_tokens": float(ar.new_tokens),
        "ar_wall_time": ar.wall_time,
    }


def _seed_figures(
    stats: list[DecodeStats],
    ar_stats: list[DecodeStats],
    ar_tps: float,
    c_param: float,
    costs: StepCosts,
    seed: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One entry's figures for one seed: its summary over the prompts (with the prompts' own speedups
    aggregated) and one row per prompt, each paired with the baseline's run of the same prompt."""
    pooled = pool(stats)
    summary = summarize(pooled, c_param)
    summary["speedup_bound"] = run_bound(pooled, costs)
    summary["speedup"] = speedup(float(summary["tokens_per_second"]), ar_tps)  # type: ignore[arg-type]
    pairs = [_prompt_speedup(s, a) for s, a in zip(stats, ar_stats, strict=True)]
    rows = [
        _prompt_row(s, a, pair, seed, i)
        for i, (s, a, pair) in enumerate(zip(stats, ar_stats, pairs, strict=True))
    ]
    return {"seed": seed, **summary, "prompt_speedup": _aggregate_one(pairs)}, rows


def _runs(
    tally: _Tally, entries: list[TimedEntry], decoder_configs: Mapping[str, Any], n_prompts: int
) -> list[dict[str, Any]]:
    """The ``results["runs"]`` entries, one per (drafter, decoder, temperature) in the order timed."""
    return [
        run_entry(
            entries[e],
            decoder_configs[entries[e].label],
            t,
            n_prompts,
            seeds,
            tally.per_prompt[(e, t)],
            tally.ties.get((e, t), []),
            tally.mismatches.get((e, t), []),
        )
        for (e, t), seeds in tally.per_seed.items()
    ]


def _evaluate(
    verifier: torch.nn.Module,
    drafters: dict[str, torch.nn.Module],
    prompts: list[torch.Tensor],
    cfg: EvalConfig,
    eos: list[int],
    on_output: Callable[[Generation], None] | None = None,
) -> dict[str, Any]:
    v_params = param_count(verifier)
    c_param = {name: param_count(d) / v_params for name, d in drafters.items()}
    entries = _timed_entries(verifier, drafters, cfg)
    # what a check and a drafter step cost here, before anything is timed (cached per machine)
    costs = {name: pair_costs(verifier, drafter) for name, drafter in drafters.items()}
    if cfg.warmup:
        _warm_up(entries, prompts[0], cfg.max_new_tokens)

    tally = _Tally({t: [] for t in cfg.temperatures})
    total = len(cfg.temperatures) * len(cfg.seeds) * len(prompts) * len(entries)
    with EvalProgress(total, cfg.progress) as progress:
        for t in cfg.temperatures:
            params = cfg.sampling_params(t)
            for seed in cfg.seeds:
                progress.describe(f"T={temperature_key(t)} seed={seed}")
                outcome = [
                    _run_prompt(entries, p, i, params, cfg, eos, seed, progress)
                    for i, p in enumerate(prompts)
                ]
                if on_output is not None:
                    _hand_out(on_output, entries, outcome, t, seed)
                ar_stats = [o[0][0] for o in outcome]
                ar_tokens = [o[0][1] for o in outcome]
                ar_tps = tally.add_baseline(t, seed, ar_stats)
                for e, entry in enumerate(entries[1:], start=1):
                    name, stats = str(entry.drafter), [o[e][0] for o in outcome]
                    figures = _seed_figures(stats, ar_stats, ar_tps, c_param[name], costs[name], seed)
                    tally.add_seed((e, t), *figures)
                    if t == 0.0:
                        outputs = [o[e][1] for o in outcome]
                        ties, mismatches = check_greedy(
                            verifier, entry, prompts, ar_tokens, outputs, seed, cfg
                        )
                        tally.add_greedy((e, t), ties, mismatches)

    runs = _runs(tally, entries, cfg.decoder_configs, len(prompts))
    order = [entry.name for entry in entries]
    document = results_document(verifier, drafters, prompts, cfg, eos, order, tally.baseline, runs)
    document["step_costs"] = {name: c.to_dict() for name, c in costs.items()}
    return document


def _aggregate_one(values: list[float]) -> dict[str, Any]:
    return aggregate({"v": v} for v in values)["v"]
