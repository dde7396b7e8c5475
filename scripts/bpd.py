"""BPD on trained heads (docs/bpd.md): the analysis of the heads' drafts, tuning on validation prompts,
then one final table on test prompts.

    python scripts/bpd.py                        # the newest checkpoints/medusa/*/heads (with ngram_2/4)
    python scripts/bpd.py --heads PATH --prompts 8 --tokens 64 --device cuda

1. Analysis (validation split, teacher-forced): per head, top-1 / top-5 agreement with the verifier's
   token, mean entropy, how often a head's top-1 repeats the previous slot's (the verifier's own next
   token before head 0), and h_max (the last head up to which entropy rises monotonically) against the
   block efficiency of the top-1 chain at the same position.
2. Tuning (validation prompts, T = 0, block efficiency): alpha and k for the 2- and 4-gram rescorers
   and the neural rescorer, k for the p-best 0-gram; p is fixed (``--p``) so every global method
   verifies the same number of drafts.
3. Final (test prompts, used once): the heads' own draft (top-1 chain), p-best 0-gram, 2-gram, 4-gram
   and neural rescoring with the tuned settings, T = 0 and 1, seeds 0 and 1, through the evaluator.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import time
from typing import Any

import numpy as np
import torch

from train.cli.console import add_device_arguments
from train.data.lm import document_token_ids
from train.data.sources import DataSourceConfig, load_text_dataset
from train.decoding import HeadsDecoder
from train.decoding.refine import LocalNeuralRefiner, PBestRefiner
from train.evaluation import EvalConfig, build_prompts, evaluate_drafters, results_table
from train.models.heads import MedusaHeads
from train.models.loading import eos_token_ids, load_model, load_tokenizer
from train.models.ngram import NGramLM
from train.paths import project_root
from train.tables import format_value, markdown_table


def analyse(verifier: Any, heads: MedusaHeads, blocks: torch.Tensor) -> str:
    """The analysis tables (Markdown) from teacher-forced validation blocks (N, T)."""
    with torch.no_grad():
        out = verifier(input_ids=blocks.to(verifier.device), output_hidden_states=True)
        head_logits = heads(out.hidden_states[-1])  # (K, N, T, V)
    num_heads, _, length, _ = head_logits.shape
    usable = length - num_heads - 1
    verifier_next = out.logits.argmax(-1)  # (N, T): token t + 1
    logp = head_logits.float().log_softmax(-1)[:, :, :usable]
    entropy = -(logp.exp() * logp).sum(-1)  # (K, N, usable)
    top = logp.topk(5, dim=-1).indices  # (K, N, usable, 5)
    targets = torch.stack(
        [verifier_next[:, k + 1 : k + 1 + usable] for k in range(num_heads)]
    )  # (K, N, usable)
    agree = top[..., 0] == targets
    top5 = (top == targets.unsqueeze(-1)).any(-1)
    previous = torch.cat([verifier_next[None, :, :usable], top[:-1, ..., 0]])  # the slot before each head
    repeat = top[..., 0] == previous
    rows = [
        [
            str(k),
            f"t+{k + 2}",
            format_value(float(agree[k].float().mean()), 3),
            format_value(float(top5[k].float().mean()), 3),
            format_value(float(entropy[k].mean()), 2),
            format_value(float(repeat[k].float().mean()), 3),
        ]
        for k in range(num_heads)
    ]
    per_head = markdown_table(
        ["head", "predicts", "top-1 = verifier", "top-5 has it", "entropy (nats)", "repeats previous slot"],
        rows,
        "llrrrr",
    )
    # h_max: the last head up to which entropy rises monotonically; tau: 1 + leading agreeing heads
    rising = torch.cat([torch.ones_like(entropy[:1], dtype=torch.bool), entropy[1:] >= entropy[:-1]])
    h_max = rising.long().cumprod(0).sum(0) - 1  # (N, usable), 0..K-1
    tau = 1 + agree.long().cumprod(0).sum(0)
    h_rows = []
    for h in range(num_heads):
        mask = h_max == h
        if bool(mask.any()):
            h_rows.append([str(h), str(int(mask.sum())), format_value(float(tau[mask].float().mean()), 3)])
    corr = np.corrcoef(h_max.flatten().float().cpu().numpy(), tau.flatten().float().cpu().numpy())[0, 1]
    by_h = markdown_table(["h_max", "positions", "mean chain block efficiency"], h_rows, "lrr")
    return (
        f"{per_head.rstrip()}\n\n{by_h.rstrip()}\n\nPearson correlation of h_max with the chain's block "
        f"efficiency over {tau.numel()} positions: {corr:.3f}.\n"
    )


def greedy_tau(verifier: Any, heads: Any, refiner: Any, prompts: list[torch.Tensor], tokens: int) -> float:
    decoder = HeadsDecoder(
        verifier, heads, tree=None if refiner is not None else _chain(heads), refiner=refiner
    )
    made = calls = 0
    for prompt in prompts:
        stats = decoder.generate(prompt, tokens).stats
        made += stats.new_tokens
        calls += stats.verifier_calls  # the metric contract's block efficiency: tokens per verifier call
    return made / calls


def _chain(heads: Any) -> list[list[int]]:
    return [[0] * d for d in range(1, heads.num_heads + 1)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default=None)
    parser.add_argument("--verifier", default=os.path.join(project_root(), "checkpoints", "tiny", "verifier"))
    parser.add_argument("--drafter", default=os.path.join(project_root(), "checkpoints", "tiny", "drafter"))
    parser.add_argument("--p", type=int, default=4, help="drafts verified per step by the global methods")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    add_device_arguments(parser)  # --drafter-device: the neural rescorer (the heads sit with the verifier)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    heads_dir = args.heads or max(
        (
            d
            for d in glob.glob(os.path.join(project_root(), "checkpoints", "medusa", "*", "heads"))
            if os.path.isdir(os.path.join(d, "ngram_4"))
        ),
        default=None,
    )
    if heads_dir is None:
        raise SystemExit(
            "error: no heads with n-gram models; run `python train.py experiment=medusa` or pass --heads"
        )
    torch.set_num_threads(1)
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.verifier)
    drafter_device = args.drafter_device or args.device
    verifier = load_model(args.verifier, device=args.device).eval()
    drafter = load_model(args.drafter, device=drafter_device).eval()
    heads = MedusaHeads.from_pretrained(heads_dir).eval().to(args.device)
    ngram = {n: NGramLM.load(os.path.join(heads_dir, f"ngram_{n}")) for n in (2, 4)}
    data = DataSourceConfig(name="stdlib", corpus_dir=os.path.join(project_root(), "data", "stdlib_corpus"))

    print(
        f"# BPD on {heads_dir}\n\n## Analysis (validation split, teacher-forced, 64 blocks of 128 tokens)\n"
    )
    documents = document_token_ids(load_text_dataset(data, tokenizer)["validation"], tokenizer)
    stream = [t for d in documents for t in d][: 64 * 128]
    print(analyse(verifier, heads, torch.tensor(stream).view(-1, 128)))

    print(f"## Tuning (validation prompts, T = 0, p = {args.p})\n")
    val_prompts = build_prompts(tokenizer, data, args.prompts, 64, seed=1, split="validation")
    grid: dict[str, list[tuple[dict[str, Any], Any]]] = {
        "p-best 0-gram": [({"k": k}, PBestRefiner(None, k=k, p=args.p, alpha=0.0)) for k in (3, 5, 8)],
        **{
            f"{n}-gram": [
                ({"k": k, "alpha": a}, PBestRefiner(ngram[n], k=k, p=args.p, alpha=a))
                for k, a in itertools.product((3, 5), (0.2, 0.4, 0.6, 0.8))
            ]
            for n in (2, 4)
        },
        "neural": [
            ({"k": k, "alpha": a}, LocalNeuralRefiner(drafter, k=k, alpha=a))
            for k, a in itertools.product((3, 5), (0.2, 0.4, 0.6, 0.8))
        ],
    }
    chosen: dict[str, tuple[dict[str, Any], Any]] = {}
    rows = [
        [
            "heads' own draft (top-1 chain)",
            "-",
            format_value(greedy_tau(verifier, heads, None, val_prompts, args.tokens), 3),
        ]
    ]
    for method, options in grid.items():
        scored = [
            (greedy_tau(verifier, heads, ref, val_prompts, args.tokens), settings, ref)
            for settings, ref in options
        ]
        for tau, settings, _ in scored:
            rows.append([method, ", ".join(f"{k}={v}" for k, v in settings.items()), format_value(tau, 3)])
        best = max(scored, key=lambda item: item[0])
        chosen[method] = (best[1], best[2])
    print(markdown_table(["method", "settings", "block efficiency"], rows, "llr"))
    print(
        "Chosen: "
        + "; ".join(f"{m}: {', '.join(f'{k}={v}' for k, v in s.items())}" for m, (s, _) in chosen.items())
        + "\n"
    )

    print("## Final (test prompts, used once)\n")
    test_prompts = build_prompts(tokenizer, data, args.prompts, 64, seed=0, split="test")
    decoders = [
        {"name": "heads' own draft", "_target_": "train.decoding.HeadsDecoder", "tree": _chain(heads)}
    ]
    for method, (settings, _) in chosen.items():
        refiner: dict[str, Any] = {"_target_": "train.decoding.refine.PBestRefiner", "p": args.p, **settings}
        if method == "neural":
            refiner = {"_target_": "train.decoding.refine.LocalNeuralRefiner", **settings}
            refiner["lm"] = {
                "_target_": "train.models.loading.load_model",
                "source": args.drafter,
                "device": str(drafter_device),
            }
        elif method.endswith("-gram") and method[0].isdigit():
            refiner["lm"] = {
                "_target_": "train.models.ngram.NGramLM.load",
                "folder": os.path.join(heads_dir, f"ngram_{method[0]}"),
            }
        else:
            refiner.update(lm=None, alpha=0.0)
        decoders.append({"name": method, "_target_": "train.decoding.HeadsDecoder", "refiner": refiner})
    cfg = EvalConfig(
        temperatures=[0.0, 1.0],
        seeds=[0, 1],
        decoders=decoders,
        max_new_tokens=args.tokens,
        progress=False,
        plots=False,
    )
    results = evaluate_drafters(
        verifier, {"heads": heads}, test_prompts, cfg, eos_token_id=eos_token_ids(tokenizer, verifier)
    )
    print(results_table(results))
    print(f"Total time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
