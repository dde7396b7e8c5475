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

import json
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from hydra.utils import get_object, instantiate

from train.config import ConfigError, renamed_targets
from train.decoding import (
    AutoregressiveDecoder,
    DecodeStats,
    SamplingParams,
    aggregate,
    model_device,
    param_count,
    speedup,
    summarize,
)
from train.evaluation.eval_config import EvalConfig, build_eval_config
from train.evaluation.greedy import GreedyMismatchError, classify_difference
from train.evaluation.plots import plot_results
from train.evaluation.results import (
    BASELINE_METRICS,
    RESULTS_SCHEMA,
    pool,
    results_table,
    run_entry,
    temperature_key,
    to_jsonable,
)
from train.evaluation.tracking import log_results
from train.models.draft_vocab import with_draft_vocab
from train.tables import format_value

log = logging.getLogger(__name__)

__all__ = [
    "Generation",
    "build_decoders",
    "decoder_kinds",
    "drafter_kind",
    "evaluate_drafters",
    "write_outputs",
]


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


@dataclass
class _Entry:
    """One thing timed per prompt: the baseline (drafter None) or a drafter under a decoder."""

    drafter: str | None
    label: str
    decoder: Any

    @property
    def name(self) -> str:
        return "ar" if self.drafter is None else f"{self.drafter}/{self.label}"


def drafter_kind(obj: Any) -> str:
    """What kind of drafter a drafter is: ``model`` (a second language model, the default), ``heads``
    (prediction heads on the verifier) or ``steered`` (a model with its SD^2 steering module), from its
    ``drafter_kind`` attribute."""
    return str(getattr(obj, "drafter_kind", "model"))


def accepted_kinds(obj: Any) -> tuple[str, ...]:
    """The kinds of drafter a decoder class takes: its ``drafter_kinds``, else its one ``drafter_kind``."""
    kinds = getattr(obj, "drafter_kinds", None)
    return tuple(str(k) for k in kinds) if kinds else (drafter_kind(obj),)


def _config_kinds(settings: dict[str, Any]) -> tuple[str, ...]:
    """The kinds of drafter a decoder config's class takes, read from the class itself: nothing the
    config names (n-gram models, steering modules, rescoring LMs) is loaded to find it out."""
    return accepted_kinds(get_object(settings["_target_"]))


def decoder_kinds(cfg: EvalConfig) -> dict[str, tuple[str, ...]]:
    """{label: the kinds of drafter that decoder config takes} (:func:`accepted_kinds`)."""
    return {label: _config_kinds(settings) for label, settings in cfg.decoder_configs.items()}


def build_decoders(verifier: torch.nn.Module, drafter: torch.nn.Module, cfg: EvalConfig) -> dict[str, Any]:
    """{label: decoder} for one drafter: each decoder config that takes this kind of drafter
    (:func:`drafter_kind` among :func:`accepted_kinds`), its partial called ``factory(verifier, drafter)``."""
    out = {}
    for label, settings in cfg.decoder_configs.items():
        if drafter_kind(drafter) not in _config_kinds(settings):
            continue
        try:
            factory = instantiate(renamed_targets({**settings, "_partial_": True}))
            place_loaded_modules(factory.keywords.values(), drafter)
            # a drafter with a reduced vocabulary (config.draft_vocab) drafts over it only
            out[label] = factory(
                verifier, with_draft_vocab(drafter) if drafter_kind(drafter) == "model" else drafter
            )
        except (TypeError, ValueError) as err:
            raise ConfigError(f"eval.decoders[{label}]: {err}") from None
    return out


def place_loaded_modules(objects: Any, drafter: torch.nn.Module) -> None:
    """Put the modules a decoder config loads (an SD^2 steering module, a BPD rescoring LM held by its
    refiner) on the drafter's device: they load on the CPU, and left there they would run every block
    on the CPU beside models on a GPU."""
    device = model_device(drafter)
    for obj in objects:
        for candidate in (obj, *getattr(obj, "__dict__", {}).values()):
            if isinstance(candidate, torch.nn.Module):
                candidate.to(device)


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


def _model_name(model: torch.nn.Module) -> str | None:
    name = getattr(model, "name_or_path", None) or getattr(
        getattr(model, "config", None), "_name_or_path", None
    )
    return str(name) if name else None


class _Progress:
    """One rich progress bar over every generation; silent when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
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
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
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
    entries: list[_Entry],
    prompt: torch.Tensor,
    index: int,
    params: SamplingParams,
    cfg: EvalConfig,
    eos: list[int],
    seed: int,
    progress: _Progress,
) -> list[tuple[DecodeStats, list[int]]]:
    """Every entry on one prompt, back to back, starting with entry ``index mod n``; results in entry order."""
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
    decoder_configs = cfg.decoder_configs
    entries = [_Entry(None, "ar", AutoregressiveDecoder(verifier))]
    for name, drafter in drafters.items():
        entries += [_Entry(name, label, dec) for label, dec in build_decoders(verifier, drafter, cfg).items()]
    if len(entries) == 1:
        kinds = sorted({drafter_kind(d) for d in drafters.values()})
        raise ConfigError(
            f"eval.decoders: none of {list(decoder_configs)} takes the drafters given ({kinds}); "
            "`heads` (Medusa) need decoding=medusa, a drafter model needs sd or a tree decoder"
        )
    if cfg.warmup:
        warm = prompts[0][:, : min(prompts[0].shape[1], 8)]
        for entry in entries:
            entry.decoder.generate(warm, max_new_tokens=min(4, cfg.max_new_tokens), params=SamplingParams())

    baseline: dict[float, list[dict[str, Any]]] = {t: [] for t in cfg.temperatures}
    per_seed: dict[tuple[int, float], list[dict[str, Any]]] = {}
    per_prompt: dict[tuple[int, float], list[dict[str, Any]]] = {}
    ties: dict[tuple[int, float], list[dict[str, Any]]] = {}
    mismatches: dict[tuple[int, float], list[dict[str, Any]]] = {}
    total = len(cfg.temperatures) * len(cfg.seeds) * len(prompts) * len(entries)
    with _Progress(total, cfg.progress) as progress:
        for t in cfg.temperatures:
            params = cfg.sampling_params(t)
            for seed in cfg.seeds:
                progress.describe(f"T={temperature_key(t)} seed={seed}")
                outcome = [
                    _run_prompt(entries, p, i, params, cfg, eos, seed, progress)
                    for i, p in enumerate(prompts)
                ]
                if on_output is not None:
                    for i, per_entry in enumerate(outcome):
                        for entry, (_, tokens) in zip(entries, per_entry, strict=True):
                            on_output(Generation(entry.drafter, entry.label, t, seed, i, tokens))
                ar_stats = [o[0][0] for o in outcome]
                ar_tokens = [o[0][1] for o in outcome]
                ar_summary = summarize(pool(ar_stats))
                baseline[t].append({"seed": seed, **{k: ar_summary[k] for k in BASELINE_METRICS}})
                ar_tps = float(ar_summary["tokens_per_second"])  # type: ignore[arg-type]
                for e in range(1, len(entries)):
                    entry, key = entries[e], (e, t)
                    stats = [o[e][0] for o in outcome]
                    summary = summarize(pool(stats), c_param[str(entry.drafter)])
                    summary["speedup"] = speedup(float(summary["tokens_per_second"]), ar_tps)  # type: ignore[arg-type]
                    pairs = [_prompt_speedup(s, a) for s, a in zip(stats, ar_stats, strict=True)]
                    per_prompt.setdefault(key, []).extend(
                        {**summarize(s), "speedup": pair} for s, pair in zip(stats, pairs, strict=True)
                    )
                    from_prompts = {"prompt_speedup": _aggregate_one(pairs)}
                    per_seed.setdefault(key, []).append({"seed": seed, **summary, **from_prompts})
                    if t == 0.0:
                        _check_greedy(
                            verifier,
                            entry,
                            prompts,
                            ar_tokens,
                            [o[e][1] for o in outcome],
                            seed,
                            cfg,
                            ties.setdefault(key, []),
                            mismatches.setdefault(key, []),
                        )

    runs = [
        run_entry(
            str(entries[e].drafter),
            entries[e].label,
            decoder_configs[entries[e].label],
            t,
            len(prompts),
            seeds,
            per_prompt[(e, t)],
            ties.get((e, t), []),
            mismatches.get((e, t), []),
            lossless=t == 0.0 or bool(getattr(entries[e].decoder, "lossless", True)),
        )
        for (e, t), seeds in per_seed.items()
    ]
    lengths = [p.shape[1] for p in prompts]
    return {
        "schema": RESULTS_SCHEMA,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": asdict(cfg),
        "decoders": decoder_configs,
        "eos_token_ids": eos,
        "timing": {
            "paired": True,
            "order": [entry.name for entry in entries],
            "rotation": "prompt i runs the entries starting with entry i mod n",
        },
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
                "metrics": _aggregate_rows(seeds),
                "per_seed": seeds,
            }
            for t, seeds in baseline.items()
        ],
        "runs": runs,
    }


def _aggregate_one(values: list[float]) -> dict[str, Any]:
    return aggregate({"v": v} for v in values)["v"]


def _aggregate_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return aggregate({k: v for k, v in r.items() if k != "seed"} for r in rows)


def _check_greedy(
    verifier: torch.nn.Module,
    entry: _Entry,
    prompts: list[torch.Tensor],
    reference: list[list[int]],
    outputs: list[list[int]],
    seed: int,
    cfg: EvalConfig,
    ties: list[dict[str, Any]],
    mismatches: list[dict[str, Any]],
) -> None:
    """Compare one entry's temperature-0 outputs with the baseline's; record ties, raise or record the rest."""
    found = []
    for i, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        record = classify_difference(verifier, prompts[i], ref, out, cfg.tie_ulps)
        if record is not None:
            found.append({"seed": seed, "prompt": i, **record})
    for rec in found:
        where = (
            f"{entry.label} with drafter {entry.drafter!r}, seed {seed}, prompt {rec['prompt']}, "
            f"new token {rec['position']}: greedy token {rec['tokens'][0]} vs decoder token {rec['tokens'][1]}"
        )
        if rec["tie"]:
            ties.append(rec)
            # expected in bfloat16 (recorded in results.json as greedy_ties): the log file, not the terminal
            log.info(
                "low-precision tie at temperature 0 (%s; float32 margin %s ulp)", where, rec["margin_ulps"]
            )
            continue
        mismatches.append(rec)
        margin = (
            ""
            if rec["margin_ulps"] is None
            else f", float32 margin {format_value(rec['margin_ulps'], 1)} ulp > {format_value(cfg.tie_ulps, 1)}"
        )
        msg = (
            f"temperature-0 output differs from the verifier's greedy output ({where}{margin}); "
            f"{sum(1 for r in found if not r['tie'])} of {len(prompts)} prompts differ"
        )
        if cfg.strict_greedy:
            raise GreedyMismatchError(msg)
        log.warning(msg)


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
