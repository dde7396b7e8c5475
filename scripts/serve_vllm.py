"""Serve a run's exports in vLLM next to this project's evaluator: ``python scripts/serve_vllm.py RUN_DIR``.

For every export in RUN_DIR that vLLM serves (``drafter/``: draft_model, ``heads_vllm/``: medusa,
``eagle3_speculators/``: eagle3), or the folders named with ``--export``: vLLM's acceptance per position,
block efficiency and tokens/s with and without speculation, beside this project's evaluator on the same
drafter and prompts, and whether vLLM's greedy output with speculation equals its own without.
Needs the vLLM environment (docs/serving.md). Writes RUN_DIR/vllm/serving.{json,md} and vllm.log. An export
vLLM refuses (a method its build cannot run, e.g. ``dspark`` on the CPU build) gets vLLM's reason in its row
and this project's figures beside it; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="serve_vllm.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "run_dir", help="a training run directory (its config.yaml names the verifier and data)"
    )
    parser.add_argument(
        "--export", action="append", default=[], help="an export folder (repeatable; default: all)"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=4,
        help="num_speculative_tokens (Medusa: its heads; DFlash: its block - 1)",
    )
    parser.add_argument(
        "--prompts", type=int, default=None, help="held-out prompts (default: the run's eval)"
    )
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--vllm-python", default=None, help="the vLLM environment's Python (default: .venv-vllm)"
    )
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/vllm)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    from train.serving.serve import serve_run
    from train.vllm.run import VllmNotInstalledError, VllmRunError

    try:
        report = serve_run(
            args.run_dir,
            args.export,
            num_speculative_tokens=args.tokens,
            num_prompts=args.prompts,
            prompt_len=args.prompt_len,
            max_new_tokens=args.max_new_tokens,
            python=args.vllm_python,
            out_dir=args.out,
        )
    except (VllmNotInstalledError, VllmRunError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    refused = [row for row in report["rows"] if row.get("refused")]
    for row in refused:
        print(
            f"error: vLLM {row['vllm_version']} did not serve {row['folder']}: {row['refused']}",
            file=sys.stderr,
        )
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
