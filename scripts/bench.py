"""Benchmarks: ``python scripts/bench.py <subcommand> [options]``.

A thin argparse dispatcher; each subcommand's logic lives in ``train/benchmarks/<name>_bench.py`` as
``add_arguments(parser)`` and ``main(args)``.
"""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    # the benchmarks load torch and transformers: only when a subcommand runs, not for --help
    from train.benchmarks import decoders_bench as decoding
    from train.benchmarks import distill_bench as distill
    from train.benchmarks import draft_length_bench as draft_length
    from train.benchmarks import draft_temperature_bench as draft_temperature
    from train.benchmarks import draft_vocab_bench as draft_vocab
    from train.benchmarks import eagle3_step_bench as eagle3_step
    from train.benchmarks import lookup_bench as lookup
    from train.benchmarks import overhead_bench as overhead

    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("decoding", help="our decoders vs Hugging Face generate / assisted generation")
    decoding.add_arguments(p)
    p.set_defaults(func=decoding.main)

    p = sub.add_parser("distill", help="on-policy distillation throughput: ours vs TRL's GKDTrainer")
    distill.add_arguments(p)
    p.set_defaults(func=distill.main)

    p = sub.add_parser("draft-length", help="chain SD: fixed against adaptive draft length, interleaved")
    draft_length.add_arguments(p)
    p.set_defaults(func=draft_length.main)

    p = sub.add_parser(
        "draft-temperature", help="an EAGLE-3 drafter's first-token acceptance per draft temperature"
    )
    draft_temperature.add_arguments(p)
    p.set_defaults(func=draft_temperature.main)

    p = sub.add_parser("draft-vocab", help="a drafter's output head: full vs reduced vocabulary")
    draft_vocab.add_arguments(p)
    p.set_defaults(func=draft_vocab.main)

    p = sub.add_parser("eagle3-step", help="an EAGLE-3 training step: online, grouped, cached features")
    eagle3_step.add_arguments(p)
    p.set_defaults(func=eagle3_step.main)

    p = sub.add_parser("lookup", help="prompt lookup against the drafter on the verifier's greedy answers")
    lookup.add_arguments(p)
    p.set_defaults(func=lookup.main)

    p = sub.add_parser("overhead", help="loop overhead of this engine vs an older copy, interleaved")
    overhead.add_arguments(p)
    p.set_defaults(func=overhead.main)

    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
