"""RSD's experiment on the embedded pair: chain SD vs SpecInfer vs RSD-C vs RSD-S (docs/trees.md).

    python scripts/trees.py                      # writes docs/trees.md (about 10 minutes on 2 cores)
    python scripts/trees.py --prompts 4 --tokens 32 --seeds 0 1 --out /tmp/trees.md   # a quick look

Three measurements, all through the evaluator (``train.evaluation.evaluate_drafters``, as every report):

1. fixed draft depth (3 and 4): block efficiency of each method at T = 0 and T = 1;
2. fixed verifier budget (4 ... 32 tree tokens per call): each method's best fitting shape at T = 1;
3. cost: the verifier's time per call against the tree tokens it scores (1 ... 64) after a 64-token
   prefix, and the decoders' loop overhead (wall time / model forward time - 1).
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
from train.evaluation import EvalConfig, build_prompts, evaluate_drafters
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
DIGITS = {
    "block_efficiency": 2,
    "tokens_per_second": 0,
    "verifier_tokens_per_call": 1,
    "speedup": 2,
    "loop_overhead": 3,
}


def tree_decoder(method: str, shape: Any) -> dict[str, Any]:
    if method == "sd":
        return {
            "name": f"sd@g{shape}",
            "_target_": "train.decoding.SpeculativeDecoder",
            "_partial_": True,
            "gamma": shape,
        }
    if method == "rsd_s":
        depth, width = shape
        return {
            "name": f"rsd_s d{depth} w{width}",
            "_target_": "train.decoding.TreeSpeculativeDecoder",
            "_partial_": True,
            "method": "rsd_s",
            "depth": depth,
            "beam_width": width,
        }
    return {
        "name": f"{method} {list(shape)}",
        "_target_": "train.decoding.TreeSpeculativeDecoder",
        "_partial_": True,
        "method": method,
        "branching": list(shape),
    }


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
    )
    return evaluate_drafters(verifier, {"tiny": drafter}, prompts, cfg, eos_token_id=args.eos)


def runs_by(results: dict[str, Any]) -> dict[tuple[str, float], dict[str, Any]]:
    return {
        (r["decoder"], float(r["temperature"])): r["metrics"]
        for r in results["runs"]
        if r["drafter"] == "tiny"
    }


def fixed_depth(pair: Any, args: Any) -> tuple[str, dict[str, Any]]:
    rows, raw = [], {}
    for depth, shapes in DEPTH_SHAPES.items():
        decoders = [tree_decoder("sd", depth)]
        decoders += [tree_decoder(m, shapes[m]) for m in ("specinfer", "rsd_c")]
        decoders += [tree_decoder("rsd_s", (depth, shapes["rsd_s"]))]
        results = evaluate(pair, decoders, [0.0, 1.0], args)
        raw[str(depth)] = results
        by = runs_by(results)
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
    for budget, shapes in BUDGET_SHAPES.items():
        decoders = [tree_decoder("sd", budget)]
        for method in ("specinfer", "rsd_c"):
            decoders += [tree_decoder(method, s) for s in shapes["trees"] if tree_size(s) <= budget]
        decoders += [tree_decoder("rsd_s", s) for s in shapes["rsd_s"] if s[0] * s[1] <= budget]
        results = evaluate(pair, decoders, [1.0], args)
        raw[str(budget)] = results
        by = runs_by(results)
        best: dict[str, tuple[str, dict[str, Any]]] = {}
        for d in decoders:
            m = by[(d["name"], 1.0)]
            method = d["name"].split(" ")[0].split("@")[0]
            all_rows.append([str(budget), d["name"], *(format_metric(m[k], DIGITS[k]) for k in METRICS)])
            if (
                method not in best
                or m["block_efficiency"]["mean"] > best[method][1]["block_efficiency"]["mean"]
            ):
                best[method] = (d["name"], m)
        for method in ("sd", "specinfer", "rsd_c", "rsd_s"):
            name, m = best[method]
            best_rows.append(
                [str(budget), method, name, *(format_metric(m[k], DIGITS[k]) for k in METRICS[:3])]
            )
    best_table = markdown_table(["budget", "method", "best shape", *METRICS[:3]], best_rows, "lll" + "rrr")
    all_table = markdown_table(["budget", "decoder", *METRICS], all_rows, "ll" + "r" * len(METRICS))
    return best_table, all_table, raw


@torch.inference_mode()
def verifier_cost(verifier: Any, prefix_len: int = 64, reps: int = 15) -> str:
    timed = TimedModel(verifier)
    prefix = list(range(3, 3 + prefix_len))
    base = timed(prefix, None, logits_to_keep=1).cache
    rows, first = [], None
    for n in (1, 4, 8, 16, 32, 64):
        parents = [(i - 1) // 2 for i in range(n)]  # a binary tree, level by level
        depths = [1] * n
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
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
    replacement avoids): each prompt cut at 6 points, one SpecInfer tree per cut."""
    proposer = TreeProposer(TimedModel(drafter), drafter.config.vocab_size, "specinfer", branching=branching)
    stats = DecodeStats()
    generator = torch.Generator().manual_seed(0)
    pairs = same = 0
    for ids in prompts:
        seq = ids[0].tolist()
        for cut in range(len(seq) - 24, len(seq), 4):
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
        f"({same / max(pairs, 1):.1%}; {len(prompts)} prompts x 6 cuts)."
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
    parser.add_argument("--pair", default=os.path.join(project_root(), "checkpoints", "tiny"))
    parser.add_argument("--out", default=os.path.join(project_root(), "docs", "trees.md"))
    parser.add_argument("--json", default=None, help="also write every result here")
    add_device_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(os.path.join(args.pair, "verifier"))
    verifier = load_model(os.path.join(args.pair, "verifier"), device=args.device).eval()
    drafter = load_model(os.path.join(args.pair, "drafter"), device=args.drafter_device or args.device).eval()
    args.eos = eos_token_ids(tokenizer, verifier, drafter)
    prompts = build_prompts(tokenizer, num_prompts=args.prompts, prompt_len=64)
    pair = (verifier, drafter, prompts)
    started = time.time()
    depth_table, depth_raw = fixed_depth(pair, args)
    best_table, all_table, budget_raw = fixed_budget(pair, args)
    cost_table = verifier_cost(verifier)
    overhead_table = bench_pair_overhead(devices=(args.device, args.drafter_device or args.device))
    duplicates = sibling_duplicate_rate(drafter, prompts)
    elapsed = time.time() - started
    command = "python scripts/trees.py" + (
        ""
        if (args.prompts, args.tokens, args.seeds) == (8, 64, [0, 1, 2])
        else f" --prompts {args.prompts} --tokens {args.tokens} --seeds {' '.join(map(str, args.seeds))}"
    )
    summary = {
        "command": command,
        "prompts": args.prompts,
        "max_new_tokens": args.tokens,
        "seeds": args.seeds,
        "seconds": round(elapsed, 1),
        "threads": torch.get_num_threads(),
    }
    text = render(
        summary,
        depth_table,
        best_table,
        all_table,
        cost_table,
        overhead_table,
        duplicates,
        kept_analysis(args.out),
    )
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"summary": summary, "depth": depth_raw, "budget": budget_raw}, f, indent=1, default=str
            )
    print(text)


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


def render(
    summary: dict[str, Any],
    depth_table: str,
    best_table: str,
    all_table: str,
    cost_table: str,
    overhead_table: str,
    duplicates: str,
    analysis: str,
) -> str:
    return f"""# Trees: chain SD, SpecInfer, RSD-C and RSD-S on the embedded pair

Generated by `{summary["command"]}` ({summary["seconds"]} s, torch on {summary["threads"]} thread): the
embedded tiny pair (`checkpoints/tiny`), {summary["prompts"]} prompts of 64 tokens from the embedded
corpus's test split, up to {summary["max_new_tokens"]} new tokens each, seeds {summary["seeds"]}
(mean ± std over seeds), every decoder timed against autoregressive decoding on the same prompts
(`train.evaluation.evaluate_drafters`). Block efficiency is generated tokens per verifier call;
`verifier_tokens_per_call` counts the context token and every tree token the verifier scored.

{ANALYSIS[0]}
{analysis}
{ANALYSIS[1]}

## Fixed draft depth

Shapes: depth 3 = SpecInfer and RSD-C branching (2, 2, 1) (10 tree tokens), RSD-S beam width 3
(at most 9); depth 4 = branching (2, 2, 1, 1) (14), RSD-S width 4 (at most 16); chain SD gamma = depth.

{depth_table}

Duplicate siblings: {duplicates}

## Fixed verifier budget (T = 1)

Each method's best shape among those tried that fit the budget (tree tokens per call, context token
excluded; chain SD drafts gamma = budget tokens):

{best_table}

Every shape tried:

{all_table}

## Cost of a tree on this CPU

The verifier's time for one forward over a binary tree of n tokens after a 64-token cached prefix
(median of 15 calls; `scripts/trees.py`, `verifier_cost`):

{cost_table}

The decoders' loop overhead (wall time over the models' forward time, minus 1) on the tiny pair is
the `loop_overhead` column above: a tiny-pair verifier forward takes under 2 ms, so the engine's
per-block Python work weighs a lot there. On the benchmark pair of `scripts/bench.py decoding`
(random-weight Llama 33.7M / 2.6M, 3 prompts of 48 tokens, 96 new tokens, 1 thread):

{overhead_table}
"""


if __name__ == "__main__":
    main()
