"""BPD on trained heads (docs/bpd.md): the analysis of the heads' drafts, tuning on validation prompts,
then one final table on test prompts.

    python scripts/bpd.py                        # the newest checkpoints/medusa/*/heads
    python scripts/bpd.py --heads PATH --prompts 8 --tokens 64 --device cuda

The verifier, its dtype, the prompts (data and length), the tie tolerance and the neural rescorer are the
training run's, read from its ``config.yaml`` as ``scripts/medusa_eval.py`` reads them
(``research.pairs.heads_setup``; Medusa-2's merged ``verifier/``): on the real pair, SmolLM2 in
bfloat16 on held-out chat prompts of at most 256 tokens. The n-gram models are estimated here over the
verifier's token ids: the run's cached training answers (prompt + answer; the real pair's
``checkpoints/smollm2/answers/train.pt``), when it trained on them, plus the training split of its data
(``--saved-ngrams``: the ones the run saved with the heads instead).

1. Analysis (teacher-forced: the run's validation answers from each answer's first token when it trained
   on cached answers, else blocks of 128 tokens of the validation split): per head, top-1 / top-5
   agreement with the verifier's token, mean entropy (over the head's outputs: its draft vocabulary, if
   any), how often a head's top-1 repeats the previous slot's (the verifier's own next token before head
   0), and h_max (the last head up to which entropy rises monotonically) against the block efficiency of
   the top-1 chain at the same position.
2. Tuning (validation prompts, T = 0, block efficiency): alpha and k for the 2- and 4-gram rescorers
   and the neural rescorer, k for the p-best 0-gram; p is fixed (``--p``) so every global method
   verifies the same number of drafts.
3. Final (test prompts, used once): the heads' own draft (top-1 chain), p-best 0-gram, 2-gram, 4-gram
   and neural rescoring with the tuned settings, T = 0 and 1, seeds 0 and 1, through the evaluator.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # research/ is beside train/, not installed

import numpy as np
import torch

from research.pairs import DecodeSetup, heads_setup, newest_heads
from train.cli.console import add_device_arguments
from train.data.lm import document_token_ids
from train.data.sources import load_text_dataset
from train.decoding import HeadsDecoder
from train.decoding.refine import LocalNeuralRefiner, PBestRefiner
from train.evaluation import evaluate_drafters, results_table
from train.models.answers import Answer
from train.models.heads import MedusaHeads
from train.models.loading import eos_token_ids, load_model, load_tokenizer
from train.models.ngram import NGramLM
from train.tables import format_value, markdown_table
from train.training.answer_data import cached_answers

NGRAM_ORDERS = (2, 4)
BLOCK = 128
"""Tokens per teacher-forced block of the validation split (without cached answers)."""


@torch.no_grad()
def head_statistics(verifier: Any, heads: MedusaHeads, ids: list[int], first: int) -> dict[str, torch.Tensor]:
    """Per head k (rows) and position t from ``first`` on while head k's target t + k + 2 lies in ``ids``
    (columns): its top-1 / top-5 hold the verifier's own token (``agree``, ``top5``), its entropy over its
    outputs (``entropy``: the draft vocabulary, if any; outside it a head's probability is 0), its top-1
    equals the slot before it (``repeat``). Empty columns when no position qualifies."""
    usable = max(len(ids) - heads.num_heads - 1 - first, 0)
    out = verifier(input_ids=torch.tensor([ids], device=verifier.device), output_hidden_states=True)
    verifier_next = out.logits[0].argmax(-1)  # (T,): the verifier's token t + 1
    logp = heads.draft_logits(out.hidden_states[-1][0, first : first + usable]).float().log_softmax(-1)
    top = logp.topk(min(5, logp.shape[-1]), dim=-1).indices  # (K, usable, 5): rows of the heads' outputs
    if heads.draft_vocab is not None:
        top = heads.draft_ids[top]  # the draft vocabulary's rows as token ids
    targets = torch.stack(
        [verifier_next[first + k + 1 : first + k + 1 + usable] for k in range(heads.num_heads)]
    )
    previous = torch.cat([verifier_next[None, first : first + usable], top[:-1, :, 0]])
    stats = {
        "agree": top[..., 0] == targets,
        "top5": (top == targets.unsqueeze(-1)).any(-1),
        "entropy": torch.special.entr(logp.exp()).sum(-1),
        "repeat": top[..., 0] == previous,
    }
    return {k: v.cpu() for k, v in stats.items()}


def analyse(verifier: Any, heads: MedusaHeads, sequences: list[tuple[list[int], int]]) -> str:
    """The analysis tables (Markdown) from teacher-forced ``(ids, first analysed position)`` sequences."""
    per_sequence = [head_statistics(verifier, heads, ids, first) for ids, first in sequences]
    stats = {k: torch.cat([s[k] for s in per_sequence], dim=1) for k in per_sequence[0]}
    agree, entropy = stats["agree"], stats["entropy"]
    rows = [
        [str(k), f"t+{k + 2}"]
        + [format_value(float(stats[key][k].float().mean()), 2 if key == "entropy" else 3) for key in stats]
        for k in range(heads.num_heads)
    ]
    per_head = markdown_table(
        ["head", "predicts", "top-1 = verifier", "top-5 has it", "entropy (nats)", "repeats previous slot"],
        rows,
        "llrrrr",
    )
    # h_max: the last head up to which entropy rises monotonically; tau: 1 + leading agreeing heads
    rising = torch.cat([torch.ones_like(entropy[:1], dtype=torch.bool), entropy[1:] >= entropy[:-1]])
    h_max = rising.long().cumprod(0).sum(0) - 1  # (positions,), 0..K-1
    tau = 1 + agree.long().cumprod(0).sum(0)
    h_rows = []
    for h in range(heads.num_heads):
        mask = h_max == h
        if bool(mask.any()):
            h_rows.append([str(h), str(int(mask.sum())), format_value(float(tau[mask].float().mean()), 3)])
    corr = pearson(h_max.float().numpy(), tau.float().numpy())
    by_h = markdown_table(["h_max", "positions", "mean chain block efficiency"], h_rows, "lrr")
    return (
        f"{per_head.rstrip()}\n\n{by_h.rstrip()}\n\nPearson correlation of h_max with the chain's block "
        f"efficiency over {tau.numel()} positions: {corr}.\n"
    )


def pearson(a: np.ndarray, b: np.ndarray) -> str:
    """Pearson's correlation of ``a`` and ``b`` to 3 decimals, or why it is undefined."""
    if a.std() == 0 or b.std() == 0:
        return "undefined (one of the two is constant)"
    return f"{np.corrcoef(a, b)[0, 1]:.3f}"


def analysis_sequences(
    setup: DecodeSetup, tokenizer: Any, answers: dict[str, list[Answer]] | None, count: int
) -> tuple[list[tuple[list[int], int]], str]:
    """At most ``count`` teacher-forced sequences ``(ids, first analysed position)`` and their description:
    the validation answers (prompt + answer, from the row that predicts the answer's first token), or
    blocks of the validation split without answers."""
    if answers is not None:
        chosen = answers["validation"][:count]
        sequences = [([*a.prompt, *a.answer], len(a.prompt) - 1) for a in chosen]
        return sequences, f"the cached validation answers, teacher-forced: {len(sequences)} answers"
    documents = document_token_ids(load_text_dataset(setup.data, tokenizer)["validation"], tokenizer)
    stream = [t for d in documents for t in d][: count * BLOCK]
    sequences = [(stream[i : i + BLOCK], 0) for i in range(0, len(stream) - BLOCK + 1, BLOCK)]
    return sequences, f"validation split, teacher-forced, {len(sequences)} blocks of {BLOCK} tokens"


def ngram_documents(
    setup: DecodeSetup, tokenizer: Any, answers: dict[str, list[Answer]] | None
) -> list[list[int]]:
    """The n-gram models' training text, as the verifier's token ids: every training answer (prompt +
    answer), then the data's training documents that are not already an answer's prompt."""
    train = answers["train"] if answers is not None else []
    documents, seen = [[*a.prompt, *a.answer] for a in train], {tuple(a.prompt) for a in train}
    corpus = document_token_ids(load_text_dataset(setup.data, tokenizer)["train"], tokenizer)
    return documents + [d for d in corpus if tuple(d) not in seen]


def ngram_folders(documents: list[list[int]], vocab: int, out_dir: str) -> dict[int, str]:
    """The 2- and 4-gram models fitted to ``documents`` and saved under ``out_dir``: their folders."""
    vocab = max(vocab, max((max(d) for d in documents if d), default=0) + 1)
    return {
        n: str(NGramLM(n, vocab).fit(documents).save(os.path.join(out_dir, f"ngram_{n}")))
        for n in NGRAM_ORDERS
    }


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


def tune(
    verifier: Any, heads: Any, drafter: Any, ngram: dict[int, NGramLM], prompts: list[torch.Tensor], args: Any
) -> dict[str, dict[str, Any]]:
    """Print the tuning table; each method's best settings."""
    grid: dict[str, list[tuple[dict[str, Any], Any]]] = {
        "p-best 0-gram": [({"k": k}, PBestRefiner(None, k=k, p=args.p, alpha=0.0)) for k in (3, 5, 8)],
        **{
            f"{n}-gram": [
                ({"k": k, "alpha": a}, PBestRefiner(ngram[n], k=k, p=args.p, alpha=a))
                for k, a in itertools.product((3, 5), (0.2, 0.4, 0.6, 0.8))
            ]
            for n in NGRAM_ORDERS
        },
        "neural": [
            ({"k": k, "alpha": a}, LocalNeuralRefiner(drafter, k=k, alpha=a))
            for k, a in itertools.product((3, 5), (0.2, 0.4, 0.6, 0.8))
        ],
    }
    own = greedy_tau(verifier, heads, None, prompts, args.tokens)
    rows, chosen = [["heads' own draft (top-1 chain)", "-", format_value(own, 3)]], {}
    for method, options in grid.items():
        scored = [(greedy_tau(verifier, heads, ref, prompts, args.tokens), s) for s, ref in options]
        for tau, settings in scored:
            rows.append([method, ", ".join(f"{k}={v}" for k, v in settings.items()), format_value(tau, 3)])
        chosen[method] = max(scored, key=lambda item: item[0])[1]
    print(markdown_table(["method", "settings", "block efficiency"], rows, "llr"))
    print(
        "Chosen: "
        + "; ".join(f"{m}: {', '.join(f'{k}={v}' for k, v in s.items())}" for m, s in chosen.items())
    )
    return chosen


def final_decoders(
    chosen: dict[str, dict[str, Any]], heads: Any, folders: dict[int, str], setup: DecodeSetup, args: Any
) -> list[dict[str, Any]]:
    """The evaluator's decoder configs: the heads' own draft, then each method with its tuned settings."""
    decoders: list[dict[str, Any]] = [
        {"name": "heads' own draft", "_target_": "train.decoding.HeadsDecoder", "tree": _chain(heads)}
    ]
    for method, settings in chosen.items():
        refiner: dict[str, Any] = {"_target_": "train.decoding.refine.PBestRefiner", "p": args.p, **settings}
        if method == "neural":
            refiner = {"_target_": "train.decoding.refine.LocalNeuralRefiner", **settings}
            refiner["lm"] = {
                "_target_": "train.models.loading.load_model",
                "source": args.drafter or setup.drafter,
                "dtype": setup.dtype,
                "device": str(args.drafter_device or args.device),
            }
        elif method.endswith("-gram") and method[0].isdigit():
            refiner["lm"] = {"_target_": "train.models.ngram.NGramLM.load", "folder": folders[int(method[0])]}
        else:
            refiner.update(lm=None, alpha=0.0)
        decoders.append({"name": method, "_target_": "train.decoding.HeadsDecoder", "refiner": refiner})
    return decoders


def final_table(
    verifier: Any,
    heads: Any,
    decoders: list[dict[str, Any]],
    prompts: list[torch.Tensor],
    setup: DecodeSetup,
    args: Any,
) -> str:
    """The evaluator's table of ``decoders`` on the test ``prompts``, T = 0 and 1, seeds 0 and 1."""
    cfg = setup.eval_config(decoders, [0.0, 1.0], [0, 1], args.tokens, args.threads or None)
    return results_table(evaluate_drafters(verifier, {"heads": heads}, prompts, cfg, eos_token_id=args.eos))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default=None, help="a heads/ folder (default: the newest medusa run's)")
    parser.add_argument(
        "--verifier", default=None, help="default: the run's (Medusa-2: its merged verifier/)"
    )
    parser.add_argument("--drafter", default=None, help="the neural rescorer (default: the run's drafter)")
    parser.add_argument("--p", type=int, default=4, help="drafts verified per step by the global methods")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--analysis", type=int, default=64, help="teacher-forced sequences analysed")
    parser.add_argument(
        "--saved-ngrams", action="store_true", help="the n-gram models saved with the heads (ngram_2/4)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    add_device_arguments(parser)  # --drafter-device: the neural rescorer (the heads sit with the verifier)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    heads_dir = args.heads or newest_heads("medusa")
    if heads_dir is None:
        raise SystemExit("error: no heads found; run `python train.py experiment=medusa` or pass --heads")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    setup = heads_setup(heads_dir, args.verifier)
    tokenizer = load_tokenizer(setup.verifier)
    verifier = load_model(setup.verifier, dtype=setup.dtype, role="verifier", device=args.device).eval()
    drafter_device = args.drafter_device or args.device
    drafter_source = args.drafter or setup.drafter
    if drafter_source is None:
        raise SystemExit(f"--drafter: the heads' run {heads_dir} names no drafter model; pass one")
    drafter = load_model(drafter_source, dtype=setup.dtype, role="drafter", device=drafter_device)
    drafter.eval()
    args.eos = eos_token_ids(tokenizer, verifier)
    heads = MedusaHeads.from_pretrained(heads_dir).eval().to(device=args.device, dtype=verifier.dtype)
    answers = cached_answers(setup.answers) if setup.answers is not None else None
    with tempfile.TemporaryDirectory() as scratch:
        if args.saved_ngrams:
            folders = {n: os.path.join(heads_dir, f"ngram_{n}") for n in NGRAM_ORDERS}
        else:
            folders = ngram_folders(ngram_documents(setup, tokenizer, answers), heads.vocab_size, scratch)
        ngram = {n: NGramLM.load(folder) for n, folder in folders.items()}
        sequences, described = analysis_sequences(setup, tokenizer, answers, args.analysis)
        print(
            f"# BPD on {heads_dir}\n\n"
            f"verifier: {setup.verifier} ({setup.dtype}, {torch.get_num_threads()} threads)\n"
        )
        print(f"## Analysis ({described})\n\n{analyse(verifier, heads, sequences)}")
        print(f"## Tuning (validation prompts, T = 0, p = {args.p})\n")
        val_prompts = setup.prompts(tokenizer, args.prompts, seed=1, split="validation")
        chosen = tune(verifier, heads, drafter, ngram, val_prompts, args)
        print("\n## Final (test prompts, used once)\n")
        decoders = final_decoders(chosen, heads, folders, setup, args)
        print(final_table(verifier, heads, decoders, setup.prompts(tokenizer, args.prompts), setup, args))
    print(f"Total time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
