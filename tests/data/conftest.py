"""Shared fixtures for the data tests: one real stdlib corpus build and one tokenizer per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.data.corpus import build_corpus
from train.data.tokenizer import train_tokenizer


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "stdlib_corpus"
    build_corpus(out)
    return out


@pytest.fixture(scope="session")
def corpus(corpus_dir: Path):
    return build_corpus(corpus_dir)  # reuses the cached copy


@pytest.fixture(scope="session")
def tokenizer_dir(corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    # A subset keeps the session fast; the full-size default is exercised in test_data_tokenizer.
    train_tokenizer(corpus["train"].select(range(120)), vocab_size=1024, out_dir=out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    from train.data.tokenizer import load_tokenizer_file

    return load_tokenizer_file(tokenizer_dir)
