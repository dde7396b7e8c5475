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
import glob
import os

from omegaconf import OmegaConf

from train.cli.console import add_device_arguments
from train.config import instantiate_group
from train.evaluation import EvalConfig, build_prompts, evaluate_drafters, results_table
from train.models.heads import MedusaHeads
from train.models.loading import eos_token_ids, load_model, load_tokenizer
from train.paths import project_root


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
    heads_dir = args.heads or max(
        glob.glob(os.path.join(project_root(), "checkpoints", "medusa*", "*", "heads")),
        key=os.path.getmtime,
        default=None,
    )
    if heads_dir is None:
        raise SystemExit("error: no heads found; run `python train.py experiment=medusa` or pass --heads")
    run_dir = os.path.dirname(os.path.abspath(heads_dir))
    run = (
        OmegaConf.load(os.path.join(run_dir, "config.yaml"))
        if os.path.isfile(os.path.join(run_dir, "config.yaml"))
        else None
    )
    merged = os.path.join(run_dir, "verifier")
    verifier_dir = args.verifier or (
        merged
        if os.path.isdir(merged)
        else str(run.model.verifier)
        if run is not None
        else os.path.join(project_root(), "checkpoints", "tiny", "verifier")
    )
    dtype = str(run.model.dtype) if run is not None else "float32"
    tokenizer = load_tokenizer(verifier_dir)
    verifier = load_model(verifier_dir, dtype=dtype, device=args.device).eval()
    heads = MedusaHeads.from_pretrained(heads_dir).eval().to(device=args.device, dtype=verifier.dtype)
    data = instantiate_group(run, "data") if run is not None else None
    prompt_len = int(run.eval.prompt_len) if run is not None else 64
    prompts = build_prompts(tokenizer, data, num_prompts=args.prompts, prompt_len=prompt_len)
    medusa = {"_target_": "train.decoding.HeadsDecoder"}
    decoders = [{"name": f"tree {n}", **medusa, "tree_nodes": n} for n in args.sizes]
    decoders.append(
        {
            "name": f"chain {heads.num_heads}",
            **medusa,
            "tree": [[0] * d for d in range(1, heads.num_heads + 1)],
        }
    )
    cfg = EvalConfig(
        temperatures=list(args.temperatures),
        seeds=[0, 1],
        decoders=decoders,
        max_new_tokens=args.tokens,
        progress=False,
        plots=False,
        num_threads=args.threads or None,
        tie_ulps=float(run.eval.tie_ulps) if run is not None else 4.0,
    )
    results = evaluate_drafters(
        verifier, {"heads": heads}, prompts, cfg, eos_token_id=eos_token_ids(tokenizer, verifier)
    )
    print(f"heads: {heads_dir}\nverifier: {verifier_dir} ({dtype}, {args.threads or 'default'} threads)")
    print(results_table(results))


if __name__ == "__main__":
    main()
