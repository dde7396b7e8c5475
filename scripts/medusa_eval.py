"""Evaluate trained Medusa heads with MedusaDecoder against autoregressive decoding (docs/medusa.md).

    python scripts/medusa_eval.py                         # the newest checkpoints/medusa/*/heads
    python scripts/medusa_eval.py --heads PATH --prompts 8 --tokens 64

Runs the evaluator (``train.evaluation.evaluate_drafters``: same prompts, paired timing, metric
contract) with the heads as the "drafter" and two trees: the default sparse tree and the blockwise
top-1 chain of depth 4, at T = 0 and 1, seeds 0 and 1. Prints the results table.
"""

from __future__ import annotations

import argparse
import glob
import os

import torch

from train.evaluation import EvalConfig, build_prompts, evaluate_drafters, results_table
from train.models.heads import MedusaHeads
from train.models.loading import eos_token_ids, load_model, load_tokenizer
from train.paths import project_root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default=None, help="a heads/ folder (default: the newest medusa run's)")
    parser.add_argument("--verifier", default=os.path.join(project_root(), "checkpoints", "tiny", "verifier"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    heads_dir = args.heads or max(
        glob.glob(os.path.join(project_root(), "checkpoints", "medusa", "*", "heads")), default=None
    )
    if heads_dir is None:
        raise SystemExit("error: no heads found; run `python train.py experiment=medusa` or pass --heads")
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.verifier)
    verifier = load_model(args.verifier).eval()
    heads = MedusaHeads.from_pretrained(heads_dir).eval()
    prompts = build_prompts(tokenizer, num_prompts=args.prompts, prompt_len=64)
    medusa = {"_target_": "train.decoding.MedusaDecoder", "_partial_": True}
    decoders = [
        {"name": "medusa default tree", **medusa},
        {"name": "blockwise chain 4", **medusa, "tree": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]},
    ]
    cfg = EvalConfig(
        temperatures=[0.0, 1.0],
        seeds=[0, 1],
        decoders=decoders,
        max_new_tokens=args.tokens,
        progress=False,
        plots=False,
    )
    results = evaluate_drafters(
        verifier, {"medusa-1": heads}, prompts, cfg, eos_token_id=eos_token_ids(tokenizer, verifier)
    )
    print(f"heads: {heads_dir}")
    print(results_table(results))


if __name__ == "__main__":
    main()
