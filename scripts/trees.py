"""RSD's experiment on a pair: chain SD vs SpecInfer vs RSD-C vs RSD-S (docs/trees.md, docs/trees_real.md).

    python scripts/trees.py                          # the real pair: writes docs/trees_real.md
    python scripts/trees.py --pair checkpoints/tiny  # the embedded pair: writes docs/trees.md (~10 min)
    python scripts/trees.py --prompts 4 --tokens 32 --seeds 0 1 --out /tmp/trees.md   # a quick look

The pair's setup (``train.cli.pair_setup``): the real pair in the machine's best dtype on held-out chat
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
import statistics
import time
from typing import Any

import torch

from train.benchmarks.decoders_bench import build_pair
from train.cli.console import add_device_arguments
from train.cli.pair_setup import DecodeSetup, pair_setup
from train.decoding import (
    DecodeStats,
    SamplingParams,
    SpeculativeDecoder,
    TimedModel,
    TreeSpeculativeDecoder,
    keep_positions,
    loop_overhead,
)
from train.decoding.decoders.tree_decoder import tree_size
from train.decoding.proposers.tree_proposers import TreeProposer
from train.decoding.tree_attention import tree_attention_mask, tree_position_ids
from train.evaluation import EvalConfig, evaluate_drafters
from train.models.draft_vocab import with_draft_vocab
from train.models.loading import eos_token_ids, load_model, load_tokenizer
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


def evaluate(
    pair: tuple[Any, Any, Any], decoders: list[dict[str, Any]], temps: list[float], args: Any
) -> dict[str, Any]:
    verifier, drafter, prompts = pair
    cfg = EvalConfig(
        temperatures=temps,
        seeds=list(args.seeds),
        decoders=decoders,
        max_new_tokens=args.tokens,
        progress=False,
        plots=False,
        num_threads=args.threads or None,
        tie_ulps=args.setup.tie_ulps,
    )
    return evaluate_drafters(verifier, {args.label: drafter}, prompts, cfg, eos_token_id=args.eos)


def runs_by(results: dict[str, Any], label: str) -> dict[tuple[str, float], dict[str, Any]]:
    runs = results["runs"]
    return {(r["decoder"], float(r["temperature"])): r["metrics"] for r in runs if r["drafter"] == label}


def fixed_depth(pair: Any, args: Any) -> tuple[str, dict[str, Any]]:
    rows, raw = [], {}
    for depth, shapes in ((d, DEPTH_SHAPES[d]) for d in args.depths):
        decoders = [tree_decoder("sd", depth)]
        decoders += [tree_decoder(m, shapes[m]) for m in ("specinfer", "rsd_c")]
        decoders += [tree_decoder("rsd_s", (depth, shapes["rsd_s"]))]
        results = evaluate(pair, decoders, [0.0, 1.0], args)
        raw[str(depth)] = results
        by = runs_by(results, args.label)
        for t in (1.0, 0.0):
            for d in decoders:
                m = by[(d["name"], t)]
                rows.append(
                    [str(depth), f"{t:g}", d["name"], *(format_metric(m[k], DIGITS[k]) for k in METRICS[:4])]
                )
    table = markdown_table(["depth", "T", "decoder", *METRICS[:4]], rows, "lll" + "r" * 4)
    return table, raw


def fixed_budget(pair: Any, args: Any) -> tuple[str, str, dict[str, Any]]:
    best_rows, all_rows, raw = [], [], {}
    for budget, shapes in ((b, BUDGET_SHAPES[b]) for b in args.budgets):
        decoders = [tree_decoder("sd", budget)]
        for method in ("specinfer", "rsd_c"):
            decoders += [tree_decoder(method, s) for s in shapes["trees"] if tree_size(s) <= budget]
        decoders += [tree_decoder("rsd_s", s) for s in shapes["rsd_s"] if s[0] * s[1] <= budget]
        results = evaluate(pair, decoders, [1.0], args)
        raw[str(budget)] = results
        by = runs_by(results, args.label)
        for d in decoders:
            m = by[(d["name"], 1.0)]
            all_rows.append([str(budget), d["name"], *(format_metric(m[k], DIGITS[k]) for k in METRICS)])
        for method in ("sd", "specinfer", "rsd_c", "rsd_s"):  # the first of the best on a tie
            mine = [d["name"] for d in decoders if d["name"].split(" ")[0].split("@")[0] == method]
            name = max(mine, key=lambda n: by[(n, 1.0)]["block_efficiency"]["mean"])
            m = by[(name, 1.0)]
            best_rows.append(
                [str(budget), method, name, *(format_metric(m[k], DIGITS[k]) for k in METRICS[:3])]
            )
    best_table = markdown_table(["budget", "method", "best shape", *METRICS[:3]], best_rows, "lll" + "rrr")
    all_table = markdown_table(["budget", "decoder", *METRICS], all_rows, "ll" + "r" * len(METRICS))
    return best_table, all_table, raw


@torch.inference_mode()
def verifier_cost(verifier: Any, prefix_len: int = 64, reps: int = 15) -> str:
    """The verifier's median time for one forward over a binary tree of n tokens after a cached prefix."""
    timed = TimedModel(verifier)
    prefix = list(range(3, 3 + prefix_len))
    base = timed(prefix, None, logits_to_keep=1).cache
    rows, first = [], None
    for n in (1, 4, 8, 16, 32, 64):
        parents = [(i - 1) // 2 for i in range(n)]  # a binary tree, level by level
        depths = [(i + 1).bit_length() for i in range(n)]  # node i's depth in that tree (the root's: 1)
        tokens = [5 + (i % 50) for i in range(n)]
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            out = timed(
                tokens,
                base,
                position_ids=tree_position_ids(prefix_len, 0, depths),
                attention_mask=tree_attention_mask(prefix_len, 0, parents, timed.mask_dtype),
                logits_to_keep=n,
            )
            times.append(time.perf_counter() - start)
            keep_positions(out.cache, list(range(prefix_len)))
        ms = statistics.median(times) * 1000
        first = first or ms
        rows.append([str(n), f"{ms:.2f}", f"{ms / first:.2f}"])
    return markdown_table(
        ["tree tokens per call", "verifier ms per call (median)", "x one token"], rows, "rrr"
    )


@torch.inference_mode()
def sibling_duplicate_rate(
    drafter: Any, prompts: list[torch.Tensor], branching: tuple[int, ...] = (2, 2, 1)
) -> str:
    """How often SpecInfer's i.i.d. siblings repeat a token at T = 1 (what RSD's sampling without
    replacement avoids): each prompt cut at up to 6 points (its last 24 tokens), a tree per cut."""
    drafting = TimedModel(with_draft_vocab(drafter))  # as the evaluator drafts: over config.draft_vocab
    proposer = TreeProposer(drafting, drafter.config.vocab_size, "specinfer", branching=branching)
    stats = DecodeStats()
    generator = torch.Generator().manual_seed(0)
    pairs = same = cuts = 0
    for ids in prompts:
        seq = ids[0].tolist()
        for cut in range(max(len(seq) - 24, 1), len(seq), 4):
            cuts += 1
            proposer.start()
            draft = proposer.propose(
                seq[:cut], len(branching), SamplingParams(1.0), generator, frozenset(), stats
            )
            for node in [-1, *range(len(draft))]:
                kids = [draft.tokens[c] for c in draft.children(node)]
                pairs += len(kids) * (len(kids) - 1) // 2
                same += sum(a == b for i, a in enumerate(kids) for b in kids[i + 1 :])
    return (
        f"SpecInfer {list(branching)} at T = 1 drew the same token for {same} of {pairs} sibling pairs "
        f"({same / max(pairs, 1):.1%}; {len(prompts)} prompts, {cuts} cuts)."
    )


@torch.inference_mode()
def bench_pair_overhead(
    prompts: int = 3, new_tokens: int = 96, devices: tuple[Any, Any] = ("cpu", "cpu")
) -> str:
    """Loop overhead (wall / model forward time - 1) of each decoder on the benchmark pair of
    ``scripts/bench.py decoding`` (random-weight Llama, 33.7M / 2.6M parameters, sharing a bigram
    component so acceptance is realistic), where a verifier forward costs several milliseconds;
    ``devices``: the verifier's and the drafter's."""
    verifier, drafter = build_pair()
    verifier.to(devices[0])
    drafter.to(devices[1])
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, 8192, (1, 48), generator=g) for _ in range(prompts)]
    decoders = {
        "sd@g3": SpeculativeDecoder(verifier, drafter, gamma=3),
        "specinfer [2, 2, 1]": TreeSpeculativeDecoder(verifier, drafter, "specinfer", branching=(2, 2, 1)),
        "rsd_c [2, 2, 1]": TreeSpeculativeDecoder(verifier, drafter, "rsd_c", branching=(2, 2, 1)),
        "rsd_s d3 w3": TreeSpeculativeDecoder(verifier, drafter, "rsd_s", depth=3, beam_width=3),
    }
    rows = []
    for name, decoder in decoders.items():
        for t in (0.0, 1.0):
            params = SamplingParams(temperature=t)
            decoder.generate(inputs[0], 8, params, generator=torch.Generator().manual_seed(0))  # warm-up
            overheads, taus = [], []
            for i, ids in enumerate(inputs):
                res = decoder.generate(ids, new_tokens, params, generator=torch.Generator().manual_seed(i))
                overheads.append(loop_overhead(res.stats))
                taus.append(res.stats.new_tokens / res.stats.verifier_calls)
            rows.append(
                [name, f"{t:g}", f"{statistics.mean(taus):.2f}", f"{100 * statistics.mean(overheads):.1f}%"]
            )
    return markdown_table(["decoder", "T", "block efficiency", "loop overhead"], rows, "llrr")


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
    args.setup = setup = pair_setup(args.pair)
    args.label = os.path.basename(os.path.normpath(args.pair))  # the drafter's name in the results
    tokenizer = load_tokenizer(setup.verifier)
    devices = (args.device, args.drafter_device or args.device)
    verifier = load_model(setup.verifier, dtype=setup.dtype, role="verifier", device=devices[0]).eval()
    drafter = load_model(setup.drafter, dtype=setup.dtype, role="drafter", device=devices[1]).eval()
    args.eos = eos_token_ids(tokenizer, verifier)
    pair = (verifier, drafter, setup.prompts(tokenizer, args.prompts))
    started, tables = time.time(), dict[str, str | None]()
    tables["depth"], depth_raw = fixed_depth(pair, args)
    tables["best"], tables["all"], budget_raw = fixed_budget(pair, args)
    tables["cost"] = verifier_cost(verifier, prefix_len=setup.prompt_len)
    tables["overhead"] = None if setup.real_pair else bench_pair_overhead(devices=devices)
    tables["duplicates"] = sibling_duplicate_rate(drafter, pair[2])
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
            json.dump(
                {"summary": summary, "depth": depth_raw, "budget": budget_raw}, f, indent=1, default=str
            )
    print(text)


def command_line(parser: argparse.ArgumentParser, args: Any) -> str:
    """The command that made this page: the options that differ from their defaults."""
    words = ["python scripts/trees.py"]
    for key in ("pair", "prompts", "tokens", "seeds", "depths", "budgets", "threads"):
        value = getattr(args, key)
        if value != parser.get_default(key):
            words.append(f"--{key} {' '.join(map(str, value)) if isinstance(value, list) else value}")
    return " ".join(words)


ANALYSIS = ("<!-- analysis: kept when this file is regenerated -->", "<!-- /analysis -->")


def kept_analysis(path: str) -> str:
    """The hand-written reading of the figures between the ANALYSIS markers of an existing doc."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return "(no analysis yet)"
    start, end = text.find(ANALYSIS[0]), text.find(ANALYSIS[1])
    return text[start + len(ANALYSIS[0]) : end].strip() if 0 <= start < end else "(no analysis yet)"


def described(summary: dict[str, Any], setup: DecodeSetup) -> tuple[str, str]:
    """The page's words for the pair: its title; the pair, its dtype and the prompts (two lines)."""
    root, path, n = project_root(), os.path.abspath(summary["pair"]), summary["prompts"]
    where = os.path.relpath(path, root) if path.startswith(root + os.sep) else summary["pair"]
    if setup.real_pair:
        title, pair = "the real pair", f"the real pair (SmolLM2-135M-Instruct and its drafter, `{where}`)"
    else:
        title, pair = "the embedded pair", f"the embedded tiny pair (`{where}`)"
    prompts = (
        f"{n} prompts of {setup.prompt_len} tokens from the embedded corpus's test split"
        if setup.data.name == "stdlib"
        else f"{n} held-out {setup.data.name} prompts (test split, at most {setup.prompt_len} tokens)"
    )
    return title, f"{pair} in {setup.dtype},\n{prompts}"


def render(summary: dict[str, Any], setup: DecodeSetup, tables: dict[str, str | None], analysis: str) -> str:
    """The page: ``tables`` holds depth, best, all, cost, duplicates and overhead (None: not measured)."""
    title, pair = described(summary, setup)
    overhead = (
        f"""On the tiny pair a verifier forward takes under 2 ms, so the
engine's per-block Python work weighs a lot there. On the benchmark pair of `scripts/bench.py decoding`
(random-weight Llama 33.7M / 2.6M, 3 prompts of 48 tokens, 96 new tokens, 1 thread):

{tables["overhead"]}"""
        if tables["overhead"] is not None
        else "The real pair's verifier forward (the table above)\nis what the benchmark pair of "
        "[trees.md](trees.md) stands in for, so that pair is not re-measured here.\n"
    )
    return f"""# Trees: chain SD, SpecInfer, RSD-C and RSD-S on {title}

Generated by `{summary["command"]}` ({summary["seconds"]} s, torch on {summary["threads"]} thread):
{pair}, up to {summary["max_new_tokens"]} new tokens each, seeds {summary["seeds"]}
(mean ± std over seeds), every decoder timed against autoregressive decoding on the same prompts
(`train.evaluation.evaluate_drafters`). Block efficiency is generated tokens per verifier call;
`verifier_tokens_per_call` counts the context token and every tree token the verifier scored.

{ANALYSIS[0]}
{analysis}
{ANALYSIS[1]}

## Fixed draft depth

Shapes: depth 3 = SpecInfer and RSD-C branching (2, 2, 1) (10 tree tokens), RSD-S beam width 3
(at most 9); depth 4 = branching (2, 2, 1, 1) (14), RSD-S width 4 (at most 16); chain SD gamma = depth.

{tables["depth"]}

Duplicate siblings: {tables["duplicates"]}

## Fixed verifier budget (T = 1)

Each method's best shape among those tried that fit the budget (tree tokens per call, context token
excluded; chain SD drafts gamma = budget tokens):

{tables["best"]}

Every shape tried:

{tables["all"]}

## Cost of a tree on this CPU

The verifier's time for one forward over a binary tree of n tokens after a {setup.prompt_len}-token cached
prefix (median of 15 calls; `scripts/trees.py`, `verifier_cost`):

{tables["cost"]}

The decoders' loop overhead (wall time over the models' forward time, minus 1) is the `loop_overhead`
column above. {overhead}"""


if __name__ == "__main__":
    main()
