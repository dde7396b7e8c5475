"""Decoding-loop benchmark: our decoders against Hugging Face generate on the same pair and prompts.

Four greedy decoders on the random-weight benchmark pair (:func:`research.pairs.random_pair`; verifier
~30M params, drafter ~2.5M):

- ``ours-ar``      :class:`~train.decoding.AutoregressiveDecoder`
- ``hf-generate``  ``verifier.generate(do_sample=False)``
- ``ours-sd``      :class:`~train.decoding.SpeculativeDecoder` (gamma tokens per block)
- ``hf-assisted``  ``verifier.generate(assistant_model=drafter)`` with a constant ``num_assistant_tokens
  = gamma`` and no confidence cut-off

and checks that all four emit the same tokens. Random weights would make the drafter almost never
agree with the verifier, so the pair is built to share a low-rank "bigram" structure: the verifier's
token embeddings and unembeddings are the drafter's mapped through an orthonormal 128 -> 512
projection, plus noise on the verifier unembedding (``--noise``) that sets how often they disagree.
The observed acceptance is reported. Timings are wall clock; our loops also report the time spent in
model forwards, so ``overhead = wall / forward time - 1`` is the loop's own cost.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from research.pairs import random_pair
from train.cli.console import add_device_arguments
from train.decoding import (
    AutoregressiveDecoder,
    DecodeStats,
    SpeculativeDecoder,
    acceptance_rate,
    block_efficiency,
    param_count,
)

METHODS = ("ours-ar", "hf-generate", "ours-sd", "hf-assisted")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per block")
    parser.add_argument("--prompts", type=int, default=4, help="number of random prompts")
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (interleaved)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--noise", type=float, default=0.15, help="verifier unembedding noise (sets acceptance)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    add_device_arguments(parser, drafter=False)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    verifier, drafter = random_pair(noise=args.noise, seed=args.seed)
    verifier.to(args.device)
    drafter.to(args.device)
    drafter.generation_config.num_assistant_tokens = args.gamma
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    g = torch.Generator().manual_seed(args.seed)
    prompts = []
    for _ in range(args.prompts):
        n = int(torch.randint(args.min_prompt_len, args.max_prompt_len + 1, (1,), generator=g))
        prompts.append(torch.randint(0, 8192, (1, n), generator=g))
    n_new = args.max_new_tokens
    ours_ar = AutoregressiveDecoder(verifier)
    ours_sd = SpeculativeDecoder(verifier, drafter, gamma=args.gamma)

    def hf(ids: torch.Tensor, assisted: bool) -> torch.Tensor:
        kw: dict[str, Any] = {"assistant_model": drafter} if assisted else {}
        ids = ids.to(args.device)
        out = verifier.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n_new,
            min_new_tokens=0,
            do_sample=False,
            **kw,
        )
        return out[0, ids.shape[1] :].cpu()  # our decoders return CPU tokens too (and .cpu() syncs)

    def ours(
        decoder: AutoregressiveDecoder | SpeculativeDecoder, ids: torch.Tensor
    ) -> tuple[torch.Tensor, Any]:
        result = decoder.generate(ids, n_new)
        return result.tokens, result.stats

    calls: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, DecodeStats | None]]] = {
        "ours-ar": lambda ids: ours(ours_ar, ids),
        "hf-generate": lambda ids: (hf(ids, False), None),
        "ours-sd": lambda ids: ours(ours_sd, ids),
        "hf-assisted": lambda ids: (hf(ids, True), None),
    }
    # warm-up (one short run of each, all prompts lengths are then cached by the allocator)
    for name in METHODS:
        calls[name](prompts[0][:, :16])
    wall: dict[str, list[float]] = {m: [] for m in METHODS}
    tokens: dict[str, int] = dict.fromkeys(METHODS, 0)
    fwd: dict[str, float] = {"ours-ar": 0.0, "ours-sd": 0.0}
    loop_wall: dict[str, float] = {"ours-ar": 0.0, "ours-sd": 0.0}
    sd_stats = DecodeStats(max_draft=args.gamma)
    mismatches = {"ar": 0, "sd": 0}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            order = METHODS[(rep + i) % 4 :] + METHODS[: (rep + i) % 4]  # rotate to spread drift
            outs: dict[str, torch.Tensor] = {}
            for name in order:
                (toks, stats), dt = _timed(functools.partial(calls[name], ids))
                outs[name] = toks
                wall[name].append(dt)
                tokens[name] += len(toks)
                if stats is not None:
                    fwd[name] += stats.forward_time
                    loop_wall[name] += stats.wall_time
                    if name == "ours-sd":
                        sd_stats = sd_stats.merge(stats)
            mismatches["ar"] += int(not torch.equal(outs["ours-ar"], outs["hf-generate"]))
            mismatches["sd"] += int(not torch.equal(outs["ours-sd"], outs["hf-assisted"]))
            mismatches["sd"] += int(not torch.equal(outs["ours-sd"], outs["ours-ar"]))

    tps = {m: tokens[m] / sum(wall[m]) for m in METHODS}
    result: dict[str, Any] = {
        "config": {
            k: str(v) if isinstance(v, torch.device) else v for k, v in vars(args).items() if not callable(v)
        },
        "verifier_params": param_count(verifier),
        "drafter_params": param_count(drafter),
        "tokens_per_second": tps,
        "wall_per_run_s": {m: statistics.median(wall[m]) for m in METHODS},
        "ratio_sd_vs_hf_assisted": tps["ours-sd"] / tps["hf-assisted"],
        "ratio_ar_vs_hf_generate": tps["ours-ar"] / tps["hf-generate"],
        "speedup_ours_sd_vs_ours_ar": tps["ours-sd"] / tps["ours-ar"],
        "overhead": {m: loop_wall[m] / fwd[m] - 1.0 for m in fwd},
        "acceptance_rate": acceptance_rate(sd_stats),
        "block_efficiency": block_efficiency(sd_stats),
        "greedy_identical": mismatches["ar"] == 0 and mismatches["sd"] == 0,
        "mismatches": mismatches,
    }
    return result


def markdown(res: dict[str, Any]) -> str:
    tps = res["tokens_per_second"]
    ov = res["overhead"]
    lines = [
        f"verifier {res['verifier_params'] / 1e6:.1f}M params, "
        f"drafter {res['drafter_params'] / 1e6:.2f}M params, "
        f"gamma={res['config']['gamma']}, acceptance_rate={res['acceptance_rate']:.3f}, "
        f"block_efficiency={res['block_efficiency']:.2f}, "
        f"greedy outputs identical: {res['greedy_identical']}",
        "",
        "| method | tokens/s | median s / prompt | loop overhead (wall / forward - 1) |",
        "|---|---:|---:|---:|",
    ]
    for m in METHODS:
        o = f"{100 * ov[m]:.1f}%" if m in ov else "n/a"
        lines.append(f"| {m} | {tps[m]:.1f} | {res['wall_per_run_s'][m]:.3f} | {o} |")
    lines += [
        "",
        f"ours-sd / hf-assisted = {res['ratio_sd_vs_hf_assisted']:.2f}x; "
        f"ours-ar / hf-generate = {res['ratio_ar_vs_hf_generate']:.2f}x; "
        f"ours-sd / ours-ar (speedup) = {res['speedup_ours_sd_vs_ours_ar']:.2f}x",
    ]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    res = run(args)
    print(markdown(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res
