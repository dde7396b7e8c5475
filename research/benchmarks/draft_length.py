"""Fixed against adaptive draft length, and prompt lookup first, paired and interleaved in one process.

    python scripts/bench.py draft-length                                     # the random-weight pair
    python scripts/bench.py draft-length --pair checkpoints/smollm2 --threads 2 --prompts 8 \\
        --max-new-tokens 64
    python scripts/bench.py draft-length --pair checkpoints/smollm2 --drafter <run>/drafter --threads 2

Decodes the same prompts with the verifier alone, chain SD at each ``--gammas`` and chain SD with an
adaptive draft length at each ``--cap`` x ``--thresholds`` (:class:`~train.decoding.SpeculativeDecoder`'s
``confidence_threshold``, docs/decoding.md#adaptive-draft-length), and, for each ``--lookup-tokens`` K,
prompt lookup first with the drafter where nothing matches (``lookup_tokens``,
docs/decoding.md#prompt-lookup), under a fixed ``--lookup-gamma`` and under the first adaptive setting,
greedy and T = 1, every prompt through every decoder in a rotating order, so machine load hits them
alike (a between-run comparison of one seed moves by a few percent on a 2-core machine). Reports
tokens/s, speedup over the verifier alone in the same loop, block efficiency and drafts per block.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from research.pairs import random_pair, random_prompts, real_pair
from train.cli.console import add_device_arguments
from train.decoding import AutoregressiveDecoder, SamplingParams, SpeculativeDecoder
from train.decoding.decoders.base import Decoder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gammas", type=int, nargs="+", default=[2, 3], help="fixed draft lengths")
    parser.add_argument("--cap", type=int, default=6, help="the adaptive chains' most drafts per block")
    parser.add_argument(
        "--thresholds", type=float, nargs="+", default=[0.2, 0.3], help="confidence thresholds"
    )
    parser.add_argument(
        "--lookup-tokens", type=int, nargs="*", default=[8], help="prompt lookup's most copied tokens"
    )
    parser.add_argument("--lookup-gamma", type=int, default=3, help="the drafter's gamma beside lookup")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the prompts (seeds at T = 1)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pair", default=None, help="a real pair's folder, e.g. checkpoints/smollm2")
    parser.add_argument(
        "--drafter", default=None, help="with --pair: another drafter folder (a run's drafter/)"
    )
    add_device_arguments(parser)


def _pair(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module, list[torch.Tensor]]:
    if not args.pair:
        return (*random_pair(), random_prompts(args.prompts))
    pair, prompts = real_pair(args.pair, args.prompts, drafter=args.drafter)
    return pair.verifier, pair.drafter, prompts


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    verifier, drafter, prompts = _pair(args)
    verifier.to(args.device)
    drafter.to(args.drafter_device or args.device)
    decoders: dict[str, Decoder] = {"verifier alone": AutoregressiveDecoder(verifier)}
    for g in args.gammas:
        decoders[f"gamma {g}"] = SpeculativeDecoder(verifier, drafter, gamma=g)
    for t in args.thresholds:
        decoders[f"cap {args.cap}, t {t:g}"] = SpeculativeDecoder(
            verifier, drafter, gamma=args.cap, confidence_threshold=t
        )
    for k in args.lookup_tokens:
        decoders[f"lookup {k}, gamma {args.lookup_gamma}"] = SpeculativeDecoder(
            verifier, drafter, gamma=args.lookup_gamma, lookup_tokens=k
        )
        if args.thresholds:
            t = args.thresholds[0]
            decoders[f"lookup {k}, cap {args.cap} t {t:g}"] = SpeculativeDecoder(
                verifier, drafter, gamma=args.cap, confidence_threshold=t, lookup_tokens=k
            )
    for decoder in decoders.values():  # warm-up
        decoder.generate(prompts[0][:, :8], 4)
    names = list(decoders)
    rows: list[dict[str, Any]] = []
    for temperature in (0.0, 1.0):
        wall = dict.fromkeys(names, 0.0)
        tokens, calls, drafted = (dict.fromkeys(names, 0) for _ in range(3))
        for rep in range(args.repeats):
            for i, prompt in enumerate(prompts):
                shift = (i + rep) % len(names)
                for name in names[shift:] + names[:shift]:
                    start = time.perf_counter()
                    stats = (
                        decoders[name]
                        .generate(
                            prompt,
                            args.max_new_tokens,
                            SamplingParams(temperature=temperature),
                            generator=torch.Generator().manual_seed(1000 * rep + i),
                        )
                        .stats
                    )
                    wall[name] += time.perf_counter() - start
                    tokens[name] += stats.new_tokens
                    calls[name] += stats.verifier_calls
                    drafted[name] += stats.drafted
        alone = tokens[names[0]] / wall[names[0]]
        for name in names:
            tps = tokens[name] / wall[name]
            rows.append(
                {
                    "decoder": name,
                    "T": temperature,
                    "tokens_per_second": tps,
                    "speedup": tps / alone,
                    "block_efficiency": tokens[name] / calls[name],
                    "drafts_per_block": drafted[name] / calls[name],
                }
            )
    print("| decoder | T | tokens/s | speedup | block efficiency | drafts per block |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['decoder']} | {r['T']:g} | {r['tokens_per_second']:.1f} | {r['speedup']:.3f}x | "
            f"{r['block_efficiency']:.2f} | {r['drafts_per_block']:.2f} |"
        )
    return rows
