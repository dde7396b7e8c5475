"""What one EAGLE-3 training step costs on the real pair, and what the feature cache and length grouping save.

    python scripts/bench.py eagle3-step            # checkpoints/smollm2 (built by any real-pair run)

The recipe of ``experiment=eagle3`` (batch 8, rows of up to 384 prompt + answer tokens, prompt rows
counted, 5 TTT steps, the 8,192 most frequent answer tokens, the verifier in bfloat16 where the CPU
has it, the drafter's float32 weights under bfloat16 autocast), on the pair's cached training answers.
Variants, each over the same number of batches after warm-up steps:

- ``online-random``: the verifier runs in every step, batches drawn at random (the recipe before
  ``group_by_length`` and ``feature_cache_gb``);
- ``online-grouped``: the verifier in every step, batches grouped by length (an epoch's first pass);
- ``cached-grouped``: grouped batches whose features were kept by an untimed first pass (every later
  epoch).

Reported per variant: mean seconds per step, split into the verifier's features and targets (or the
cache's) and the training-time test (forward, backward, optimizer step); the padded tokens a batch
computes per real token; and steps per minute relative to ``online-random``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from research.pairs import load_pair, pair_setup
from train.methods.eagle3.build import eagle3_drafter
from train.methods.eagle3.config import Eagle3Config
from train.methods.eagle3.module import Eagle3Module
from train.models.answers import load_answers
from train.models.eagle3_ttt import ttt_loss
from train.tables import markdown_table
from train.training.answer_data import answer_batches

VARIANTS = {
    "online-random": (False, 0.0),
    "online-grouped": (True, 0.0),
    "cached-grouped": (True, 4.0),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pair", default="checkpoints/smollm2", help="the real pair's folder (verifier/, answers/)"
    )
    parser.add_argument("--batches", type=int, default=12, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--ttt-steps", type=int, default=5)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument(
        "--aux-layers", type=int, nargs="+", default=None, help="default: EAGLE-3's [2, L//2, L-3]"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def time_variant(
    args: argparse.Namespace, verifier: torch.nn.Module, tokenizer: Any, answers: dict[str, Any], name: str
) -> dict[str, Any]:
    group, cache_gb = VARIANTS[name]
    torch.manual_seed(args.seed)
    cfg = Eagle3Config(
        optimizer=torch.optim.AdamW,
        ttt_steps=args.ttt_steps,
        draft_vocab_size=args.draft_vocab,
        aux_layers=args.aux_layers,
        max_len=args.max_len,
        batch_size=args.batch_size,
        prompt_loss=True,
        group_by_length=group,
        feature_cache_gb=cache_gb,
    )
    module = Eagle3Module(
        verifier, eagle3_drafter(cfg, verifier, tokenizer, answers["train"]), cfg, tokenizer
    )
    data = answer_batches(answers, verifier, tokenizer, args.batch_size, args.max_len, args.seed, True, group)
    batches = list(data.train_dataloader())[: args.warmup + args.batches]
    if cache_gb > 0:  # the first epoch, untimed: every later one reads what it kept
        for batch in batches:
            module.features_and_targets(batch)
    params = [p for p in module.drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=verifier.dtype == torch.bfloat16)
    features, steps, padded, real = [], [], 0, 0
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        with autocast:
            aux, targets = module.features_and_targets(batch)
            middle = time.perf_counter()
            result = ttt_loss(
                module.drafter,
                aux,
                batch["input_ids"],
                targets,
                batch["loss_mask"],
                steps=args.ttt_steps,
                chain_stats=False,
            )
        result.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        end = time.perf_counter()
        if i >= args.warmup:
            features.append(middle - start)
            steps.append(end - middle)
            padded += batch["input_ids"].numel()
            real += int(batch["attention_mask"].sum())
    feature_s, ttt_s = statistics.mean(features), statistics.mean(steps)
    return {
        "variant": name,
        "features_s": feature_s,
        "ttt_s": ttt_s,
        "step_s": feature_s + ttt_s,
        "padded_per_real": padded / real,
        "cache_hits": module.feature_cache.hits,
    }


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    folder = Path(args.pair)
    pair = load_pair(pair_setup(args.pair), with_drafter=False)
    verifier, tokenizer, dtype = pair.verifier, pair.tokenizer, pair.dtype
    answers = {s: load_answers(str(folder / "answers" / f"{s}.pt")) for s in ("train", "validation")}
    rows = [time_variant(args, verifier, tokenizer, answers, name) for name in args.variants]
    base = next((r["step_s"] for r in rows if r["variant"] == "online-random"), rows[0]["step_s"])
    print(
        f"EAGLE-3 training step on {folder} ({dtype}, {torch.get_num_threads()} threads): "
        f"batch {args.batch_size}, max_len {args.max_len}, {args.ttt_steps} TTT steps, "
        f"{args.draft_vocab} draft ids; mean of {args.batches} steps"
    )
    print(
        markdown_table(
            [
                "variant",
                "features / targets s",
                "TTT fwd+bwd+opt s",
                "step s",
                "padded / real tokens",
                "steps / min vs first",
            ],
            [
                [
                    r["variant"],
                    f"{r['features_s']:.2f}",
                    f"{r['ttt_s']:.2f}",
                    f"{r['step_s']:.2f}",
                    f"{r['padded_per_real']:.2f}",
                    f"{base / r['step_s']:.2f}x",
                ]
                for r in rows
            ],
        )
    )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return rows
