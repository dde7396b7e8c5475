"""What checking k tokens costs: the verifier's forward over 1 .. K new tokens, per one-token forward.

    python scripts/bench.py verify-cost                                  # the real pair (checkpoints/smollm2)
    python scripts/bench.py verify-cost --dtype float32 --threads 2      # the float32 regime on any CPU
    python scripts/bench.py verify-cost --pair random                    # the random-weight pair

The cost curve as shipped by torch (every linear layer through ``F.linear``: MKL's GEMM path for 2+ rows)
and with the streamed product for 2-16 rows (train/models/streamed_linear.py), interleaved in one process
(``--rounds`` rounds, each measuring both kernels with :func:`train.decoding.cost_probe.measure_step_costs`;
the median over rounds), after a 128-token cached prefix; then the drafter's step and what the two curves
mean for a chain: the break-even acceptance of one drafted token. Also checks, on one held-out prompt,
that a k-token check gives the same argmax as k one-token steps under both kernels and reports the
largest logit difference (greedy equality's premise; docs/decoding.md, "What a check costs").
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import torch

from research.pairs import load_pair, pair_setup, random_pair
from train.decoding import TimedModel, crop_cache
from train.decoding.cost_probe import faster_rows, measure_step_costs
from train.decoding.costs import StepCosts
from train.hardware import best_dtype
from train.models.streamed_linear import ALL_ROWS, stream_small_linears, unstream_linears


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pair", default="checkpoints/smollm2", help="a pair folder, or 'random'")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the machine's best)")
    parser.add_argument("--max-tokens", type=int, default=8, help="the most tokens one check feeds")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both kernels, interleaved")
    parser.add_argument("--threads", type=int, default=2)


def _models(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module | None, str]:
    dtype = args.dtype or best_dtype()
    if args.pair == "random":
        verifier, drafter = random_pair()
        return verifier.to(getattr(torch, dtype)), drafter.to(getattr(torch, dtype)), dtype
    setup = pair_setup(args.pair)
    setup = type(setup)(**{**setup.__dict__, "dtype": dtype})
    pair = load_pair(setup)
    return pair.verifier, pair.drafter, dtype


def _argmax_check(verifier: TimedModel, k: int) -> tuple[bool, float]:
    """On a 64-token pseudo-random prefix: does one forward over k tokens give the argmax of k one-token
    forwards, and the largest |logit difference|."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, verifier.embed_size, (64 + k,), generator=gen).tolist()
    with torch.inference_mode():
        cache = verifier(ids[:64], None).cache
        block = verifier(ids[64:], cache, logits_to_keep=k).logits.float()
        crop_cache(cache, 64)
        steps = []
        for t in ids[64:]:
            out = verifier([t], cache)
            cache = out.cache
            steps.append(out.logits[-1].float())
    stepped = torch.stack(steps)
    same = bool(torch.equal(block.argmax(-1), stepped.argmax(-1)))
    return same, float((block - stepped).abs().max())


def _row(name: str, costs: StepCosts) -> str:
    ms = " | ".join(f"{1000 * t:.0f}" for t in costs.verify)
    rel = " | ".join(f"{r:.2f}" for r in costs.relative())
    return f"| {name}, ms | {ms} |\n| {name}, per one-token forward | {rel} |"


def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    verifier_model, drafter_model, dtype = _models(args)
    verifier = TimedModel(verifier_model)
    drafter = TimedModel(drafter_model) if drafter_model is not None else None
    curves: dict[str, list[StepCosts]] = {"as shipped": [], "streamed": []}
    checks: dict[str, list[tuple[int, bool, float]]] = {}
    for round_ in range(args.rounds):
        for name in curves:
            for model in (verifier_model, drafter_model):
                if model is not None:
                    if name == "streamed":
                        stream_small_linears(model, rows=ALL_ROWS)
                    else:
                        unstream_linears(model)
            curves[name].append(measure_step_costs(verifier, drafter, args.max_tokens, choose_kernel=False))
            if round_ == 0:
                checks[name] = [(k, *_argmax_check(verifier, k)) for k in (2, 4, 8)]
    summary = {
        name: StepCosts(
            verify=tuple(statistics.median(c.verify[i] for c in runs) for i in range(args.max_tokens)),
            draft=statistics.median(c.draft for c in runs),
        )
        for name, runs in curves.items()
    }
    head = " | ".join(str(n) for n in range(1, args.max_tokens + 1))
    print(
        f"\nVerifier forward over n new tokens after a 128-token prefix ({args.pair}, {dtype}, "
        f"{args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS', 'unset')}; median of "
        f"{args.rounds} rounds x 5 forwards):\n"
    )
    print(f"| n | {head} |\n|---|{'---:|' * args.max_tokens}")
    for name, costs in summary.items():
        print(_row(name, costs))
    counts = list(range(1, args.max_tokens + 1))
    chosen = faster_rows(counts, list(summary["as shipped"].verify), list(summary["streamed"].verify))
    print(
        f"\nThe cost probe's choice here (DRAFTSMITH_CPU_LINEAR=auto): the streamed product for "
        f"{sorted(n for n in chosen if n <= args.max_tokens) or 'no'} rows, the library's otherwise"
    )
    for name, costs in summary.items():
        two = costs.check(2)
        # one drafted token pays when (1 + a) / (V(2) + D) > 1 / V(1)
        need = (two + costs.draft) / costs.check(1) - 1
        print(
            f"\n{name}: drafter step {1000 * costs.draft:.1f} ms ({costs.draft_ratio:.3f} of a verifier "
            f"step); one drafted token pays when accepted with probability > {need:.2f}"
        )
        for k, same, diff in checks[name]:
            print(
                f"  {k}-token check vs {k} one-token steps: argmax {'equal' if same else 'DIFFERS'}, "
                f"max |logit difference| {diff:.1e}"
            )
    return {name: costs.to_dict() for name, costs in summary.items()}
