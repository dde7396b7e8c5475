"""Shared fixtures: tiny random-weight models saved locally (nothing downloads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"

MICRO_PAIR = [
    "model.tiny.vocab_size=300",
    "model.tiny.seq_len=64",
    "model.tiny.val_blocks=2",
    *(
        f"model.tiny.{role}.{kv}"
        for role, h in (("verifier", 16), ("drafter", 8))
        for kv in f"hidden_size={h},num_layers=2,num_heads=2,intermediate_size=32,max_steps=2".split(",")
    ),
]
"""Overrides that make the embedded tiny pair a micro one (built in seconds) for end-to-end runs."""

LONGEST_SLOW_TESTS = (
    "test_documented_commands_run_on_micro_recipes",  # ~12 min
    "test_real_pair_main_job_runs_end_to_end_on_a_micro_recipe",  # ~5 min, vLLM included
)
"""The slow suite's longest tests, longest first (measured on 2 CPU cores, `--durations`)."""


@pytest.hookimpl(trylast=True)  # after `-m` deselected what this run leaves out
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest slow tests first, one at the head of each half of the run. pytest-xdist's
    ``--dist worksteal`` (CI's slow suite) gives each of the two workers one contiguous half of the tests
    and lets a worker that runs dry take from the end of the other's queue: a long test at the end of a
    half would run alone while the other core idles."""
    names = {item.name: item for item in items}
    long = [names[name] for name in LONGEST_SLOW_TESTS if name in names]
    if not long:
        return
    rest = [item for item in items if item not in long]
    half = max(len(items) // 2 - 1, 0)
    items[:] = [*long[:1], *rest[:half], *long[1:], *rest[half:]]


os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def make_tokenizer(extra: str = "") -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with 256 byte tokens plus BOS/EOS/PAD (259 ids); ``extra`` adds one token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(sorted(alphabet))}
    for special in ("<|bos|>", "<|eos|>", "<|pad|>"):
        vocab[special] = len(vocab)
    if extra:
        vocab[extra] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


def tiny_llama(vocab_size: int = 260, hidden: int = 32, layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``verifier/`` and ``drafter/`` random Llama folders with a shared tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    tok = make_tokenizer()
    for name, hidden, seed in (("verifier", 64, 0), ("drafter", 32, 1)):
        model = tiny_llama(hidden=hidden, seed=seed)
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: tiny models are latency-bound, and OpenMP spin-waiting on a
    shared 2-core machine slows them down many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small local JSONL corpus of Python-like text (60 documents) for run tests."""
    path = tmp_path_factory.mktemp("text") / "docs.jsonl"
    rows = [{"text": f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" * 6} for i in range(60)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path
