"""scripts/trees.py on a micro pair (one depth, one budget, one prompt): the page it writes names the pair
it ran on, and goes to docs/trees_real.md for the real pair, docs/trees.md for another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from research.pairs import DecodeSetup
from tests.test_docs_commands import load_script
from train.data.sources import DataSourceConfig


@pytest.mark.parametrize("real", [True, False])
def test_the_page_describes_the_pair_that_ran(
    real: bool,
    tiny_pair_dir: Path,
    text_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    one_thread,
) -> None:
    trees = load_script("scripts/trees.py")
    data = DataSourceConfig(name="jsonl", data_files=str(text_file), test_fraction=0.2)
    setup = DecodeSetup(
        str(tiny_pair_dir / "verifier"),
        str(tiny_pair_dir / "drafter"),
        "float32",
        data,
        16,
        16.0,
        real_pair=real,
    )
    monkeypatch.setattr(trees, "pair_setup", lambda pair: setup)
    monkeypatch.setattr(trees, "bench_pair_overhead", lambda **kwargs: "BENCH PAIR TABLE")
    monkeypatch.setenv("DRAFTSMITH_ROOT", str(tmp_path))
    (tmp_path / "docs").mkdir()
    micro = (  # noqa: SIM905
        "--prompts 1 --tokens 4 --seeds 0 --depths 3 --budgets 4 --threads 1 --device cpu"
    ).split()
    trees.main(["--pair", str(tiny_pair_dir), *micro, "--json", str(tmp_path / "raw.json")])
    page = (tmp_path / "docs" / ("trees_real.md" if real else "trees.md")).read_text()
    assert len(list((tmp_path / "docs").iterdir())) == 1
    first = page.splitlines()[0]
    assert first.endswith("on the real pair" if real else "on the embedded pair")
    assert ("SmolLM2-135M-Instruct" in page) == real and ("embedded tiny pair" in page) == (not real)
    assert "1 held-out jsonl prompts (test split, at most 16 tokens)" in page
    assert ("BENCH PAIR TABLE" in page) == (not real)  # the benchmark pair stands in for a slow verifier
    assert "after a 16-token cached\nprefix" in page and "| 3 | 0 | rsd_s d3 w3 |" in page
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert {r["drafter"] for r in raw["depth"]["3"]["runs"]} == {tiny_pair_dir.name}
    assert raw["summary"]["command"].endswith("--seeds 0 --depths 3 --budgets 4")
