"""Fixtures for the evaluation tests: tiny random Llamas (hidden 32, 2 layers) and short prompts."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs tiny models on one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def verifier():
    return tiny_llama(hidden=32, seed=0)


@pytest.fixture(scope="session")
def drafter():
    return tiny_llama(hidden=32, seed=1)


@pytest.fixture(scope="session")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (1, n), generator=g) for n in (5, 9, 12)]
