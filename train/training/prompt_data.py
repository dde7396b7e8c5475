"""The prompts a method trains on (DistillSpec, SD^2): its data settings checked, its data module built."""

from __future__ import annotations

from typing import Any

from train.config import require
from train.data.datamodule import PromptDataModule
from train.data.sources import load_text_dataset


def check_prompt_settings(cfg: Any) -> None:
    """Validate the prompt and response sizes a method config shares (``max_new_tokens``, ``prompt_len``,
    ``batch_size``, ``num_prompts``, ``num_val_prompts``); errors name ``method.<key>``."""
    require(cfg.max_new_tokens >= 1, "method.max_new_tokens", ">= 1", cfg.max_new_tokens)
    require(cfg.prompt_len >= 2, "method.prompt_len", ">= 2", cfg.prompt_len)
    require(cfg.batch_size >= 1, "method.batch_size", ">= 1", cfg.batch_size)
    require(
        cfg.num_prompts >= cfg.batch_size,
        "method.num_prompts",
        f">= method.batch_size ({cfg.batch_size})",
        cfg.num_prompts,
    )
    require(cfg.num_val_prompts >= 1, "method.num_val_prompts", ">= 1", cfg.num_val_prompts)


def prompt_data(cfg: Any, tokenizer: Any, data: Any, seed: int) -> PromptDataModule:
    """Training and held-out prompts of ``data`` (a data config) sized by ``cfg`` (see
    :func:`check_prompt_settings`), with the corpus continuations for sources that need them."""
    return PromptDataModule(
        lambda: load_text_dataset(data, tokenizer),
        tokenizer,
        prompt_len=cfg.prompt_len,
        batch_size=cfg.batch_size,
        continuation_len=cfg.max_new_tokens,
        max_prompts=cfg.num_prompts,
        max_val_prompts=cfg.num_val_prompts,
        seed=seed,
    )
