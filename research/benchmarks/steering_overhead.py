"""The cost of SD^2 steering per block on this machine (docs/steering.md).

    python scripts/bench.py steering-overhead [--prompts 8] [--tokens 64] [--device cuda]

Steered chain SD (gamma 4) on the embedded pair with a random nonzero steering module: the steering
time per verification (projecting its guide, choosing each drafter forward's biases) against one
drafter step, and the steered decoder's tokens/s
against the unsteered one on the same prompts (greedy, so both emit the same tokens).
"""

from __future__ import annotations

import argparse

import torch

from research.pairs import checkpoints, load_pair, pair_setup
from train.cli.console import add_device_arguments
from train.decoding import SpeculativeDecoder
from train.models.steering_module import SteeringModule


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    add_device_arguments(parser)


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    setup = pair_setup(checkpoints("tiny"))
    drafter_device = args.drafter_device or args.device
    pair = load_pair(setup, device=args.device, drafter_device=drafter_device)
    verifier, drafter = pair.verifier, pair.drafter
    prompts = setup.prompts(pair.tokenizer, args.prompts)
    steering = SteeringModule.for_pair(verifier, drafter).to(drafter_device)
    with torch.no_grad():
        steering.project.weight.normal_(0, 0.02)
    steered = SpeculativeDecoder(verifier, drafter, gamma=4, steering=steering)
    plain = SpeculativeDecoder(verifier, drafter, gamma=4)
    totals = {"steered": [0.0, 0], "plain": [0.0, 0]}
    guide_time = drafter_time = 0.0
    guides = drafter_steps = 0
    for prompt in prompts:
        for name, decoder in (("plain", plain), ("steered", steered)):
            result = decoder.generate(prompt, args.tokens)
            totals[name][0] += result.stats.wall_time
            totals[name][1] += result.stats.new_tokens
            if name == "steered":
                s = result.stats
                guide_time += s.guide_time
                guides += s.verifier_calls - 1  # one guide after every verification but the last
                drafter_time += s.drafter_time - s.drafter_prefill_time
                drafter_steps += s.drafter_calls - s.drafter_prefill_calls
    per_guide = guide_time / max(guides, 1)
    per_step = drafter_time / max(drafter_steps, 1)
    tps = {k: v[1] / v[0] for k, v in totals.items()}
    print(
        f"verifier layers read: {steering.verifier_layers}; guide {per_guide * 1e3:.3f} ms, drafter step "
        f"{per_step * 1e3:.3f} ms: {100 * per_guide / per_step:.1f}% of a drafter step per block; "
        f"tokens/s steered {tps['steered']:.0f} vs plain {tps['plain']:.0f} "
        f"({tps['steered'] / tps['plain']:.2f}x); {args.prompts} prompts x {args.tokens} tokens, greedy"
    )
