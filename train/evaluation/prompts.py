"""Evaluation prompts: fixed-length windows cut from a data config's test split."""

from __future__ import annotations

import logging
from typing import Any

import torch

from train.data.lm import make_prompts
from train.data.sources import DataSourceConfig, load_text_dataset

log = logging.getLogger(__name__)

__all__ = ["build_prompts", "build_prompts_with_references"]


def build_prompts(
    tokenizer: Any,
    data: Any = None,
    num_prompts: int = 8,
    prompt_len: int = 64,
    seed: int = 0,
    split: str = "test",
) -> list[torch.Tensor]:
    """Evaluation prompts, each a (1, T) LongTensor starting with BOS, cut from ``data``'s ``split``.

    ``data`` is a :class:`train.data.sources.DataSourceConfig` (None: the embedded stdlib corpus).
    One window of ``prompt_len`` tokens per document at a seeded random offset
    (:func:`train.data.lm.make_prompts`), so the set is the same for a given seed.
    """
    return build_prompts_with_references(tokenizer, data, num_prompts, prompt_len, seed, split)[0]


def build_prompts_with_references(
    tokenizer: Any,
    data: Any = None,
    num_prompts: int = 8,
    prompt_len: int = 64,
    seed: int = 0,
    split: str = "test",
    continuation_len: int | None = None,
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """:func:`build_prompts` and, with ``continuation_len``, each prompt's next ``continuation_len``
    tokens in its document (a reference for task metrics; each window then leaves room for them, so
    the prompt set differs from the one without). Without it the references are empty lists."""
    data = data if data is not None else DataSourceConfig()
    splits = load_text_dataset(data, tokenizer)
    ds = make_prompts(
        splits[split],
        tokenizer,
        prompt_len,
        max_prompts=num_prompts,
        seed=seed,
        continuation_len=continuation_len,
        mode="random",
    )
    needed = prompt_len + (continuation_len or 0)
    if len(ds) == 0:
        raise ValueError(
            f"no {split} document of data {data.name!r} holds {needed} tokens; lower eval.prompt_len"
            + (" or the continuation length" if continuation_len else "")
        )
    if len(ds) < num_prompts:
        log.warning("only %d of %d prompts could be cut from the %s split", len(ds), num_prompts, split)
    prompts = [torch.tensor([ids], dtype=torch.long) for ids in ds["input_ids"]]
    references = [list(c) for c in ds["continuation_ids"]] if continuation_len else [[] for _ in prompts]
    return prompts, references
