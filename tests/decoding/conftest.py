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
