"""Fixtures for the decoding tests: tiny random-weight HF models (seeded, eval mode)."""

from __future__ import annotations

import pytest
import torch

from .decoding_helpers import build, tiny_config


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs tiny models on one intra-op thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_pairs() -> dict[str, tuple[torch.nn.Module, torch.nn.Module]]:
    """{arch: (verifier hidden 64, drafter hidden 32)}, 2 layers, vocab 128, seeded, eval mode."""
    return {
        arch: (build(tiny_config(arch, 64), 1), build(tiny_config(arch, 32), 2))
        for arch in ("llama", "qwen3", "gpt2")
    }


@pytest.fixture(scope="session")
def llama_pair(tiny_pairs):
    return tiny_pairs["llama"]


@pytest.fixture(scope="session")
def eagle3_verifiers() -> dict[str, torch.nn.Module]:
    """{arch: a 4-layer verifier, hidden 32, vocab 128} for the EAGLE-3 tests (EAGLE-3 reads layers 2,
    L//2, L-3)."""
    return {arch: build(tiny_config(arch, 32, layers=4), 1) for arch in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def eagle3_law_verifier() -> torch.nn.Module:
    """The EAGLE-3 law tests' verifier: 4 layers, hidden 32, a 6-token vocabulary, float64."""
    return build(tiny_config("llama", hidden=32, vocab=6, layers=4), 5).double()
