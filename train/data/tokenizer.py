"""Byte-level BPE tokenizer for the embedded corpus.

Trained with the ``tokenizers`` library, wrapped as ``transformers.PreTrainedTokenizerFast`` and
saved so that ``AutoTokenizer.from_pretrained(out_dir)`` loads it. Design choices:

* byte-level (GPT-2 style) pre-tokenisation and decoding, no normaliser: any text round-trips
  exactly, ``decode(encode(text)) == text`` (indentation and newlines included);
* special tokens ``<|bos|>`` (id 0), ``<|eos|>`` (id 1), ``<|pad|>`` (id 2);
* no special tokens are added automatically on ``encode``: callers add BOS/EOS where they mean it
  (``train.data.lm`` does), which keeps the round trip exact;
* ``padding_side="left"`` (batched generation is the common padded use; packed LM blocks need
  no padding);
* a small chat template (``<|bos|>`` then, per message, ``### role\\n`` + content + ``<|eos|>\\n``)
  so chat-format data can be rendered; generation prompts end with ``### assistant\\n``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

__all__ = [
    "BOS_TOKEN",
    "CHAT_TEMPLATE",
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "load_or_train_tokenizer",
    "load_tokenizer_file",
    "train_tokenizer",
]

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
DEFAULT_VOCAB_SIZE = 4096
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + '\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\n' }}{% endif %}"
)

_META_FILE = "draftsmith_tokenizer.json"


def _iter_texts(dataset: Any, text_column: str, batch_size: int) -> Iterator[list[str]]:
    if isinstance(dataset, str):
        yield [dataset]
        return
    if hasattr(dataset, "column_names") and hasattr(dataset, "iter"):
        for batch in dataset.select_columns([text_column]).iter(batch_size=batch_size):
            yield list(batch[text_column])
        return
    pending: list[str] = []
    for item in dataset:
        pending.append(item[text_column] if isinstance(item, dict) else item)
        if len(pending) >= batch_size:
            yield pending
            pending = []
    if pending:
        yield pending


def train_tokenizer(
    dataset: Any,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    text_column: str = "text",
    min_frequency: int = 2,
    model_max_length: int = 1 << 20,
    fingerprint: str | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and (if ``out_dir``) save it for ``AutoTokenizer``.

    ``dataset`` is a ``datasets.Dataset`` (its ``text_column`` is used; pass the *train* split),
    or any iterable of strings / dicts. Training is deterministic for a given input order.
    ``fingerprint`` (e.g. the corpus manifest fingerprint) is recorded next to the tokenizer so
    :func:`load_or_train_tokenizer` can tell whether a saved tokenizer is still current.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_iter_texts(dataset, text_column, 256), trainer=trainer)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        hf_tok.save_pretrained(str(out))
        # transformers 5 writes its internal class name; the public alias loads on 4.x and 5.x.
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        meta = {"vocab_size": vocab_size, "min_frequency": min_frequency, "fingerprint": fingerprint}
        (out / _META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return hf_tok


def load_tokenizer_file(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer (plain ``AutoTokenizer.from_pretrained`` on a local folder)."""
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise TypeError(f"{path} does not hold a fast (tokenizers-backed) tokenizer: {type(tok).__name__}")
    return tok


def load_or_train_tokenizer(
    dataset: Any,
    out_dir: str | os.PathLike[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    fingerprint: str | None = None,
    force: bool = False,
    text_column: str = "text",
) -> PreTrainedTokenizerFast:
    """Reuse the tokenizer in ``out_dir`` if it was trained with the same vocab size and data
    ``fingerprint``; otherwise train and save a new one."""
    meta_path = Path(out_dir) / _META_FILE
    if not force and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except ValueError:
            meta = {}
        if meta.get("vocab_size") == vocab_size and meta.get("fingerprint") == fingerprint:
            return load_tokenizer_file(out_dir)
    return train_tokenizer(dataset, vocab_size, out_dir, text_column=text_column, fingerprint=fingerprint)
