"""Asynchronous (AMUSD) against synchronous speculative decoding on this machine (docs/async.md).

    python scripts/bench.py async                      # benchmark pair and embedded pair, greedy
    python scripts/bench.py async --pairs bench --tokens 128 --prompts 4 --repeats 3
    python scripts/bench.py async --pairs bench --devices cuda:0 cuda:1 --threads 1   # two GPUs
    python scripts/bench.py async --pairs smollm2 --dtypes bfloat16 float32   # the real pair, both dtypes

In one run, on the same prompts, interleaved: autoregressive decoding and synchronous chain SD at
each gamma with ``--threads`` intra-op threads (the two cores for one model at a time),
``AsyncSpeculativeDecoder`` with one thread per model, each pinned to its own core
(``overlap="always"``), and the default asynchronous decoder (``overlap="auto"``: overlapped where the
measured costs say it pays, else synchronous, with the most threads). Greedy, so every decoder's
output is checked against the first one's. Speedups are against autoregressive decoding with the
most threads. Reports tokens/s, speedup against autoregressive decoding, block efficiency, the
fraction of wall time each model was busy and the time both were busy at once (overlap).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

import torch

from research.pairs import checkpoints, load_pair, pair_setup, random_pair, random_prompts
from train.cli.console import device_argument
from train.decoding import AsyncSpeculativeDecoder, AutoregressiveDecoder, DecodeStats, SpeculativeDecoder
from train.evaluation.greedy import classify_difference
from train.models.loading import eos_token_ids
from train.tables import format_value, markdown_table


def _pairs(
    names: list[str], n: int, dtypes: list[str]
) -> dict[str, tuple[Any, Any, list[torch.Tensor], list[int] | None]]:
    """{label: (verifier, drafter, prompts, eos ids or None)}: the random benchmark pair on random prompts,
    the embedded and the real pair on their own held-out prompts (:func:`research.pairs.pair_setup`), the
    real pair once per dtype."""
    out: dict[str, tuple[Any, Any, list[torch.Tensor], list[int] | None]] = {}
    if "bench" in names:
        verifier, drafter = random_pair()
        label = "benchmark pair (30M / 2.5M, random, shared bigram structure)"
        out[label] = (verifier, drafter, random_prompts(n), None)
    if "tiny" in names:
        setup = pair_setup(checkpoints("tiny"))
        pair = load_pair(setup)
        prompts = setup.prompts(pair.tokenizer, n)
        out["embedded pair (tiny verifier / drafter)"] = (pair.verifier, pair.drafter, prompts, None)
    if "smollm2" in names:
        setup = pair_setup(checkpoints("smollm2"))
        if not setup.real_pair:
            raise SystemExit(
                "error: the real pair is not built; run `python train.py experiment=distillspec` once"
            )
        for dtype in dtypes:
            pair = load_pair(dataclasses.replace(setup, dtype=dtype))
            label = f"real pair (SmolLM2-135M-Instruct / its drafter), {dtype}"
            prompts = setup.prompts(pair.tokenizer, n)
            out[label] = (pair.verifier, pair.drafter, prompts, eos_token_ids(pair.tokenizer, pair.verifier))
    return out


def run_pair(
    verifier: Any, drafter: Any, prompts: list[torch.Tensor], eos: list[int] | None, args: argparse.Namespace
) -> list[list[str]]:
    decoders: dict[str, tuple[Any, int]] = {}
    for threads in args.threads:
        decoders[f"autoregressive, {threads} thread(s)"] = (AutoregressiveDecoder(verifier), threads)
    for threads in args.threads:
        for gamma in args.gammas:
            decoders[f"sync SD gamma {gamma}, {threads} thread(s)"] = (
                SpeculativeDecoder(verifier, drafter, gamma=gamma),
                threads,
            )
    for block in args.blocks:
        for idle in args.idle:
            for min_ahead in (
                args.min_ahead if idle == "wait" else ["1", *(["auto"] if "auto" in args.min_ahead else [])]
            ):
                min_ahead = min_ahead if min_ahead == "auto" else int(min_ahead)
                decoder = AsyncSpeculativeDecoder(
                    verifier,
                    drafter,
                    gamma=block,
                    max_ahead=block,
                    min_ahead=min_ahead,
                    idle=idle,
                    pin_cores=(0, 1) if args.devices[0].type == "cpu" else None,
                    overlap="always",
                )
                decoders[f"async gamma {block}, idle {idle}, min_ahead {min_ahead}"] = (decoder, 1)
        # the default: overlapped only where the measured costs say it pays, else synchronous
        decoders[f"async gamma {block}, overlap auto"] = (
            AsyncSpeculativeDecoder(verifier, drafter, gamma=block, max_ahead=block),
            max(args.threads),
        )
    reference: dict[int, list[int]] = {}
    stats: dict[str, list[DecodeStats]] = {name: [] for name in decoders}
    ties = dict.fromkeys(decoders, 0)  # outputs that differ from the first one at a low-precision tie
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
                result = decoder.generate(prompt, args.tokens, eos_token_id=eos)
                tokens = result.tokens.tolist()
                if i in reference:
                    difference = classify_difference(verifier, prompt, reference[i], tokens, args.tie_ulps)
                    assert difference is None or difference["tie"], (
                        f"{name}: greedy output differs from the first decoder's on prompt {i}: {difference}"
                    )
                    ties[name] += difference is not None
                else:
                    reference[i] = tokens
                stats[name].append(result.stats)
    ar_tps = _tps(stats[f"autoregressive, {max(args.threads)} thread(s)"])
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
                str(ties[name]),
            ]
        )
    return rows


def _tps(runs: list[DecodeStats]) -> float:
    return sum(s.new_tokens for s in runs) / sum(s.wall_time for s in runs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", nargs="+", default=["bench", "tiny"], choices=["bench", "tiny", "smollm2"])
    parser.add_argument(
        "--dtypes", nargs="+", default=["bfloat16"], help="the real pair's dtypes (one table each)"
    )
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--idle", nargs="+", default=["step", "wait"], choices=["step", "wait"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[2, 1], help="intra-op threads of the synchronous decoders"
    )
    parser.add_argument(
        "--tie-ulps",
        type=float,
        default=16.0,
        help="outputs may differ where two tokens' logits are this many ulps of the verifier's dtype apart",
    )
    parser.add_argument(
        "--min-ahead",
        nargs="+",
        default=["1", "4", "auto"],
        help="with idle wait: counts, or auto (docs/async.md)",
    )
    parser.add_argument(
        "--devices",
        nargs="+",
        type=device_argument("--devices"),
        default=["auto"],
        help="verifier's device, then the drafter's (cuda:0 cuda:1); default auto: CUDA when available",
    )


def main(args: argparse.Namespace) -> None:
    args.devices = [device_argument("--devices")(d) if isinstance(d, str) else d for d in args.devices]
    start = time.perf_counter()
    with torch.inference_mode():
        for label, (verifier, drafter, prompts, eos) in _pairs(args.pairs, args.prompts, args.dtypes).items():
            verifier.to(args.devices[0])
            drafter.to(args.devices[-1])
            rows = run_pair(verifier, drafter, prompts, eos, args)
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
                        "ties",
                    ],
                    rows,
                    "lrrrrrrr",
                )
            )
    print(
        f"{args.prompts} prompts x {args.tokens} tokens x {args.repeats} repeats, greedy, order rotated per "
        f"prompt; tokens/s = all tokens / all wall seconds; {len(os.sched_getaffinity(0))} cores; "
        f"wall {time.perf_counter() - start:.0f} s"
    )
