from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from train.data.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    load_or_train_tokenizer,
    train_tokenizer,
)

TRICKY = [
    "def f(x):\n\tif x:\n        return  x  \r\n\n\n",
    "    # indented comment with trailing spaces   \n",
    "s = 'caf\u00e9 \u2603 \U0001f40d \u4e2d\u6587'\n",
    "",
    " leading space",
    "x=1;y=2\\\n",
]


def test_round_trip_real_python(tokenizer, corpus) -> None:
    for text in list(corpus["validation"]["text"])[:10] + TRICKY:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    # No special tokens are added implicitly.
    assert BOS_TOKEN not in tokenizer.decode(tokenizer.encode("x = 1\n"))


def test_special_tokens_and_autotokenizer(tokenizer_dir: Path, tokenizer) -> None:
    auto = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert (auto.bos_token, auto.eos_token, auto.pad_token) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    assert len(auto) == 1024
    assert auto.encode(f"{BOS_TOKEN}x{EOS_TOKEN}")[0] == 0
    assert auto.encode(f"{BOS_TOKEN}x{EOS_TOKEN}")[-1] == 1
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tokenizer_dir / "tokenizer.json").is_file()
    assert auto.get_vocab() == tokenizer.get_vocab()


def test_chat_template(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == f"{BOS_TOKEN}### user\nhi{EOS_TOKEN}\n### assistant\nhello{EOS_TOKEN}\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("### assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id in ids


def test_determinism(corpus) -> None:
    subset = corpus["train"].select(range(30))
    a = train_tokenizer(subset, vocab_size=512)
    b = train_tokenizer(subset, vocab_size=512)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_default_vocab_full_train_split(corpus, tmp_path: Path) -> None:
    a = train_tokenizer(corpus["train"], out_dir=tmp_path / "a")
    assert len(a) == 4096
    text = corpus["test"][0]["text"]
    assert a.decode(a.encode(text)) == text
    # A 4k byte-level BPE compresses Python source well below 1 token per 2 characters.
    assert len(a.encode(text)) < len(text) / 2


def test_accepts_plain_iterables(tmp_path: Path) -> None:
    tok = train_tokenizer(["def f():\n    return 1\n"] * 20, vocab_size=300)
    assert tok.decode(tok.encode("def f():\n")) == "def f():\n"
    tok2 = train_tokenizer([{"body": "x = 1\n"}] * 5, vocab_size=300, text_column="body")
    assert tok2.pad_token_id == 2


def test_rejects_tiny_vocab() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x"], vocab_size=100)


def test_load_or_train_reuses(tmp_path: Path) -> None:
    data = ["import os\nprint(os.getcwd())\n"] * 10
    out = tmp_path / "tok"
    load_or_train_tokenizer(data, out, vocab_size=300, fingerprint="abc")
    stamp = (out / "tokenizer.json").stat().st_mtime_ns
    again = load_or_train_tokenizer(data, out, vocab_size=300, fingerprint="abc")
    assert (out / "tokenizer.json").stat().st_mtime_ns == stamp
    assert again.bos_token_id == 0
    load_or_train_tokenizer(data, out, vocab_size=300, fingerprint="other")
    meta = json.loads((out / "draftsmith_tokenizer.json").read_text())
    assert meta["fingerprint"] == "other"
