"""scripts/bpd.py on a micro run: heads with a draft vocabulary in the analysis, the n-gram models' text
(the run's training answers plus the corpus), and one end-to-end pass through analysis, tuning and the
final table with the run's verifier, data and prompt length."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from research.pairs import heads_setup
from tests.conftest import make_tokenizer
from tests.test_docs_commands import load_script
from train.models.answers import Answer, save_answers
from train.models.heads import MedusaHeads

DRAFT_VOCAB = sorted({*range(0, 256, 3), 256, 257})


@pytest.fixture(scope="module")
def bpd() -> object:
    return load_script("scripts/bpd.py")


@pytest.fixture(scope="module")
def verifier(tiny_pair_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "verifier").eval()


def _heads(verifier: torch.nn.Module, draft_vocab: list[int] | None) -> MedusaHeads:
    torch.manual_seed(0)
    heads = MedusaHeads.from_verifier(verifier, num_heads=3, num_layers=1, draft_vocab=draft_vocab)
    with torch.no_grad():  # trained-looking heads: each its own projection
        for head in heads.lm_heads:
            head.weight.add_(torch.randn_like(head.weight))
    return heads.with_tree([[0], [0, 0], [0, 0, 0]]).eval()


def _answer(prompt: list[int], answer: list[int]) -> Answer:
    return Answer(prompt, answer, torch.zeros(len(answer), 1, dtype=torch.long), torch.zeros(len(answer), 1))


@pytest.fixture(scope="module")
def run(tiny_pair_dir: Path, text_file: Path, verifier: torch.nn.Module, tmp_path_factory) -> Path:
    """A Medusa run directory: heads over a draft vocabulary, cached answers, the run's config.yaml."""
    root = tmp_path_factory.mktemp("medusa_run")
    _heads(verifier, DRAFT_VOCAB).save_pretrained(root / "heads")
    ids = make_tokenizer()("def f(x):\n    return x * 2\n", add_special_tokens=False)["input_ids"]
    (root / "answers").mkdir()
    for split, count in (("train", 4), ("validation", 3)):
        save_answers(
            [_answer([256, *ids[:12]], ids[i : i + 10]) for i in range(count)],
            str(root / "answers" / f"{split}.pt"),
        )
    data = {"_target_": "train.data.sources.DataSourceConfig", "name": "jsonl", "data_files": str(text_file)}
    config = {
        "model": {
            "verifier": str(tiny_pair_dir / "verifier"),
            "drafter": str(tiny_pair_dir / "drafter"),
            "dtype": "float32",
        },
        "data": {**data, "validation_fraction": 0.2, "test_fraction": 0.2},
        "eval": {"prompt_len": 16, "tie_ulps": 4.0},
        "method": {"answers": str(root / "answers")},
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def test_the_analysis_of_draft_vocabulary_heads_equals_their_full_vocabulary_logits(bpd, verifier) -> None:
    """heads(hidden) is -inf outside the draft vocabulary: the analysis over the heads' own outputs gives
    the same top-1 / top-5 / entropy as the full-vocabulary logits, and finite entropies."""
    heads = _heads(verifier, DRAFT_VOCAB)
    ids, first = list(range(40, 100)), 5
    stats = bpd.head_statistics(verifier, heads, ids, first)
    with torch.no_grad():
        out = verifier(input_ids=torch.tensor([ids]), output_hidden_states=True)
        full = heads(out.hidden_states[-1][0, first:]).float().log_softmax(-1)  # (K, T - first, V)
    usable = len(ids) - heads.num_heads - 1 - first
    full = full[:, :usable]
    assert stats["agree"].shape == (heads.num_heads, usable)
    entropy = -torch.where(full.isinf(), 0.0, full.exp() * full).sum(-1)
    torch.testing.assert_close(stats["entropy"], entropy)
    assert bool(stats["entropy"].isfinite().all()) and float(stats["entropy"].max()) <= math.log(
        len(DRAFT_VOCAB)
    )
    next_ids = out.logits[0].argmax(-1)
    targets = torch.stack([next_ids[first + k + 1 : first + k + 1 + usable] for k in range(heads.num_heads)])
    assert torch.equal(stats["agree"], full.argmax(-1) == targets)
    assert torch.equal(stats["top5"], (full.topk(5, -1).indices == targets[..., None]).any(-1))
    table = bpd.analyse(verifier, heads, [(ids, first), (ids[:30], 0)])
    assert "nan" not in table and table.count("| t+") == heads.num_heads


def test_the_ngram_text_is_the_training_answers_plus_the_other_training_documents(bpd, run) -> None:
    setup = heads_setup(str(run / "heads"))
    tokenizer = make_tokenizer()
    answers = {"train": [_answer([256, 1, 2], [3, 4]), _answer([256, 5], [6])]}
    documents = bpd.ngram_documents(setup, tokenizer, answers)
    assert documents[:2] == [[256, 1, 2, 3, 4], [256, 5, 6]]
    corpus = bpd.ngram_documents(setup, tokenizer, None)
    assert documents[2:] == corpus and len(corpus) > 10
    # a training document that is an answer's prompt is counted once, with its answer
    answers["train"].append(_answer(corpus[0], [7]))
    assert bpd.ngram_documents(setup, tokenizer, answers)[2:] == [[*corpus[0], 7], *corpus[1:]]


def test_bpd_runs_on_the_runs_setup(bpd, run, capsys, one_thread) -> None:
    micro = ["--prompts", "1", "--tokens", "6", "--analysis", "2", "--device", "cpu"]
    bpd.main([f"--heads={run / 'heads'}", *micro])
    out = capsys.readouterr().out
    assert "(float32, 1 threads)" in out
    assert "## Analysis (the cached validation answers, teacher-forced: 2 answers)" in out
    assert "nan" not in out.split("## Tuning")[0]
    table = out.split("## Final")[1].split("Mean ± std")[0]  # the evaluator's results table
    rows = [line for line in table.splitlines() if line.startswith("| heads |")]
    assert len(rows) == 10  # 5 decoders x T = 0 and 1
    assert all(r.endswith("| yes |") for r in rows if "| - | 0 |" in r)  # identical to greedy decoding
