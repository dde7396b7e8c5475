"""Evaluation prompts: fixed-length windows cut from a data config's test split."""

from __future__ import annotations

import logging
from typing import Any

import torch

from train.data.lm import make_prompts
from train.data.sources import DataSourceConfig, load_text_dataset

log = logging.getLogger(__name__)

__all__ = ["build_prompts"]


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
    data = data if data is not None else DataSourceConfig()
    splits = load_text_dataset(data, tokenizer)
    ds = make_prompts(
        splits[split],
        tokenizer,
        prompt_len,
        max_prompts=num_prompts,
        seed=seed,
        continuation_len=None,
        mode="random",
    )
    if len(ds) == 0:
        raise ValueError(
            f"no {split} document of data {data.name!r} holds {prompt_len} tokens; lower eval.prompt_len"
        )
    if len(ds) < num_prompts:
        log.warning("only %d of %d prompts could be cut from the %s split", len(ds), num_prompts, split)
    return [torch.tensor([ids], dtype=torch.long) for ids in ds["input_ids"]]
