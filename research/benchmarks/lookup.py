"""What a sequence's own past predicts: prompt lookup against the drafter on the verifier's greedy answers.

    python scripts/bench.py lookup --pair checkpoints/smollm2
    python scripts/bench.py lookup --pair checkpoints/smollm2 --drafter <run>/drafter

At T = 0 decoding follows the verifier's greedy answer, so what a block starting at answer position i
accepts is known without decoding: the drafter's chain is accepted while its argmax equals the answer
(its context is then the answer's own), which one teacher-forced drafter forward per answer gives for
every i; prompt lookup's copy at i (:func:`~train.decoding.proposers.lookup_proposer.lookup_continuation`
over the prompt and the answer before i) is compared with the answer directly. Over the pair's
validation answers it reports the share of positions where lookup copies something, and there and
elsewhere the first draft's acceptance and the mean accepted run (capped at ``--tokens``) of the copy and
of the drafter: whether lookup pays on these prompts before any timing (docs/decoding.md#prompt-lookup).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from train.decoding.proposers.lookup_proposer import lookup_continuation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pair", required=True, help="a real pair's folder, e.g. checkpoints/smollm2")
    parser.add_argument("--drafter", default=None, help="another drafter folder (a run's drafter/)")
    parser.add_argument("--answers", type=int, default=48, help="validation answers to read")
    parser.add_argument("--tokens", type=int, default=6, help="the most tokens a copy or a chain drafts")
    parser.add_argument("--max-ngram", type=int, default=3)
    parser.add_argument("--min-ngram", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)


def accepted_runs(matches: list[bool], cap: int) -> list[int]:
    """For each position i, how many of positions i, i+1, ... match in a row (at most ``cap``)."""
    runs = [0] * (len(matches) + 1)
    for i in range(len(matches) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if matches[i] else 0
    return [min(r, cap) for r in runs[:-1]]


def copied_runs(prompt: list[int], answer: list[int], args: argparse.Namespace) -> list[int | None]:
    """For each answer position, the accepted length of lookup's copy there (None: nothing to copy)."""
    out: list[int | None] = []
    for i in range(len(answer)):
        copy = lookup_continuation(prompt + answer[:i], args.max_ngram, args.min_ngram, args.tokens)
        if not copy:
            out.append(None)
            continue
        n = 0
        while n < len(copy) and i + n < len(answer) and copy[n] == answer[i + n]:
            n += 1
        out.append(n)
    return out


def _load(args: argparse.Namespace) -> tuple[torch.nn.Module, list[Any]]:
    from transformers import AutoModelForCausalLM

    from train.models.answers import load_answers
    from train.models.draft_vocab import with_draft_vocab

    root = Path(args.pair)
    folder = args.drafter or str(root / "drafter")
    drafter = with_draft_vocab(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    return drafter, load_answers(str(root / "answers" / "validation.pt"))[: args.answers]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    drafter, answers = _load(args)
    drafter_runs: list[int] = []
    copy_runs: list[int | None] = []
    for a in answers:
        prompt, answer = list(a.prompt), list(a.answer)
        with torch.no_grad():
            logits = drafter(torch.tensor([prompt + answer])).logits[0]
        predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        drafter_runs += accepted_runs([p == t for p, t in zip(predicted, answer, strict=True)], args.tokens)
        copy_runs += copied_runs(prompt, answer, args)
    copied = [i for i, r in enumerate(copy_runs) if r is not None]
    rest = [i for i, r in enumerate(copy_runs) if r is None]
    row = {
        "positions": float(len(copy_runs)),
        "copy_share": len(copied) / len(copy_runs),
        "copy_first": _mean([float((copy_runs[i] or 0) > 0) for i in copied]),
        "copy_run": _mean([float(copy_runs[i] or 0) for i in copied]),
        "drafter_first_where_copied": _mean([float(drafter_runs[i] > 0) for i in copied]),
        "drafter_run_where_copied": _mean([float(drafter_runs[i]) for i in copied]),
        "drafter_first_elsewhere": _mean([float(drafter_runs[i] > 0) for i in rest]),
        "drafter_run_elsewhere": _mean([float(drafter_runs[i]) for i in rest]),
    }
    print(f"{len(answers)} validation answers, {len(copy_runs)} positions; runs capped at {args.tokens}")
    print(f"lookup copies something at {row['copy_share']:.1%} of the positions")
    print("| where | drafts by | first draft accepted | mean accepted run |")
    print("|---|---|---:|---:|")
    print(f"| lookup copies | lookup | {row['copy_first']:.3f} | {row['copy_run']:.2f} |")
    print(
        f"| lookup copies | drafter | {row['drafter_first_where_copied']:.3f} "
        f"| {row['drafter_run_where_copied']:.2f} |"
    )
    print(
        f"| nothing to copy | drafter | {row['drafter_first_elsewhere']:.3f} "
        f"| {row['drafter_run_elsewhere']:.2f} |"
    )
    return row
