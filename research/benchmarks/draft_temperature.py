"""How often an EAGLE-3 drafter's first sampled token would be accepted, for each draft temperature.

    python scripts/bench.py draft-temperature                       # the newest experiment=eagle3 drafter
    python scripts/bench.py draft-temperature --drafter DIR --temperature 0.7

At sampling temperature T a sampled chain (``Eagle3Decoder(..., sampled_chain=True)``) draws its first
token from q = softmax(drafter logits / (T * s)), s the decoder's ``draft_temperature``, and the standard
rule accepts it with probability sum_x min(p(x), q(x)), p = softmax(verifier logits / T): one minus the
total variation between the two. This measures that sum, teacher-forced, at every answer position of the
pair's validation prompts, for each s, on two kinds of context:

- ``greedy``: the verifier's cached greedy answers (what decoding at T = 0 follows);
- ``sampled``: answers sampled from the verifier at T here (what decoding at T follows; generated).

A drafter trained on a few thousand answers is less confident than the verifier: its best s is below 1.
Pick the s of the ``sampled`` column for ``draft_temperature``; no top-k / top-p warping is applied here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from research.pairs import load_pair, newest_eagle3, pair_setup
from train.decoding.sampling import expected_acceptance_per_position
from train.models.answers import Answer, load_answers
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.eagle3_ttt import ttt_unroll
from train.tables import markdown_table
from train.training.answer_data import answer_eos_ids
from train.training.answer_sources import sampled_answers

SCALES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pair", default="checkpoints/smollm2", help="the real pair's folder (verifier/, answers/)"
    )
    parser.add_argument(
        "--drafter",
        default=None,
        help="an EAGLE-3 drafter folder (default: the newest experiment=eagle3 run's)",
    )
    parser.add_argument("--prompts", type=int, default=32, help="validation prompts")
    parser.add_argument("--temperature", type=float, default=1.0, help="the sampling temperature T")
    parser.add_argument("--scales", type=float, nargs="+", default=list(SCALES), help="draft temperatures s")
    parser.add_argument("--answer-tokens", type=int, default=128, help="tokens per sampled answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def newest_drafter() -> str:
    found = newest_eagle3()
    if found is None:
        raise SystemExit("no finished experiment=eagle3 run under checkpoints/eagle3/: pass --drafter")
    return found


def first_step_logits(
    verifier: Any, drafter: Eagle3Drafter, answer: Answer
) -> tuple[torch.Tensor, torch.Tensor]:
    """(verifier logits, drafter logits over the draft vocabulary) at the positions that predict the
    answer's tokens after its first (the drafter's step 0 reads the feature of p and the token p + 1 and
    predicts the token p + 2, whose law is the verifier's output at p + 1): (n, V) and (n, N)."""
    seq = torch.tensor([answer.prompt + answer.answer])
    out = verifier(seq, output_hidden_states=True)
    features = drafter.fuse(drafter.aux_features(out.hidden_states))
    drafted = ttt_unroll(drafter, features, seq, steps=1)[0][0]  # (T, N): row p predicts token p + 2
    first = len(answer.prompt) - 1  # the verifier's output at `first` predicts the answer's first token
    rows = torch.arange(first + 1, seq.shape[1] - 1)  # verifier rows predicting the answer's tokens 2..
    return out.logits[0, rows].float(), drafted[rows - 1].float()


def acceptance(
    verifier_logits: torch.Tensor, drafter_logits: torch.Tensor, draft_ids: torch.Tensor, t: float, s: float
) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per row: p = softmax(verifier / t), q = softmax(drafter / (t * s)) placed at
    the draft vocabulary's target ids (zero elsewhere)."""
    p = torch.softmax(verifier_logits / t, -1)
    q = torch.zeros_like(p)
    q[:, draft_ids] = torch.softmax(drafter_logits / (t * s), -1)
    return expected_acceptance_per_position(p, q)


@torch.inference_mode()
def measure(
    verifier: Any, drafter: Eagle3Drafter, contexts: dict[str, list[Answer]], t: float, scales: list[float]
) -> list[dict[str, Any]]:
    """Per scale, the mean first-token acceptance over every position of each kind of context."""
    sums = {kind: dict.fromkeys(scales, 0.0) for kind in contexts}
    counts = dict.fromkeys(contexts, 0)
    draft_ids = drafter.draft_ids
    for kind, answers in contexts.items():
        for answer in answers:
            if len(answer.answer) < 2:
                continue
            v, d = first_step_logits(verifier, drafter, answer)
            counts[kind] += v.shape[0]
            for s in scales:
                sums[kind][s] += float(acceptance(v, d, draft_ids, t, s).sum())
    return [
        {"draft_temperature": s, **{kind: sums[kind][s] / max(counts[kind], 1) for kind in contexts}}
        for s in scales
    ]


def best_scale(rows: list[dict[str, Any]], kind: str) -> float:
    return float(max(rows, key=lambda row: float(row[kind]))["draft_temperature"])


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    folder = Path(args.pair)
    pair = load_pair(pair_setup(args.pair), with_drafter=False)
    verifier, tokenizer, dtype = pair.verifier, pair.tokenizer, pair.dtype
    path = args.drafter or newest_drafter()
    drafter = Eagle3Drafter.from_pretrained(path).to(dtype).eval()
    greedy = load_answers(str(folder / "answers" / "validation.pt"))[: args.prompts]
    sampled = sampled_answers(
        verifier,
        answer_eos_ids(verifier, tokenizer),
        [a.prompt for a in greedy],
        1,
        args.temperature,
        args.answer_tokens,
        16,
        args.seed,
    )
    rows = measure(verifier, drafter, {"greedy": greedy, "sampled": sampled}, args.temperature, args.scales)
    best = {kind: best_scale(rows, kind) for kind in ("greedy", "sampled")}
    print(f"drafter {path}; T = {args.temperature:g}; {len(greedy)} validation prompts")
    print(
        markdown_table(
            ["draft_temperature", "greedy contexts", "sampled contexts"],
            [
                [
                    f"{r['draft_temperature']:g}",
                    f"{r['greedy']:.4f}" + (" (best)" if r["draft_temperature"] == best["greedy"] else ""),
                    f"{r['sampled']:.4f}" + (" (best)" if r["draft_temperature"] == best["sampled"] else ""),
                ]
                for r in rows
            ],
        )
    )
    print(
        "mean probability that the first sampled draft token is accepted (teacher-forced, answer positions)"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"drafter": path, "temperature": args.temperature, "rows": rows})
        )
    return rows
