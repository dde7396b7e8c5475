"""The cost of SD^2 steering per block on this machine (docs/steering.md).

    python scripts/steering_overhead.py [--prompts 8] [--tokens 64] [--device cuda]

Steered chain SD (gamma 4) on the embedded pair with a random nonzero steering module: the steering
time per verification (projecting its guide, choosing each drafter forward's biases) against one
drafter step, and the steered decoder's tokens/s
against the unsteered one on the same prompts (greedy, so both emit the same tokens).
"""

from __future__ import annotations

import argparse
import os

import torch

from train.cli.console import add_device_arguments
from train.decoding import SpeculativeDecoder
from train.evaluation import build_prompts
from train.models.loading import load_model, load_tokenizer
from train.models.steering_module import SteeringModule
from train.paths import project_root


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    add_device_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    tiny = os.path.join(project_root(), "checkpoints", "tiny")
    drafter_device = args.drafter_device or args.device
    verifier = load_model(os.path.join(tiny, "verifier"), device=args.device).eval()
    drafter = load_model(os.path.join(tiny, "drafter"), device=drafter_device).eval()
    prompts = build_prompts(
        load_tokenizer(os.path.join(tiny, "verifier")), num_prompts=args.prompts, prompt_len=64
    )
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


if __name__ == "__main__":
    main()
