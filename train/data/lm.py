"""Tokenisation utilities: packed LM blocks, prompts with ground-truth continuations, collate.

* :func:`pack_sequences` - documents -> ``[EOS]``-separated token stream -> fixed ``seq_len`` blocks
  (``datasets.map(batched=True)``), torch-formatted ``input_ids`` for LM pretraining.
* :func:`make_prompts` - prompts (token ids, each starting with BOS) plus ``continuation_ids``
  (the ground-truth continuation) for distillation rollouts and evaluation.
* :func:`document_token_ids` - each document's token ids, no special tokens (n-gram estimation).
* :func:`collate_left_pad` - left-pads prompts into ``input_ids``/``attention_mask`` for batched
  generation (and right-pads continuations when present).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from datasets import Dataset, Features, Value
from datasets import Sequence as HFSequence

__all__ = ["collate_left_pad", "document_token_ids", "make_prompts", "pack_sequences"]

_PROMPT_FEATURES = Features(
    {
        "input_ids": HFSequence(Value("int64")),
        "continuation_ids": HFSequence(Value("int64")),
        "doc_index": Value("int64"),
    }
)


def _require_special(tokenizer: Any, name: str) -> int:
    value = getattr(tokenizer, f"{name}_token_id", None)
    if value is None:
        raise ValueError(f"tokenizer has no {name}_token_id")
    return int(value)


def pack_sequences(
    dataset_split: Dataset,
    tokenizer: Any,
    seq_len: int,
    *,
    text_column: str = "text",
    batch_size: int = 1000,
    num_proc: int | None = None,
    add_bos: bool = False,
) -> Dataset:
    """Pack documents into blocks of exactly ``seq_len`` token ids.

    Each document is tokenised without special tokens (optionally prefixed with BOS) and followed
    by EOS; the stream of each ``batch_size`` documents is cut into ``seq_len`` blocks and the
    remainder of the batch is dropped (the usual ``run_clm`` recipe, so the map stays stateless
    and cacheable). Returns a dataset with one column ``input_ids`` in torch format
    (``ds[i]["input_ids"]`` is a LongTensor of shape ``[seq_len]``). Labels are ``input_ids``.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if text_column not in dataset_split.column_names:
        raise ValueError(f"text_column={text_column!r} not in columns {dataset_split.column_names}")
    eos = _require_special(tokenizer, "eos")
    bos = _require_special(tokenizer, "bos") if add_bos else None

    def pack(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        encoded = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        stream: list[int] = []
        for ids in encoded:
            if bos is not None and (not ids or ids[0] != bos):
                stream.append(bos)
            stream.extend(ids)
            stream.append(eos)
        n_blocks = len(stream) // seq_len
        return {"input_ids": [stream[i * seq_len : (i + 1) * seq_len] for i in range(n_blocks)]}

    packed = dataset_split.map(
        pack,
        batched=True,
        batch_size=batch_size,
        remove_columns=dataset_split.column_names,
        num_proc=num_proc,
        desc=f"pack {seq_len}-token blocks",
    )
    packed.set_format(type="torch", columns=["input_ids"])
    return packed


# more than 8 parameters: the prompt cut's settings, all but prompt_len with defaults; its callers (the prompt
# data module, the evaluator's prompts, the answer sources) pass only what they change
def make_prompts(
    dataset_split: Dataset,
    tokenizer: Any,
    prompt_len: int,
    max_prompts: int | None = None,
    seed: int = 0,
    *,
    continuation_len: int | None = 64,
    mode: str = "random",
    prompts_per_doc: int = 1,
    text_column: str = "text",
) -> Dataset:
    """Cut prompts (token-id lists starting with BOS) and their ground-truth continuations.

    * Sources with ``prompt``/``response`` columns: the prompt is the tokenised ``prompt`` (its
      last ``prompt_len - 1`` tokens after BOS if longer) and ``continuation_ids`` is the
      tokenised ``response`` (first ``continuation_len`` tokens; all if ``None``). A row whose
      response is empty is a request (a chat turn rendered up to the assistant's header, as the
      ``chat`` source gives): it is skipped when longer than ``prompt_len``, since cutting its head
      would drop the chat header and the start of the question.
    * Plain text: a window of ``prompt_len - 1`` tokens after BOS followed by ``continuation_len``
      tokens of continuation (``None`` means 0 here), taken at the document start (``mode="start"``)
      or at ``prompts_per_doc`` random offsets per document (``mode="random"``). Documents too
      short for one window are skipped.

    Documents are visited in a seeded random order until ``max_prompts`` prompts are made, so the
    output is deterministic for a given ``seed``. Returns a ``Dataset`` with list columns
    ``input_ids`` (prompt, ``len <= prompt_len``), ``continuation_ids`` and ``doc_index``.
    """
    _check_prompt_settings(prompt_len, max_prompts, continuation_len, mode, prompts_per_doc)
    bos = _require_special(tokenizer, "bos")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(dataset_split)).tolist()
    has_pairs = {"prompt", "response"} <= set(dataset_split.column_names)
    if not has_pairs and text_column not in dataset_split.column_names:
        raise ValueError(f"text_column={text_column!r} not in columns {dataset_split.column_names}")
    body = prompt_len - 1
    limit = max_prompts if max_prompts is not None else len(dataset_split) * prompts_per_doc
    if has_pairs:
        rows = _encoded_rows(dataset_split, order, ("prompt", "response"), tokenizer, bos)
        cuts = _chat_cuts(rows, bos, body, continuation_len)
    else:
        rows = _encoded_rows(dataset_split, order, (text_column,), tokenizer, bos)
        cuts = _text_cuts(rows, bos, body, continuation_len or 0, mode, prompts_per_doc, rng)
    # islice stops pulling at the limit: the rows after it are never tokenised
    kept = list(itertools.islice(cuts, limit))
    return Dataset.from_dict(
        {
            "input_ids": [prompt for _, prompt, _ in kept],
            "continuation_ids": [continuation for _, _, continuation in kept],
            "doc_index": [doc for doc, _, _ in kept],
        },
        features=_PROMPT_FEATURES,
    )


def _check_prompt_settings(
    prompt_len: int, max_prompts: int | None, continuation_len: int | None, mode: str, prompts_per_doc: int
) -> None:
    if prompt_len < 2:
        raise ValueError(f"prompt_len must be >= 2 (BOS + at least one token), got {prompt_len}")
    if mode not in ("start", "random"):
        raise ValueError(f"mode must be one of ['random', 'start'], got {mode!r}")
    if continuation_len is not None and continuation_len < 0:
        raise ValueError(f"continuation_len must be >= 0 or None, got {continuation_len}")
    if prompts_per_doc < 1:
        raise ValueError(f"prompts_per_doc must be >= 1, got {prompts_per_doc}")
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts must be None or >= 1, got {max_prompts}")


_ROWS_PER_TOKENIZER_CALL = 64

#: One prompt cut from a document: (the document's index, BOS + the prompt's ids, the continuation's ids).
_Cut = tuple[int, list[int], list[int]]


def _encoded_rows(
    dataset_split: Dataset, order: list[int], columns: Sequence[str], tokenizer: Any, bos: int
) -> Iterator[tuple[Any, ...]]:
    """(row index, each of ``columns`` as token ids without a leading BOS) for the rows in ``order``,
    tokenised :data:`_ROWS_PER_TOKENIZER_CALL` rows at a time as they are pulled."""
    for start in range(0, len(order), _ROWS_PER_TOKENIZER_CALL):
        idx = order[start : start + _ROWS_PER_TOKENIZER_CALL]
        rows = dataset_split.select(idx)
        encoded = [_encode(tokenizer, bos, list(rows[column])) for column in columns]
        yield from zip(idx, *encoded, strict=True)


def _encode(tokenizer: Any, bos: int, texts: list[str]) -> list[list[int]]:
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [ids[1:] if ids and ids[0] == bos else list(ids) for ids in encoded]


def _chat_cuts(
    rows: Iterator[tuple[Any, ...]], bos: int, body: int, continuation_len: int | None
) -> Iterator[_Cut]:
    """A prompt's last ``body`` tokens after BOS and its response (its first ``continuation_len``
    tokens); a request (no response) longer than ``body`` is skipped rather than cut at its head."""
    for i, p_ids, r_ids in rows:
        if not r_ids and len(p_ids) > body:
            continue
        response = r_ids if continuation_len is None else r_ids[:continuation_len]
        yield int(i), [bos] + p_ids[max(0, len(p_ids) - body) :], response


def _text_cuts(
    rows: Iterator[tuple[Any, ...]],
    bos: int,
    body: int,
    cont: int,
    mode: str,
    prompts_per_doc: int,
    rng: np.random.Generator,
) -> Iterator[_Cut]:
    """Windows of ``body`` tokens after BOS and the ``cont`` tokens after them, at each document's start
    or at ``prompts_per_doc`` random offsets (drawn from ``rng`` as the document is reached); documents
    too short for one window are skipped."""
    for i, ids in rows:
        span = len(ids) - (body + cont)
        if span < 0:
            continue
        if mode == "start":
            offsets = [0]
        else:
            offsets = sorted(int(o) for o in rng.integers(0, span + 1, size=prompts_per_doc))
        for off in offsets:
            yield int(i), [bos] + ids[off : off + body], ids[off + body : off + body + cont]


def _as_list(x: Any) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def document_token_ids(dataset: Dataset, tokenizer: Any, text_field: str = "text") -> list[list[int]]:
    """Every document of ``dataset`` as token ids (no BOS/EOS), batched through ``datasets.map``."""
    encoded = dataset.map(
        lambda batch: {"ids": tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]},
        batched=True,
        remove_columns=dataset.column_names,
        desc="tokenize documents",
    )
    return [list(ids) for ids in encoded["ids"]]


def collate_left_pad(batch: Sequence[Any], pad_id: int) -> dict[str, torch.Tensor]:
    """Left-pad a batch of prompts for batched generation.

    ``batch`` items are token-id sequences (lists/tensors) or mappings with ``input_ids``
    (and optionally ``continuation_ids``). Returns ``input_ids`` and ``attention_mask``
    (LongTensor ``[B, T]``, ``T`` the longest prompt, padding on the left), plus
    ``continuation_ids``/``continuation_mask`` (``[B, C]``, padded on the *right*) when the
    items carry continuations.
    """
    if len(batch) == 0:
        raise ValueError("collate_left_pad got an empty batch")
    items = [b if isinstance(b, Mapping) else {"input_ids": b} for b in batch]
    prompts = [_as_list(item["input_ids"]) for item in items]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
    out = {"input_ids": input_ids, "attention_mask": attention_mask}
    if all("continuation_ids" in item for item in items):
        conts = [_as_list(item["continuation_ids"]) for item in items]
        cwidth = max(len(c) for c in conts)
        cont_ids = torch.full((len(conts), cwidth), int(pad_id), dtype=torch.long)
        cont_mask = torch.zeros((len(conts), cwidth), dtype=torch.long)
        for row, ids in enumerate(conts):
            if ids:
                cont_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                cont_mask[row, : len(ids)] = 1
        out["continuation_ids"] = cont_ids
        out["continuation_mask"] = cont_mask
    return out
