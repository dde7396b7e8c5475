"""scripts/bench.py overhead imports an older copy of the engine beside the current one."""

from __future__ import annotations

import inspect
import shutil
import sys

import pytest

import train.decoding
import train.decoding.rules.chain as current_chain
import train.decoding.rules.rejection
from research.benchmarks.overhead import load_package
from tests.conftest import REPO_ROOT


def test_a_copy_of_the_engine_runs_its_own_parts_and_leaves_the_current_one(tmp_path):
    """The copy's modules bind the copy's parts (they import each other by absolute name), and the
    current engine's modules are the ones in sys.modules afterwards. Before the fix the 'baseline' was
    the current engine under another name: this test failed on it."""
    copy = tmp_path / "decoding"
    shutil.copytree(REPO_ROOT / "train" / "decoding", copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "rules" / "chain.py").open("a") as f:
        f.write('\nMARKER = "the copy"\n')
    before = {k: m for k, m in sys.modules.items() if k.startswith("train.decoding")}

    old = load_package(str(copy))

    verify = old.rules.rejection.verify_chain
    assert verify.__globals__.get("MARKER") == "the copy"
    assert inspect.getfile(verify).startswith(str(copy))
    assert old.SpeculativeDecoder is not train.decoding.SpeculativeDecoder
    assert not hasattr(current_chain, "MARKER")
    assert {k: m for k, m in sys.modules.items() if k.startswith("train.decoding")} == before
    assert sys.modules["train.decoding"] is train.decoding
    assert train.decoding.rules.rejection.verify_chain is current_chain.verify_chain


def test_a_missing_copy_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--baseline: no package"):
        load_package(str(tmp_path / "nowhere"))
