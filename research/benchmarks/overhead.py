"""Loop overhead of this engine against an older copy of it, interleaved in one process.

    git archive <commit> train/decoding | tar -x -C /tmp/old     # the engine to compare with
    python scripts/bench.py overhead --baseline /tmp/old/train/decoding
    python scripts/bench.py overhead --baseline /tmp/old/train/decoding --pair checkpoints/smollm2 --threads 2

Both engines decode the same prompts on the decoding benchmark's random-weight pair
(:func:`research.pairs.random_pair`), or with ``--pair`` on a real pair's held-out validation prompts
in its dtype (the drafter wrapped over its draft vocabulary as the evaluator wraps it: bfloat16 logits
and 49,152-id distributions are where the loop's own cost shows), greedy and T = 1, alternating and
rotating per prompt, so machine load hits both alike. Reported per engine and decoder: tokens/s and
``loop_overhead = wall / forward time - 1`` (the loop's own cost). A refactor of the engine must not
raise the loop overhead.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

import torch

import train
import train.decoding as current
from research.pairs import random_pair, random_prompts, real_pair
from train.cli.console import add_device_arguments

PACKAGE = "train.decoding"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", required=True, help="a copy of an older train/decoding package")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--pair",
        default=None,
        help="a real pair's folder (verifier/, drafter/), e.g. checkpoints/smollm2 "
        "(default: the random-weight pair)",
    )
    add_device_arguments(parser)


def load_package(path: str) -> ModuleType:
    """Import the engine package at ``path`` *as* ``train.decoding``, then put the current engine back.

    The engine's modules import each other by absolute name (``from train.decoding.sampling import
    ...``): imported under another name they would bind the current engine's parts. So the current
    ``train.decoding*`` modules leave ``sys.modules`` while the old package and everything it imports of
    itself load from ``path``; the old modules keep the objects they bound, and the current ones return.
    """
    init = os.path.join(path, "__init__.py")
    if not os.path.isfile(init):
        raise FileNotFoundError(f"--baseline: no package at {path!r} (expected {init})")

    def engine_modules() -> dict[str, ModuleType]:
        return {k: m for k, m in sys.modules.items() if k == PACKAGE or k.startswith(PACKAGE + ".")}

    current_modules = engine_modules()
    for key in current_modules:
        del sys.modules[key]
    try:
        spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[path])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
    finally:
        for key in engine_modules():
            del sys.modules[key]
        sys.modules.update(current_modules)
        train.decoding = current  # the import system may have set the parent's attribute to the old one
    return module


def main(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    baseline = load_package(os.path.abspath(args.baseline))
    if args.pair:
        pair, prompts = real_pair(args.pair, args.prompts)
        verifier, drafter = pair.verifier, pair.drafter
    else:
        verifier, drafter = random_pair()
        prompts = random_prompts(args.prompts)
    verifier.to(args.device)
    drafter.to(args.drafter_device or args.device)
    engines = {"baseline": baseline, "current": current}
    decoders = {}
    for label, eng in engines.items():
        decoders[f"{label}-ar"] = (eng, eng.AutoregressiveDecoder(verifier))
        decoders[f"{label}-sd"] = (eng, eng.SpeculativeDecoder(verifier, drafter, gamma=args.gamma))
    for eng, dec in decoders.values():
        dec.generate(prompts[0][:, :8], 4, eng.SamplingParams())
    order = list(decoders)
    rows = []
    for temperature in (0.0, 1.0):
        stats: dict[str, list[Any]] = {k: [] for k in order}
        for rep in range(args.repeats):
            for i, prompt in enumerate(prompts):
                shift = (i + rep) % len(order)
                for key in order[shift:] + order[:shift]:
                    eng, dec = decoders[key]
                    res = dec.generate(
                        prompt,
                        args.max_new_tokens,
                        eng.SamplingParams(temperature=temperature),
                        generator=torch.Generator().manual_seed(i),
                    )
                    stats[key].append(res.stats)
        for key, runs in stats.items():
            wall = sum(s.wall_time for s in runs)
            forward = sum(s.drafter_time + s.verifier_time for s in runs)
            tokens = sum(s.new_tokens for s in runs)
            rows.append((key, temperature, tokens / wall, wall / forward - 1.0))
    print("| engine-decoder | T | tokens/s | loop overhead |\n|---|---:|---:|---:|")
    for key, temperature, tps, overhead in rows:
        print(f"| {key} | {temperature:g} | {tps:.1f} | {100 * overhead:.2f}% |")
    return {"rows": rows}
