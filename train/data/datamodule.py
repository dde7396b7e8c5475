"""Lightning data modules for packed LM sequences and for prompts. Independent of any model.

Both take the splits either prepared (a ``DatasetDict`` / mapping of split -> ``Dataset``) or as
a zero-argument callable returning them (called once, in ``setup``), and a tokenizer object or
a path to a saved one.

Loaders are ``torchdata``'s :class:`StatefulDataLoader`: Lightning saves its state (the shuffling
generator, the batches already yielded this epoch) in every checkpoint, so a run resumed mid-epoch
sees exactly the batches the uninterrupted run would have seen; the training order is a pure function
of (seed, epoch) (:class:`~train.data.samplers.EpochShuffleSampler`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import lightning as L
from datasets import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from train.data.lm import collate_left_pad, make_prompts, pack_sequences
from train.data.samplers import EpochShuffleSampler
from train.data.sources import load_text_dataset
from train.data.tokenizer import load_tokenizer_file

__all__ = ["LMDataModule", "PromptDataModule", "packed_corpus"]

Splits = Mapping[str, Dataset]
SplitsArg = Splits | Callable[[], Splits]


def _resolve_tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, str | os.PathLike):
        return load_tokenizer_file(tokenizer)
    return tokenizer


def _resolve_splits(splits: SplitsArg) -> Splits:
    resolved = splits() if callable(splits) else splits
    if "train" not in resolved:
        raise ValueError(f"splits need a 'train' split, got {sorted(resolved)}")
    return resolved


def _shuffler(ds: Dataset, seed: int) -> EpochShuffleSampler:
    return EpochShuffleSampler(len(ds), seed)


def _val_split(splits: Splits) -> Dataset | None:
    for name in ("validation", "valid", "val"):
        if name in splits:
            return splits[name]
    return None


class _SplitDataModule(L.LightningDataModule):
    """What both data modules share: their splits and tokenizer, the loader settings, and one stateful,
    seeded-shuffle loader per split (resumable mid-epoch). A subclass builds the datasets in ``setup``."""

    def __init__(
        self,
        splits: SplitsArg,
        tokenizer: Any,
        batch_size: int,
        num_workers: int,
        *,
        seed: int,
        shuffle: bool,
        text_column: str,
        pin_memory: bool,
    ) -> None:
        super().__init__()
        self._splits_arg = splits
        self.tokenizer = _resolve_tokenizer(tokenizer)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.shuffle = shuffle
        self.text_column = text_column
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets (once)."""
        raise NotImplementedError

    def _loader_options(self, train: bool) -> dict[str, Any]:
        """Extra ``StatefulDataLoader`` arguments (a collate function, drop_last)."""
        return {}

    def _loader(self, ds: Dataset | None, train: bool) -> StatefulDataLoader:
        if ds is None:
            raise RuntimeError("this split is not available")
        return StatefulDataLoader(
            ds,  # type: ignore[arg-type]
            batch_size=self.batch_size,
            sampler=_shuffler(ds, self.seed) if train and self.shuffle else None,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
            **self._loader_options(train),
        )

    def train_dataloader(self) -> StatefulDataLoader:
        self.setup()
        return self._loader(self.train_dataset, train=True)

    def val_dataloader(self) -> StatefulDataLoader:
        self.setup()
        return self._loader(self.val_dataset, train=False)


class LMDataModule(_SplitDataModule):
    """Packed ``seq_len`` blocks: batches are ``{"input_ids": LongTensor [B, seq_len]}``."""

    # more than 8 parameters: the loaders' settings (block and batch size, workers, order, seed, last batch,
    # column, pinning), each optional and passed by name (packed_corpus, the tests)
    def __init__(
        self,
        splits: SplitsArg,
        tokenizer: Any,
        seq_len: int = 256,
        batch_size: int = 16,
        num_workers: int = 0,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        text_column: str = "text",
        pin_memory: bool = False,
    ) -> None:
        super().__init__(
            splits, tokenizer, batch_size, num_workers,
            seed=seed, shuffle=shuffle, text_column=text_column, pin_memory=pin_memory,
        )  # fmt: skip
        self.seq_len = seq_len
        self.drop_last = drop_last
        self.test_dataset: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        splits = _resolve_splits(self._splits_arg)
        pack = partial(
            pack_sequences, tokenizer=self.tokenizer, seq_len=self.seq_len, text_column=self.text_column
        )
        self.train_dataset = pack(splits["train"])
        val = _val_split(splits)
        self.val_dataset = pack(val) if val is not None else None
        self.test_dataset = pack(splits["test"]) if "test" in splits else None

    def _loader_options(self, train: bool) -> dict[str, Any]:
        return {"drop_last": train and self.drop_last}

    def test_dataloader(self) -> StatefulDataLoader:
        self.setup()
        return self._loader(self.test_dataset, train=False)


def packed_corpus(source: Any, tokenizer: Any, seq_len: int, batch_size: int, seed: int) -> LMDataModule:
    """Packed ``seq_len`` blocks of a data config's text (loaded in ``setup``), full batches only: what
    the methods that train on plain text (pretraining, prediction heads) read; its loaders use the data
    config's ``num_workers`` and ``pin_memory``."""
    return LMDataModule(
        lambda: load_text_dataset(source, tokenizer),
        tokenizer,
        seq_len=seq_len,
        batch_size=batch_size,
        num_workers=source.num_workers,
        seed=seed,
        drop_last=True,
        pin_memory=source.pin_memory,
    )


class PromptDataModule(_SplitDataModule):
    """Prompts for rollouts/evaluation: batches from :func:`train.data.lm.collate_left_pad`
    (``input_ids``/``attention_mask`` left-padded ``[B, T]``, ``continuation_ids``/``continuation_mask``
    right-padded ``[B, C]``)."""

    # more than 8 parameters: make_prompts' cut and the loaders' settings, each optional and passed by name
    # (prompt_data, the tests)
    def __init__(
        self,
        splits: SplitsArg,
        tokenizer: Any,
        prompt_len: int = 64,
        batch_size: int = 8,
        num_workers: int = 0,
        *,
        continuation_len: int | None = 64,
        max_prompts: int | None = None,
        max_val_prompts: int | None = None,
        mode: str = "random",
        prompts_per_doc: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        text_column: str = "text",
        pin_memory: bool = False,
    ) -> None:
        super().__init__(
            splits, tokenizer, batch_size, num_workers,
            seed=seed, shuffle=shuffle, text_column=text_column, pin_memory=pin_memory,
        )  # fmt: skip
        self.prompt_len = prompt_len
        self.continuation_len = continuation_len
        self.max_prompts = max_prompts
        self.max_val_prompts = max_val_prompts
        self.mode = mode
        self.prompts_per_doc = prompts_per_doc

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def _prompts(self, ds: Dataset, max_prompts: int | None) -> Dataset:
        return make_prompts(
            ds,
            self.tokenizer,
            self.prompt_len,
            max_prompts,
            self.seed,
            continuation_len=self.continuation_len,
            mode=self.mode,
            prompts_per_doc=self.prompts_per_doc,
            text_column=self.text_column,
        )

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        splits = _resolve_splits(self._splits_arg)
        self.train_dataset = self._prompts(splits["train"], self.max_prompts)
        val = _val_split(splits)
        self.val_dataset = self._prompts(val, self.max_val_prompts) if val is not None else None

    def _loader_options(self, train: bool) -> dict[str, Any]:
        return {"collate_fn": partial(collate_left_pad, pad_id=self.pad_id)}
