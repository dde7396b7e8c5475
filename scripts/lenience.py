"""DistillSpec's lossy trade-off: block efficiency and task metrics against the lenience eps.

    python scripts/lenience.py                                  # newest DistillSpec drafter, linear lenience
    python scripts/lenience.py --json /tmp/lenience.json --plot docs/lenience.png
    python scripts/lenience.py --drafter pretrained --leniences linear squared exponential --eps 1 0.3 0.1

Chain speculative decoding (``conf/decoding/sd.yaml``, its gamma) accepts a drafted token x with
probability min(1, f(p(x), eps) / q(x)), f one of ``train.decoding.sampling.LENIENCES`` (linear p/eps,
squared p/eps^2, exponential p^eps); eps = 1 is the lossless rule. Everything runs at T = 1: at T = 0
the verifier's p is one-hot, f(p, eps) is 0 off its argmax and >= 1 on it for every lenience, so a
lenient rule accepts exactly what the greedy rule accepts (the engine verifies greedily there anyway).

Per (lenience, eps), over ``--prompts`` prompts x ``--tokens`` new tokens x ``--seeds``, mean ± std
over seeds:

* block efficiency and acceptance rate: the evaluator's own figures
  (``train.evaluation.evaluate_drafters``, the metric contract of every other report);
* the verifier's mean NLL per generated token at T = 1 (``train.evaluation.task_metrics``): how far
  the output drifts from the verifier's distribution; lossless decoding matches autoregressive
  sampling's, which the ``autoregressive`` row measures on the same prompts and seeds;
* ROUGE-L F1 between the generated token ids and the corpus's true continuation of the prompt.

The true continuation is why the prompts come from ``build_prompts_with_references(...,
continuation_len=--tokens)`` rather than ``build_prompts``: the same corpus test split, seed and
prompt length, but each window must leave room for ``--tokens`` more tokens of its document, so the
prompt set differs from the other evaluations' (those keep no continuation).

The task metrics score the evaluator's own generations (``evaluate_drafters(on_output=...)``), exactly
the samples whose block efficiency is reported; the autoregressive row is the evaluator's baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from train.cli.console import add_device_arguments
from train.data.sources import DataSourceConfig
from train.decoding import SamplingParams, aggregate
from train.decoding.sampling import LENIENCES
from train.evaluation import EvalConfig, Generation, evaluate_drafters, load_decoder_config, to_jsonable
from train.evaluation.prompts import build_prompts_with_references
from train.evaluation.task_metrics import continuation_nll, rouge_l
from train.models.loading import (
    check_same_tokenizer,
    check_vocab_covers_tokenizer,
    drafter_tokenizer_source,
    eos_token_ids,
    load_model,
    load_tokenizer,
)
from train.paths import project_root
from train.rundir import newest_artifact
from train.tables import format_metric, markdown_table

DEFAULT_EPS = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02)
AR_LABEL = "autoregressive"
TASK_METRICS = ("verifier_nll", "rouge_l_f1")
_DEFAULT_PARAMS = SamplingParams()


class Point(NamedTuple):
    """One decoder of the sweep: ``lenience`` None with eps 1 is the lossless rule, eps None is AR."""

    label: str
    lenience: str | None
    eps: float | None


def sweep_points(leniences: Sequence[str], eps_grid: Sequence[float]) -> list[Point]:
    """The autoregressive row, one lossless row (eps = 1 is the same rule for every lenience), then
    each lenience at each eps < 1, largest eps first."""
    points = [Point(AR_LABEL, None, None), Point("sd eps=1", None, 1.0)]
    for lenience in leniences:
        points += [
            Point(f"sd {lenience} eps={eps:g}", lenience, eps)
            for eps in sorted(set(eps_grid), reverse=True)
            if eps != 1.0
        ]
    return points


def decoder_configs(points: Sequence[Point], gamma: int) -> list[dict[str, Any]]:
    """``conf/decoding/sd.yaml`` at ``gamma`` with each point's lenience and eps (the autoregressive
    point is the evaluator's own baseline, not a decoder config)."""
    sd = load_decoder_config("sd")
    return [
        {**sd, "name": pt.label, "gamma": gamma, "lenience": pt.lenience, "eps": pt.eps}
        for pt in points
        if pt.eps is not None
    ]


class OutputCollector:
    """The evaluator's generations by decoder label, seed and prompt (``evaluate_drafters(on_output=...)``);
    the autoregressive baseline's are filed under :data:`AR_LABEL`."""

    def __init__(self, n_prompts: int) -> None:
        self.n_prompts = n_prompts
        self.outputs: dict[str, dict[int, list[list[int] | None]]] = {}

    def __call__(self, generation: Generation) -> None:
        label = AR_LABEL if generation.drafter is None else generation.decoder
        per_seed = self.outputs.setdefault(label, {})
        per_seed.setdefault(generation.seed, [None] * self.n_prompts)[generation.prompt_index] = (
            generation.tokens
        )

    def by_seed(self, label: str, seeds: Sequence[int]) -> dict[int, list[list[int]]]:
        """{seed: [new tokens of prompt i]} of one decoder; every seed and prompt must be there."""
        per_seed = self.outputs.get(label, {})
        missing = [s for s in seeds if s not in per_seed or any(t is None for t in per_seed[s])]
        if missing:
            raise RuntimeError(f"{label}: no generations for every prompt at seeds {missing}")
        return {s: [t for t in per_seed[s] if t is not None] for s in seeds}


def task_metrics(
    verifier: torch.nn.Module,
    prompts: Sequence[torch.Tensor],
    references: Sequence[Sequence[int]],
    outputs: dict[int, list[list[int]]],
) -> dict[str, dict[str, Any]]:
    """Verifier NLL per generated token (pooled over a seed's prompts) and mean ROUGE-L F1 over prompts,
    per seed, aggregated over seeds as {"mean", "std", "n"}."""
    per_seed = []
    for generations in outputs.values():
        nll_sum, tokens, f1 = 0.0, 0, []
        for prompt, reference, generated in zip(prompts, references, generations, strict=True):
            nll = continuation_nll(verifier, prompt, generated, temperature=1.0)
            nll_sum, tokens = nll_sum + float(nll.sum()), tokens + nll.numel()
            f1.append(rouge_l(generated, reference).f1)
        per_seed.append(
            {"verifier_nll": nll_sum / max(tokens, 1), "rouge_l_f1": sum(f1) / len(f1), "new_tokens": tokens}
        )
    return aggregate(per_seed)


def resolve_drafter(arg: str | None, verifier: str) -> str:
    pretrained = os.path.join(os.path.dirname(os.path.abspath(verifier)), "drafter")
    if arg == "pretrained":
        return pretrained
    if arg is not None:
        return arg
    distilled = newest_artifact(
        os.path.join(project_root(), "checkpoints"), "distillspec", verifier, "drafter"
    )
    return distilled or pretrained


def rows_and_table(
    points: Sequence[Point], results: dict[str, Any], task: dict[str, Any]
) -> tuple[list, str]:
    runs = {r["decoder"]: r for r in results["runs"]}
    rows, cells = [], []
    for pt in points:
        run = runs.get(pt.label)  # None: the autoregressive baseline
        metrics = {
            "block_efficiency": run["metrics"]["block_efficiency"] if run else None,
            "acceptance_rate": run["metrics"]["acceptance_rate"] if run else None,
            **{k: task[pt.label][k] for k in TASK_METRICS},
        }
        rule = "lossless" if run is None or run["lossless"] else "lossy"
        rows.append({"decoder": pt.label, "lenience": pt.lenience, "eps": pt.eps, "rule": rule, **metrics})
        cells.append(
            [
                "autoregressive" if pt.eps is None else (pt.lenience or "any"),
                "n/a" if pt.eps is None else f"{pt.eps:g}",
                rule,
                "n/a" if run is None else format_metric(metrics["block_efficiency"], 2),
                "n/a" if run is None else format_metric(metrics["acceptance_rate"], 3),
                format_metric(metrics["verifier_nll"], 3),
                format_metric(metrics["rouge_l_f1"], 3),
            ]
        )
    header = [
        "lenience",
        "eps",
        "rule",
        "block_efficiency",
        "acceptance_rate",
        "verifier NLL / token",
        "ROUGE-L F1",
    ]
    return rows, markdown_table(header, cells, "lrlrrrr")


def plot(rows: Sequence[dict[str, Any]], path: str, title: str, ceiling: float) -> None:
    """Block efficiency (with its ``ceiling`` gamma + 1), verifier NLL and ROUGE-L F1 against eps (log
    axis), one line per lenience (each from the shared eps = 1 point), error bars the std over seeds;
    autoregressive sampling as a dashed line with its std band."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    panels = [
        ("block_efficiency", "block efficiency (tokens / verifier call)"),
        ("verifier_nll", "verifier NLL / generated token (nats)"),
        ("rouge_l_f1", "ROUGE-L F1 vs true continuation"),
    ]
    lossless = next(r for r in rows if r["eps"] == 1.0)
    ar = next(r for r in rows if r["eps"] is None)
    leniences = list(dict.fromkeys(r["lenience"] for r in rows if r["lenience"] is not None))
    ticks = sorted({r["eps"] for r in rows if r["eps"] is not None})
    labelled: list[float] = []  # from eps = 1 down, skipping labels that would overlap on the log axis
    for e in reversed(ticks):
        if not labelled or math.log10(labelled[-1] / e) >= 0.1:
            labelled.append(e)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for lenience, marker in zip(leniences, "osD^v", strict=False):
            line = [lossless] + [r for r in rows if r["lenience"] == lenience]
            line.sort(key=lambda r: r["eps"])
            ax.errorbar(
                [r["eps"] for r in line],
                [r[key]["mean"] for r in line],
                yerr=[_std(r[key]) for r in line],
                marker=marker,
                ms=4,
                capsize=2,
                label=lenience,
            )
        if key == "block_efficiency":
            ax.axhline(ceiling, color="0.6", ls=":", lw=1, label=f"gamma + 1 = {ceiling:g}")
        else:
            mean, std = ar[key]["mean"], _std(ar[key])
            ax.axhline(mean, color="0.4", ls="--", lw=1, label="autoregressive (± std)")
            ax.axhspan(mean - std, mean + std, color="0.5", alpha=0.15, lw=0)
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{e:g}" if e in labelled else "" for e in ticks])
        ax.minorticks_off()
        ax.set_xlabel("eps (1 = lossless)")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _std(metric: dict[str, Any]) -> float:
    std = metric.get("std")
    return 0.0 if std is None or math.isnan(std) else float(std)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default=os.path.join(project_root(), "checkpoints", "tiny", "verifier"))
    parser.add_argument(
        "--drafter",
        default=None,
        help="a drafter folder; 'pretrained': the drafter next to the verifier (checkpoints/tiny/drafter); "
        "default: the newest finished checkpoints/distillspec/*/drafter for this verifier, else pretrained",
    )
    parser.add_argument("--leniences", nargs="+", default=["linear"], choices=sorted(LENIENCES))
    parser.add_argument("--eps", type=float, nargs="+", default=list(DEFAULT_EPS))
    parser.add_argument(
        "--gamma", type=int, default=None, help="draft length (default: conf/decoding/sd.yaml's)"
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--data-files", default=None, help="a local JSONL with a 'text' column (default: the embedded corpus)"
    )
    parser.add_argument(
        "--json", default=None, help="write the table's figures and the evaluator's results here"
    )
    parser.add_argument("--plot", default=None, help="write the trade-off curves (PNG) here")
    add_device_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    bad = [e for e in args.eps if not 0.0 < e <= 1.0]
    if bad:
        parser.error(f"--eps values must be in (0, 1] (1 = lossless), got {bad}")
    started = time.perf_counter()
    torch.set_num_threads(1)

    drafter_path = resolve_drafter(args.drafter, args.verifier)
    tokenizer = load_tokenizer(args.verifier, role="--verifier")
    verifier = load_model(args.verifier, role="--verifier", device=args.device).eval()
    drafter = load_model(drafter_path, role="--drafter", device=args.drafter_device or args.device).eval()
    tok_source = drafter_tokenizer_source(drafter_path, "--drafter")
    if tok_source is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(tok_source, role="--drafter"))
    check_vocab_covers_tokenizer(tokenizer, verifier, drafter)
    data = (
        DataSourceConfig(name="jsonl", data_files=args.data_files)
        if args.data_files
        else DataSourceConfig(corpus_dir=os.path.join(project_root(), "data", "stdlib_corpus"))
    )
    try:
        prompts, references = build_prompts_with_references(
            tokenizer, data, args.prompts, args.prompt_len, continuation_len=args.tokens
        )
    except ValueError as err:
        parser.error(f"{err} (--prompt-len / --tokens)")

    gamma = args.gamma if args.gamma is not None else int(load_decoder_config("sd")["gamma"])
    points = sweep_points(args.leniences, args.eps)
    cfg = EvalConfig(
        temperatures=[1.0],
        seeds=list(args.seeds),
        decoders=decoder_configs(points, gamma),
        max_new_tokens=args.tokens,
        progress=False,
        plots=False,
    )
    collected = OutputCollector(len(prompts))
    results = evaluate_drafters(
        verifier,
        {"drafter": drafter},
        prompts,
        cfg,
        eos_token_id=eos_token_ids(tokenizer, verifier, drafter),
        on_output=collected,
    )
    task = {
        pt.label: task_metrics(verifier, prompts, references, collected.by_seed(pt.label, args.seeds))
        for pt in points
    }
    rows, table = rows_and_table(points, results, task)
    elapsed = time.perf_counter() - started

    command = "python scripts/lenience.py" + "".join(
        f" {a}" for a in (sys.argv[1:] if argv is None else argv)
    )
    summary = {
        "command": command,
        "verifier": args.verifier,
        "drafter": drafter_path,
        "gamma": gamma,
        "temperature": 1.0,
        "prompts": len(prompts),
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.tokens,
        "seeds": list(args.seeds),
        "seconds": round(elapsed, 1),
    }
    text = (
        f"Lossy speculative decoding: `{command}` ({summary['seconds']} s, torch on 1 thread)\n\n"
        f"verifier {args.verifier}, drafter {drafter_path}, chain SD gamma {gamma}, T = 1, "
        f"{len(prompts)} prompts x {args.tokens} new tokens, seeds {list(args.seeds)} "
        "(mean ± std over seeds)\n\n"
        f"{table}"
    )
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(to_jsonable({"summary": summary, "rows": rows, "results": results}), f, indent=1)
            f.write("\n")
    if args.plot:
        where = os.path.relpath(drafter_path, project_root())
        plot(
            rows,
            args.plot,
            f"drafter {where if not where.startswith('..') else drafter_path}: gamma {gamma}, T = 1",
            ceiling=gamma + 1,
        )
    return {"summary": summary, "rows": rows, "table": table, "results": results}


if __name__ == "__main__":
    main()
