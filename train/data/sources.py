"""A generic text-data loader: the embedded corpus, local files, or Hugging Face datasets.

``load_text_dataset(DataSourceConfig(...))`` always returns a ``DatasetDict`` with the splits
``train``, ``validation`` and ``test`` and normalised columns:

* ``text`` always (what LM packing and prompt cutting read);
* ``prompt`` and ``response`` as well when the source has them (``prompt_field``/``response_field``,
  or chat ``messages_field``); then ``text`` is ``prompt + response``. A conversation rendered with
  the tokenizer's chat template splits before its last message when that is the assistant's; one
  that ends with another role (a request) is rendered with the generation prompt
  (``add_generation_prompt=True``) as the whole ``prompt``, and its ``response`` is empty.

Source kinds (``name``):

* ``"stdlib"``: the embedded corpus (:mod:`train.data.corpus`), built/cached under ``corpus_dir``;
* ``"chat"``: the embedded chat prompt set (:mod:`train.data.chat`), one user turn per record, split by
  source; its ``prompt`` is the turn rendered with the tokenizer's chat template, ending where the
  assistant's answer starts, and its ``response`` is empty;
* ``"json"``, ``"jsonl"``, ``"parquet"``, ``"csv"``, ``"text"``: local files given by
  ``data_files`` (loaded with ``datasets.load_dataset``, which works offline for local files);
* anything else: a Hugging Face dataset id (``subset`` is its config name). This may download.

Missing validation/test splits are carved out of train deterministically
(``validation_fraction``/``test_fraction`` with ``seed``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from datasets import Dataset, DatasetDict, load_dataset

from train.data.chat import load_chat_splits
from train.data.corpus import DEFAULT_CORPUS_DIR, build_corpus

__all__ = [
    "LOCAL_FORMATS",
    "DataError",
    "SPLIT_ALIASES",
    "SPLIT_NAMES",
    "DataSourceConfig",
    "load_text_dataset",
]

SPLIT_NAMES: tuple[str, ...] = ("train", "validation", "test")
LOCAL_FORMATS: dict[str, str] = {
    "json": "json",
    "jsonl": "json",
    "parquet": "parquet",
    "csv": "csv",
    "text": "text",
}
# Source split names recognised for each canonical split when no explicit ``split`` mapping is given.
SPLIT_ALIASES: dict[str, tuple[str, ...]] = {
    "train": ("train",),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test",),
}

EMBEDDED = ("stdlib", "chat")
"""Sources built from the Python installation (no files, no download)."""

DataFiles = str | tuple[str, ...] | dict[str, str | tuple[str, ...]]


def _freeze_files(value: Any) -> DataFiles | None:
    if value is None:
        return None
    if isinstance(value, str | os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        out: dict[str, str | tuple[str, ...]] = {}
        for key, item in value.items():
            frozen = _freeze_files(item)
            if frozen is None or isinstance(frozen, dict):
                raise ValueError(f"data_files[{key!r}] must be a path or a list of paths, got {item!r}")
            out[str(key)] = frozen
        return out
    if isinstance(value, Sequence):
        items = [os.fspath(v) if isinstance(v, str | os.PathLike) else None for v in value]
        if not items or any(v is None for v in items):
            raise ValueError(f"data_files must be a path, a list of paths or a mapping; got {value!r}")
        return tuple(v for v in items if v is not None)
    raise ValueError(f"data_files must be a path, a list of paths or a mapping; got {value!r}")


@dataclass(frozen=True)
class DataSourceConfig:
    """Where text comes from and which columns hold it. Validated on construction.

    Exactly one "shape" is used: ``messages_field`` (chat; needs a tokenizer with a chat
    template), else ``prompt_field`` + ``response_field`` (both or neither), else ``text_field``.
    """

    name: str = "stdlib"
    data_files: Any = None  # path | list of paths | {split: path(s)}; normalised to str/tuple/dict
    split: Mapping[str, str] | None = None  # canonical split -> source split spec, e.g. "train[:90%]"
    subset: str | None = None  # Hugging Face dataset config name
    text_field: str = "text"
    prompt_field: str | None = None
    response_field: str | None = None
    messages_field: str | None = None
    validation_fraction: float = 0.05
    test_fraction: float = 0.05
    seed: int = 0
    max_samples: int | None = None  # cap per split (after splitting), first rows kept
    corpus_dir: str = DEFAULT_CORPUS_DIR  # where the "stdlib" corpus is cached
    load_kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra load_dataset kwargs
    num_workers: int = 0
    """DataLoader worker processes per rank for the training and validation batches (0: batches are made in
    the training process, enough for the small models here; a few for a GPU that waits on its batches)."""
    pin_memory: bool = False
    """Batches in page-locked host memory, so the copy to a GPU overlaps the step (true on GPUs)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(
                f"name must be 'stdlib', 'chat', one of {sorted(LOCAL_FORMATS)} "
                f"or a Hugging Face dataset id; got {self.name!r}"
            )
        object.__setattr__(self, "data_files", _freeze_files(self.data_files))
        if self.name in LOCAL_FORMATS and self.data_files is None:
            raise ValueError(f"data_files is required when name={self.name!r} (a local {self.name} source)")
        if self.name in EMBEDDED and self.data_files is not None:
            raise ValueError(f"data_files must be None when name={self.name!r} (an embedded source)")
        if self.name == "chat":
            if self.messages_field not in (None, "messages") or self.prompt_field is not None:
                raise ValueError("name='chat' has its own columns: leave messages_field/prompt_field unset")
            object.__setattr__(self, "messages_field", "messages")

        if self.split is not None:
            if not isinstance(self.split, Mapping) or not self.split:
                raise ValueError(f"split must be a non-empty mapping with keys in {list(SPLIT_NAMES)}")
            split = {str(k): v for k, v in self.split.items()}
            bad = sorted(set(split) - set(SPLIT_NAMES))
            if bad:
                raise ValueError(f"split has unknown keys {bad}; allowed keys: {list(SPLIT_NAMES)}")
            if "train" not in split:
                raise ValueError(f"split must map 'train'; allowed keys: {list(SPLIT_NAMES)}")
            for key, value in split.items():
                if not isinstance(value, str) or not value:
                    raise ValueError(f"split[{key!r}] must be a non-empty split name string, got {value!r}")
            object.__setattr__(self, "split", split)

        for name in ("text_field", "prompt_field", "response_field", "messages_field"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty column name string, got {value!r}")
        if not self.text_field:
            raise ValueError("text_field must be a non-empty column name")
        if (self.prompt_field is None) != (self.response_field is None):
            raise ValueError("prompt_field and response_field must be set together (both or neither)")
        if self.messages_field is not None and self.prompt_field is not None:
            raise ValueError("messages_field cannot be combined with prompt_field/response_field")

        for name in ("validation_fraction", "test_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
        if self.validation_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                "validation_fraction + test_fraction must be < 1, got "
                f"{self.validation_fraction} + {self.test_fraction}"
            )
        if self.max_samples is not None and (
            isinstance(self.max_samples, bool)
            or not isinstance(self.max_samples, int)
            or self.max_samples < 1
        ):
            raise ValueError(f"max_samples must be None or a positive integer, got {self.max_samples!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if (
            isinstance(self.num_workers, bool)
            or not isinstance(self.num_workers, int)
            or self.num_workers < 0
        ):
            raise ValueError(f"num_workers must be an integer >= 0, got {self.num_workers!r}")
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"pin_memory must be true or false, got {self.pin_memory!r}")
        object.__setattr__(self, "load_kwargs", dict(self.load_kwargs or {}))

    @property
    def kind(self) -> str:
        """``"stdlib"``, ``"chat"``, ``"local"`` or ``"hub"``."""
        if self.name in EMBEDDED:
            return self.name
        return "local" if self.name in LOCAL_FORMATS else "hub"

    @property
    def shape(self) -> str:
        """``"messages"``, ``"prompt_response"`` or ``"text"``."""
        if self.messages_field is not None:
            return "messages"
        return "prompt_response" if self.prompt_field is not None else "text"


def _data_files_arg(files: DataFiles | None) -> Any:
    if isinstance(files, tuple):
        return list(files)
    if isinstance(files, dict):
        return {k: list(v) if isinstance(v, tuple) else v for k, v in files.items()}
    return files


class DataError(ValueError):
    """A data source loaded nothing usable: an empty file, no rows, no text."""


def _check_local_files(files: DataFiles | None) -> None:
    """An empty local data file is named before ``datasets`` fails on it with a bare StopIteration."""
    if files is None:
        return
    paths = [
        p for group in (files.values() if isinstance(files, Mapping) else [files]) for p in _paths(group)
    ]
    for path in paths:
        local = os.path.expanduser(path)
        if os.path.isfile(local) and os.path.getsize(local) == 0:
            raise DataError(
                f"data.data_files: {path} is empty; point data.data_files at a file with documents"
            )


def _paths(group: Any) -> list[str]:
    return [group] if isinstance(group, str) else [str(p) for p in group]


def _load_raw(source: DataSourceConfig) -> dict[str, Dataset]:
    """Load the source's splits, keyed by canonical name (validation/test may be missing)."""
    if source.kind == "stdlib":
        return dict(build_corpus(source.corpus_dir))
    if source.kind == "chat":
        return load_chat_splits(source.validation_fraction, source.test_fraction)
    _check_local_files(source.data_files)
    path = LOCAL_FORMATS.get(source.name, source.name)
    kwargs: dict[str, Any] = dict(source.load_kwargs)
    if source.data_files is not None:
        kwargs["data_files"] = _data_files_arg(source.data_files)
    if source.split is not None:
        out: dict[str, Dataset] = {}
        for canonical, spec in source.split.items():
            loaded = load_dataset(path, source.subset, split=spec, **kwargs)
            if not isinstance(loaded, Dataset):
                raise ValueError(f"split {spec!r} of {source.name!r} did not load as a Dataset")
            out[canonical] = loaded
        return out
    loaded_all = load_dataset(path, source.subset, **kwargs)
    if not isinstance(loaded_all, DatasetDict):
        raise ValueError(f"{source.name!r} did not load as a DatasetDict")
    out = {}
    for canonical, aliases in SPLIT_ALIASES.items():
        for alias in aliases:
            if alias in loaded_all:
                out[canonical] = loaded_all[alias]
                break
    if "train" not in out:
        raise ValueError(
            f"{source.name!r} has no train split (found {sorted(loaded_all)}); "
            "name one with split={'train': ...}"
        )
    return out


def _carve(splits: dict[str, Dataset], source: DataSourceConfig) -> dict[str, Dataset]:
    """Fill missing validation/test splits from train, deterministically."""
    train = splits["train"]
    missing = [s for s in ("validation", "test") if s not in splits]
    fractions = {"validation": source.validation_fraction, "test": source.test_fraction}
    total = sum(fractions[s] for s in missing)
    if not missing:
        return splits
    n = len(train)
    sizes = {s: (max(1, round(n * fractions[s])) if fractions[s] > 0 and n > 2 else 0) for s in missing}
    if total <= 0 or sum(sizes.values()) == 0:
        empty = train.select([])
        return {**splits, **{s: empty for s in missing}}
    order = np.random.default_rng(source.seed).permutation(n).tolist()
    out = dict(splits)
    start = 0
    for s in missing:
        out[s] = train.select(sorted(order[start : start + sizes[s]]))
        start += sizes[s]
    out["train"] = train.select(sorted(order[start:]))
    return out


def _normalise(ds: Dataset, source: DataSourceConfig, tokenizer: Any, split: str) -> Dataset:
    cols = ds.column_names

    def need(column: str, option: str) -> None:
        if column not in cols:
            raise ValueError(f"{option}={column!r} is not a column of the {split} split; columns: {cols}")

    shape = source.shape
    if shape == "text":
        need(source.text_field, "text_field")
        out = ds.select_columns([source.text_field])
        if source.text_field != "text":
            out = out.rename_column(source.text_field, "text")
        return out
    if shape == "prompt_response":
        assert source.prompt_field is not None and source.response_field is not None
        need(source.prompt_field, "prompt_field")
        need(source.response_field, "response_field")
        pf, rf = source.prompt_field, source.response_field

        def join(batch: dict[str, list[Any]]) -> dict[str, list[str]]:
            prompts = [str(p) for p in batch[pf]]
            responses = [str(r) for r in batch[rf]]
            return {
                "text": [p + r for p, r in zip(prompts, responses, strict=True)],
                "prompt": prompts,
                "response": responses,
            }

        return ds.map(join, batched=True, remove_columns=cols, desc=f"normalise {split}")

    assert source.messages_field is not None
    need(source.messages_field, "messages_field")
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "messages_field needs a tokenizer with a chat template: load_text_dataset(source, tokenizer)"
        )
    mf = source.messages_field

    def render(batch: dict[str, list[Any]]) -> dict[str, list[str]]:
        texts, prompts, responses = [], [], []
        for messages in batch[mf]:
            msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
            if not msgs:
                raise ValueError(f"{mf}: a conversation of the {split} split has no messages")
            if msgs[-1]["role"] != "assistant":  # a request: the prompt ends where the answer starts
                text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                texts.append(text)
                prompts.append(text)
                responses.append("")
                continue
            text = tokenizer.apply_chat_template(msgs, tokenize=False)
            prompt, response = text, ""
            if len(msgs) > 1:
                head = tokenizer.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
                if text.startswith(head):
                    prompt, response = head, text[len(head) :]
                else:  # template does not prefix-extend: fall back to the raw last message
                    prompt, response = head, msgs[-1]["content"]
            texts.append(text)
            prompts.append(prompt)
            responses.append(response)
        return {"text": texts, "prompt": prompts, "response": responses}

    return ds.map(render, batched=True, remove_columns=cols, desc=f"render chat {split}")


def load_text_dataset(source: DataSourceConfig, tokenizer: Any = None) -> DatasetDict:
    """Load ``source`` as a ``DatasetDict`` with train/validation/test and normalised columns.

    ``tokenizer`` is needed only for chat sources (``messages_field``), to apply its chat template.
    """
    if not isinstance(source, DataSourceConfig):
        raise TypeError(f"source must be a DataSourceConfig, got {type(source).__name__}")
    try:
        raw = _load_raw(source)
    except StopIteration as err:  # what `datasets` raises on a file with no rows
        raise DataError(f"data source {source.name!r} ({source.data_files}) has no rows") from err
    if "train" in raw and len(raw["train"]) == 0:
        raise DataError(f"data source {source.name!r} ({source.data_files}): the train split has no rows")
    splits = _carve(raw, source)
    out = {}
    for name in SPLIT_NAMES:
        ds = _normalise(splits[name], source, tokenizer, name)
        if source.max_samples is not None and len(ds) > source.max_samples:
            ds = ds.select(range(source.max_samples))
        out[name] = ds
    return DatasetDict(out)
