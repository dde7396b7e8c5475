"""The verifier's own answers as training data: the rows a loss reads and how they are batched.

A method that trains on the verifier's outputs (EAGLE-3, Medusa) reads prompt + answer sequences: a
cached folder (one ``.pt`` file per split, validation and train, of
:func:`train.models.answers.save_answers`, :func:`cached_answers`), or answers generated for the run
(:mod:`train.training.answer_sources`).

A batch (:func:`collate_answers`) holds right-padded ``input_ids`` / ``attention_mask`` and
``loss_mask``: True on the rows whose next token is an answer token (row ``len(prompt) - 1`` predicts the
answer's first token), so a loss on the verifier's row j counts only what the drafter will be asked to
guess; and ``index``, each row's place in its split (what a per-row cache is keyed by).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from train.config import ConfigError
from train.data.samplers import PinnedShardSampler
from train.models.answers import Answer, load_answers
from train.models.loading import eos_token_ids

log = logging.getLogger(__name__)

__all__ = [
    "AnswerDataModule",
    "answer_row",
    "cached_answers",
    "collate_answers",
    "answer_batches",
    "answer_eos_ids",
]

SPLITS = ("train", "validation")


def answer_row(answer: Answer, max_len: int, prompt_loss: bool = False) -> dict[str, torch.Tensor] | None:
    """``input_ids`` (prompt + answer; a sequence longer than ``max_len`` loses prompt tokens from the
    left) and ``loss_mask`` (True on the rows that predict an answer token; with ``prompt_loss``, on every
    row that predicts a token of the sequence, prompt included). None for an empty answer or one that
    alone does not fit ``max_len``."""
    if not answer.answer or len(answer.answer) >= max_len:
        return None
    ids = list(answer.prompt) + list(answer.answer)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    first = 0 if prompt_loss else max(len(answer.prompt) - 1, 0)
    mask[first : len(ids) - 1] = True
    cut = max(0, len(ids) - max_len)
    return {"input_ids": torch.tensor(ids[cut:], dtype=torch.long), "loss_mask": mask[cut:]}


def collate_answers(rows: Sequence[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` (``pad_id``), ``attention_mask`` (long) and ``loss_mask`` (bool), (B, T);
    ``index`` (B,) long when the rows carry one."""
    width = max(len(r["input_ids"]) for r in rows)
    batch = {
        "input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
        "loss_mask": torch.zeros((len(rows), width), dtype=torch.bool),
    }
    if all("index" in r for r in rows):
        batch["index"] = torch.stack([torch.as_tensor(r["index"], dtype=torch.long) for r in rows])
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n] = row["input_ids"]
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, :n] = row["loss_mask"]
    return batch


def cached_answers(folder: str | os.PathLike[str], key: str = "method.answers") -> dict[str, list[Answer]]:
    """``{"train": [...], "validation": [...]}`` from ``folder``; a ConfigError naming ``key`` when a
    split's file is missing."""
    root = Path(folder)
    missing = [s for s in SPLITS if not (root / f"{s}.pt").is_file()]
    if missing:
        raise ConfigError(
            f"{key}: {root} has no {', '.join(f'{s}.pt' for s in missing)} (a folder of the verifier's "
            "answers, e.g. checkpoints/smollm2/answers, written by the pair build); or set it to null to "
            "generate answers from the run's data"
        )
    return {s: load_answers(str(root / f"{s}.pt")) for s in SPLITS}


def answer_eos_ids(verifier: Any, tokenizer: Any) -> list[int]:
    """The ids that end an answer (:func:`train.models.loading.eos_token_ids`: the tokenizer's eos,
    then the verifier's generation config's); ValueError when neither names one."""
    ids = eos_token_ids(tokenizer, verifier)
    if not ids:
        raise ValueError("neither the verifier's generation config nor the tokenizer names an eos token")
    return ids


def answer_batches(
    answers: dict[str, list[Answer]],
    verifier: Any,
    tokenizer: Any,
    batch_size: int,
    max_len: int,
    seed: int,
    prompt_loss: bool = False,
    group_by_length: bool = False,
) -> AnswerDataModule:
    """:class:`AnswerDataModule` padded with the tokenizer's pad id (else the first eos id)."""
    pad = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else answer_eos_ids(verifier, tokenizer)[0]
    )
    return AnswerDataModule(answers, int(pad), batch_size, max_len, seed, prompt_loss, group_by_length)


class AnswerDataModule(L.LightningDataModule):
    """Batches of :func:`collate_answers` over the train / validation answers. Training rows are pinned
    to ranks and shuffled per ``(seed, epoch)`` (:class:`~train.data.samplers.PinnedShardSampler`: a
    rank sees the same rows every epoch, so EAGLE-3's per-rank feature cache serves every epoch after the
    first), the last incomplete batch dropped, through a ``StatefulDataLoader`` (a mid-epoch resume
    continues the epoch's order); Lightning shards the validation rows under DDP / FSDP.
    ``prompt_loss``: training rows count the prompt's rows too (validation always the answers' only).
    ``group_by_length``: training batches of rows of similar length (transformers'
    ``get_length_grouped_indices``: shuffled, then sorted by length within mega-batches of up to 50
    batches), so little of a batch is padding (on the real pair's answers, padded tokens / real ones
    1.28 -> 1.02)."""

    def __init__(
        self,
        answers: dict[str, list[Answer]],
        pad_id: int,
        batch_size: int,
        max_len: int,
        seed: int = 0,
        prompt_loss: bool = False,
        group_by_length: bool = False,
    ) -> None:
        super().__init__()
        self.pad_id, self.batch_size, self.seed = pad_id, batch_size, seed
        self.group_by_length = group_by_length
        self.rows = {
            split: [
                r
                for a in answers.get(split, [])
                if (r := answer_row(a, max_len, prompt_loss and split == "train")) is not None
            ]
            for split in SPLITS
        }
        for rows in self.rows.values():
            for i, row in enumerate(rows):
                row["index"] = torch.tensor(i)
        if len(self.rows["train"]) < batch_size:
            raise ConfigError(
                f"method.batch_size: {batch_size} is more than the {len(self.rows['train'])} usable "
                f"training answers (non-empty, shorter than method.max_len = {max_len})"
            )

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        if not shuffle:
            return DataLoader(
                self.rows[split],  # type: ignore[arg-type]
                batch_size=self.batch_size,
                collate_fn=self._collate,
            )
        lengths = [len(r["input_ids"]) for r in self.rows[split]] if self.group_by_length else None
        sampler = PinnedShardSampler(len(self.rows[split]), self.seed, lengths, self.batch_size)
        return StatefulDataLoader(
            self.rows[split],  # type: ignore[arg-type]
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=self._collate,
        )

    def _collate(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate_answers(rows, self.pad_id)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", shuffle=False)
