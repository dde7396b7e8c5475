"""RSD's experiment on a pair: chain SD vs SpecInfer vs RSD-C vs RSD-S (docs/trees.md, docs/trees_real.md).

    python scripts/trees.py                          # the real pair: writes docs/trees_real.md
    python scripts/trees.py --pair checkpoints/tiny  # the embedded pair: writes docs/trees.md (~10 min)
    python scripts/trees.py --prompts 4 --tokens 32 --seeds 0 1 --out /tmp/trees.md   # a quick look

The pair's setup (``research.pairs``): the real pair in the machine's best dtype on held-out chat
prompts, as the real-pair experiments evaluate it; the tiny pair in float32 on 64-token corpus windows.

Three measurements, all through the evaluator (``train.evaluation.evaluate_drafters``, as every report):

1. fixed draft depth (3 and 4): block efficiency of each method at T = 0 and T = 1;
2. fixed verifier budget (4 ... 32 tree tokens per call): each method's best fitting shape at T = 1;
3. cost: the verifier's time per call against the tree tokens it scores (1 ... 64) after a prompt-long
   prefix, and the loop overhead (wall / model forward time - 1; the tiny pair's also on the bench pair).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # research/ is beside train/, not installed

import torch

from research.pairs import DecodeSetup, LoadedPair, load_pair, pair_setup
from research.tree_costs import bench_pair_overhead, sibling_duplicate_rate, verifier_cost
from research.tree_page import command_line, kept_analysis, render
from train.cli.console import add_device_arguments
from train.decoding.decoders.tree_decoder import tree_size
from train.evaluation import evaluate_drafters
from train.models.loading import eos_token_ids
from train.paths import project_root
from train.tables import format_metric, markdown_table

DEPTH_SHAPES = {
    3: {"specinfer": (2, 2, 1), "rsd_c": (2, 2, 1), "rsd_s": 3},  # 10 / 10 / <= 9 tree tokens
    4: {"specinfer": (2, 2, 1, 1), "rsd_c": (2, 2, 1, 1), "rsd_s": 4},  # 14 / 14 / <= 16
}
#: Shapes tried at each verifier budget (tree tokens per call): branchings for SpecInfer and RSD-C,
#: (depth, beam width) for RSD-S; the chain is gamma = budget.
BUDGET_SHAPES: dict[int, dict[str, list[Any]]] = {
    4: {"trees": [(4,), (2, 1), (3,), (1, 1, 1, 1)], "rsd_s": [(2, 2), (4, 1), (1, 4)]},
    8: {"trees": [(8,), (4, 1), (2, 1, 1, 1), (2, 2)], "rsd_s": [(4, 2), (2, 4), (8, 1)]},
    16: {
        "trees": [(4, 1, 1, 1), (2, 2, 1, 1), (4, 2, 1), (2, 1, 1, 1, 1, 1, 1, 1)],
        "rsd_s": [(4, 4), (8, 2), (5, 3)],
    },
    32: {
        "trees": [(4, 2, 1, 1), (2, 2, 2, 1), (4, 1, 1, 1, 1, 1, 1, 1), (2, 2, 1, 1, 1, 1, 1)],
        "rsd_s": [(8, 4), (4, 8), (6, 5)],
    },
}
METRICS = ("block_efficiency", "tokens_per_second", "verifier_tokens_per_call", "speedup", "loop_overhead")
DIGITS = dict(zip(METRICS, (2, 0, 1, 2, 3), strict=True))


def tree_decoder(method: str, shape: Any) -> dict[str, Any]:
    """Chain SD at gamma ``shape``; RSD-S at (depth, beam width) ``shape``; else a branching ``shape``."""
    if method == "sd":
        return {"name": f"sd@g{shape}", "_target_": "train.decoding.SpeculativeDecoder", "gamma": shape}
    tree = {"_target_": "train.decoding.TreeSpeculativeDecoder", "method": method}
    if method == "rsd_s":
        return {"name": f"rsd_s d{shape[0]} w{shape[1]}", **tree, "depth": shape[0], "beam_width": shape[1]}
    return {"name": f"{method} {list(shape)}", **tree, "branching": list(shape)}


@dataclass(frozen=True)
class TreeRun:
    """What every evaluation of one run of this script shares: the loaded pair, its prompts, and the
    evaluator's settings that do not change between the measurements."""

    setup: DecodeSetup
    pair: LoadedPair
    prompts: list[torch.Tensor]
    label: str
    """The drafter's name in the results: the pair folder's name."""
    eos: list[int]
    seeds: list[int]
    max_new_tokens: int
    threads: int | None

    def evaluate(self, decoders: list[dict[str, Any]], temperatures: list[float]) -> dict[str, Any]:
        """The evaluator's results for ``decoders`` at ``temperatures`` on this run's prompts and seeds."""
        cfg = self.setup.eval_config(decoders, temperatures, self.seeds, self.max_new_tokens, self.threads)
        drafters = {self.label: self.pair.drafter}
        return evaluate_drafters(self.pair.verifier, drafters, self.prompts, cfg, eos_token_id=self.eos)

    def metrics(self, results: dict[str, Any]) -> dict[tuple[str, float], dict[str, Any]]:
        """This run's metrics in ``results``, by (decoder name, temperature)."""
        runs = (r for r in results["runs"] if r["drafter"] == self.label)
        return {(r["decoder"], float(r["temperature"])): r["metrics"] for r in runs}


def _cells(metrics: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    return [format_metric(metrics[name], DIGITS[name]) for name in names]


def fixed_depth(run: TreeRun, depths: list[int]) -> tuple[str, dict[str, Any]]:
    """Each method at each draft depth, T = 1 and T = 0: the table and the raw results by depth."""
    rows, raw = [], {}
    for depth in depths:
        shapes = DEPTH_SHAPES[depth]
        decoders = [
            tree_decoder("sd", depth),
            tree_decoder("specinfer", shapes["specinfer"]),
            tree_decoder("rsd_c", shapes["rsd_c"]),
            tree_decoder("rsd_s", (depth, shapes["rsd_s"])),
        ]
        results = raw[str(depth)] = run.evaluate(decoders, [0.0, 1.0])
        by_decoder = run.metrics(results)
        for temperature in (1.0, 0.0):
            for decoder in decoders:
                metrics = by_decoder[(decoder["name"], temperature)]
                rows.append([str(depth), f"{temperature:g}", decoder["name"], *_cells(metrics, METRICS[:4])])
    table = markdown_table(["depth", "T", "decoder", *METRICS[:4]], rows, "lll" + "r" * 4)
    return table, raw


def budget_decoders(budget: int) -> list[dict[str, Any]]:
    """Chain SD at gamma = budget and every shape of :data:`BUDGET_SHAPES` that fits the budget."""
    shapes = BUDGET_SHAPES[budget]
    decoders = [tree_decoder("sd", budget)]
    for method in ("specinfer", "rsd_c"):
        decoders += [tree_decoder(method, s) for s in shapes["trees"] if tree_size(s) <= budget]
    decoders += [tree_decoder("rsd_s", s) for s in shapes["rsd_s"] if s[0] * s[1] <= budget]
    return decoders


def fixed_budget(run: TreeRun, budgets: list[int]) -> tuple[str, str, dict[str, Any]]:
    """Each method's best shape at each verifier budget (T = 1), every shape tried, the raw results."""
    best_rows, all_rows, raw = [], [], {}
    for budget in budgets:
        decoders = budget_decoders(budget)
        results = raw[str(budget)] = run.evaluate(decoders, [1.0])
        by_decoder = {name: m for (name, _), m in run.metrics(results).items()}
        for decoder in decoders:
            all_rows.append([str(budget), decoder["name"], *_cells(by_decoder[decoder["name"]], METRICS)])
        for method in ("sd", "specinfer", "rsd_c", "rsd_s"):  # the first of the best on a tie
            mine = [d["name"] for d in decoders if d["name"].split(" ")[0].split("@")[0] == method]
            best = max(mine, key=lambda name: by_decoder[name]["block_efficiency"]["mean"])
            best_rows.append([str(budget), method, best, *_cells(by_decoder[best], METRICS[:3])])
    best_table = markdown_table(["budget", "method", "best shape", *METRICS[:3]], best_rows, "lll" + "rrr")
    all_table = markdown_table(["budget", "decoder", *METRICS], all_rows, "ll" + "r" * len(METRICS))
    return best_table, all_table, raw


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--depths", type=int, nargs="+", default=[*DEPTH_SHAPES], choices=DEPTH_SHAPES)
    parser.add_argument("--budgets", type=int, nargs="+", default=[*BUDGET_SHAPES], choices=BUDGET_SHAPES)
    parser.add_argument(
        "--pair",
        default=os.path.join(project_root(), "checkpoints", "smollm2"),
        help="a pair folder (verifier/, drafter/): default the real pair; checkpoints/tiny: the embedded one",
    )
    parser.add_argument("--out", default=None, help="default: docs/trees_real.md (real pair), docs/trees.md")
    parser.add_argument("--json", default=None, help="also write every result here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    add_device_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    setup = pair_setup(args.pair)
    drafter_device = args.drafter_device or args.device
    pair = load_pair(setup, device=args.device, drafter_device=drafter_device)
    run = TreeRun(
        setup=setup,
        pair=pair,
        prompts=setup.prompts(pair.tokenizer, args.prompts),
        label=os.path.basename(os.path.normpath(args.pair)),
        eos=eos_token_ids(pair.tokenizer, pair.verifier),
        seeds=list(args.seeds),
        max_new_tokens=args.tokens,
        threads=args.threads or None,
    )
    started = time.time()
    depth_table, depth_raw = fixed_depth(run, args.depths)
    best_table, all_table, budget_raw = fixed_budget(run, args.budgets)
    tables = {
        "depth": depth_table,
        "best": best_table,
        "all": all_table,
        "cost": verifier_cost(pair.verifier, prefix_len=setup.prompt_len),
        "overhead": None if setup.real_pair else bench_pair_overhead(devices=(args.device, drafter_device)),
        "duplicates": sibling_duplicate_rate(pair.drafter, run.prompts),
    }
    summary = {
        "command": command_line(parser, args),
        "pair": args.pair,
        "dtype": setup.dtype,
        "prompts": args.prompts,
        "max_new_tokens": args.tokens,
        "seeds": args.seeds,
        "seconds": round(time.time() - started, 1),
        "threads": torch.get_num_threads(),
    }
    out = args.out or os.path.join(project_root(), "docs", "trees_real.md" if setup.real_pair else "trees.md")
    text = render(summary, setup, tables, kept_analysis(out))
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            raw = {"summary": summary, "depth": depth_raw, "budget": budget_raw}
            json.dump(raw, f, indent=1, default=str)
    print(text)


if __name__ == "__main__":
    main()
