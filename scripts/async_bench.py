"""Asynchronous (AMUSD) against synchronous speculative decoding on this machine (docs/async.md).

    python scripts/async_bench.py                      # benchmark pair and embedded pair, greedy
    python scripts/async_bench.py --pairs bench --tokens 128 --prompts 4 --repeats 3

In one run, on the same prompts, interleaved: autoregressive decoding and synchronous chain SD at
each gamma with ``--threads`` intra-op threads (the two cores for one model at a time), and
``AsyncSpeculativeDecoder`` with one thread per model, each pinned to its own core. Greedy, so every
decoder's output is checked against the autoregressive one. Reports tokens/s, speedup against
autoregressive decoding, block efficiency, the fraction of wall time each model was busy and the time
both were busy at once (overlap).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from train.benchmarks.decoding import build_pair
from train.decoding import AsyncSpeculativeDecoder, AutoregressiveDecoder, DecodeStats, SpeculativeDecoder
from train.models.loading import load_model
from train.paths import project_root
from train.tables import format_value, markdown_table


def _pairs(names: list[str]) -> dict[str, tuple[Any, Any]]:
    out = {}
    if "bench" in names:
        out["benchmark pair (30M / 2.5M, random, shared bigram structure)"] = build_pair()
    if "tiny" in names:
        tiny = os.path.join(project_root(), "checkpoints", "tiny")
        out["embedded pair (tiny verifier / drafter)"] = (
            load_model(os.path.join(tiny, "verifier")).eval(),
            load_model(os.path.join(tiny, "drafter")).eval(),
        )
    return out


def run_pair(verifier: Any, drafter: Any, args: argparse.Namespace) -> list[list[str]]:
    vocab = verifier.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (1, 48), generator=g) for _ in range(args.prompts)]
    decoders: dict[str, tuple[Any, int]] = {"autoregressive": (AutoregressiveDecoder(verifier), args.threads)}
    for gamma in args.gammas:
        decoders[f"sync SD gamma {gamma}"] = (
            SpeculativeDecoder(verifier, drafter, gamma=gamma),
            args.threads,
        )
    for block in args.blocks:
        decoders[f"async max_block {block}"] = (
            AsyncSpeculativeDecoder(verifier, drafter, max_block=block, max_ahead=block, pin_cores=(0, 1)),
            1,
        )
    reference = {}
    stats: dict[str, list[DecodeStats]] = {name: [] for name in decoders}
    for decoder, threads in decoders.values():  # warm-up
        torch.set_num_threads(threads)
        decoder.generate(prompts[0][:, :8], 4)
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            names = list(decoders)
            names = names[i % len(names) :] + names[: i % len(names)]  # rotate the order per prompt
            for name in names:
                decoder, threads = decoders[name]
                torch.set_num_threads(threads)
                result = decoder.generate(prompt, args.tokens)
                tokens = result.tokens.tolist()
                if i in reference:
                    assert tokens == reference[i], (
                        f"{name}: greedy output differs from autoregressive on prompt {i}"
                    )
                elif name == "autoregressive":
                    reference[i] = tokens
                stats[name].append(result.stats)
    ar_tps = _tps(stats["autoregressive"])
    rows = []
    for name, runs in stats.items():
        merged = runs[0]
        for s in runs[1:]:
            merged = merged.merge(s)
        tps = _tps(runs)
        rows.append(
            [
                name,
                format_value(tps, 0),
                format_value(tps / ar_tps, 2),
                format_value(merged.new_tokens / max(merged.verifier_calls, 1), 2),
                format_value(merged.drafter_time / merged.wall_time, 2) if merged.drafter_calls else "-",
                format_value(merged.verifier_time / merged.wall_time, 2),
                format_value(merged.overlap_time / merged.wall_time, 2) if merged.drafter_calls else "-",
            ]
        )
    return rows


def _tps(runs: list[DecodeStats]) -> float:
    return sum(s.new_tokens for s in runs) / sum(s.wall_time for s in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=["bench", "tiny"], choices=["bench", "tiny"])
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of the synchronous decoders")
    args = parser.parse_args()
    start = time.perf_counter()
    with torch.inference_mode():
        for label, (verifier, drafter) in _pairs(args.pairs).items():
            rows = run_pair(verifier, drafter, args)
            print(f"## {label}\n")
            print(
                markdown_table(
                    [
                        "decoder",
                        "tokens/s",
                        "speedup",
                        "block efficiency",
                        "drafter busy",
                        "verifier busy",
                        "both busy",
                    ],
                    rows,
                    "lrrrrrr",
                )
            )
    print(
        f"{args.prompts} prompts x {args.tokens} tokens x {args.repeats} repeats, greedy, order rotated per "
        f"prompt; tokens/s = all tokens / all wall seconds; {len(os.sched_getaffinity(0))} cores; "
        f"wall {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
