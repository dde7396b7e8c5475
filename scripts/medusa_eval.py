"""Tree sizes for trained Medusa heads: HeadsDecoder with trees of N nodes built from the heads'
measured per-rank accuracies, and the blockwise top-1 chain, against autoregressive decoding
(docs/medusa.md). Reports tau and the paired wall-clock speedup of each size on this machine.

    python scripts/medusa_eval.py                          # the newest checkpoints/medusa*/*/heads
    python scripts/medusa_eval.py --heads PATH --sizes 4 8 16 32 --prompts 8 --tokens 64 --device cuda

The verifier, its dtype and the prompts are the training run's (its ``config.yaml``: ``model.verifier``,
``model.dtype``, ``data``, ``eval.prompt_len`` and ``eval.tie_ulps``; Medusa-2's merged ``verifier/``);
heads without a run config fall back to the tiny pair's verifier and the embedded corpus.

The evaluator does the measuring (``train.evaluation.evaluate_drafters``: same prompts, paired timing,
greedy check at T = 0). A single evaluation of saved heads is ``python scripts/evaluate.py
decoding=medusa heads=PATH``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # research/ is beside train/, not installed

from research.pairs import heads_setup, newest_heads
from train.cli.console import add_device_arguments
from train.evaluation import evaluate_drafters, results_table
from train.models.heads import MedusaHeads
from train.models.loading import eos_token_ids, load_model, load_tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default=None, help="a heads/ folder (default: the newest medusa run's)")
    parser.add_argument(
        "--verifier", default=None, help="default: the run's merged verifier/, else the tiny one"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads while decoding (0: leave as is)"
    )
    add_device_arguments(parser, drafter=False)  # the heads read the verifier's states: they sit with it
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    heads_dir = args.heads or newest_heads()
    if heads_dir is None:
        raise SystemExit("error: no heads found; run `python train.py experiment=medusa` or pass --heads")
    setup = heads_setup(heads_dir, args.verifier)
    tokenizer = load_tokenizer(setup.verifier)
    verifier = load_model(setup.verifier, dtype=setup.dtype, device=args.device).eval()
    heads = MedusaHeads.from_pretrained(heads_dir).eval().to(device=args.device, dtype=verifier.dtype)
    prompts = setup.prompts(tokenizer, args.prompts)
    medusa = {"_target_": "train.decoding.HeadsDecoder"}
    decoders = [{"name": f"tree {n}", **medusa, "tree_nodes": n} for n in args.sizes]
    decoders.append(
        {
            "name": f"chain {heads.num_heads}",
            **medusa,
            "tree": [[0] * d for d in range(1, heads.num_heads + 1)],
        }
    )
    cfg = setup.eval_config(decoders, list(args.temperatures), [0, 1], args.tokens, args.threads or None)
    results = evaluate_drafters(
        verifier, {"heads": heads}, prompts, cfg, eos_token_id=eos_token_ids(tokenizer, verifier)
    )
    print(
        f"heads: {heads_dir}\nverifier: {setup.verifier} ({setup.dtype}, {args.threads or 'default'} threads)"
    )
    print(results_table(results))


if __name__ == "__main__":
    main()
