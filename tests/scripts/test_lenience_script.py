"""scripts/lenience.py on the tiny random pair: one prompt x 8 tokens, one seed, eps 1 and 0.1."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT


@pytest.fixture(scope="module")
def lenience():
    """The script as a module (registered in ``sys.modules``, as an imported module is)."""
    spec = importlib.util.spec_from_file_location("lenience_script", REPO_ROOT / "scripts" / "lenience.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def peaked_drafter(tiny_pair_dir, tmp_path_factory):
    """The pair's drafter with its output logits scaled 10x. Random-weight models are near-uniform and
    accept each other's drafts almost always; a peaked drafter makes the lossless rule reject about 4
    drafts in 10 on random prompts (expected acceptance 0.57 at eps 1, 0.98 with the linear lenience
    at eps 0.1; less on text)."""
    from transformers import AutoModelForCausalLM

    drafter = AutoModelForCausalLM.from_pretrained(tiny_pair_dir / "drafter")
    with torch.no_grad():
        drafter.lm_head.weight.mul_(10.0)
    path = tmp_path_factory.mktemp("peaked") / "drafter"
    drafter.save_pretrained(path)
    return path


def test_lenience_table_marks_lossless_and_lossy_rows(
    lenience, tiny_pair_dir, peaked_drafter, text_file, tmp_path, one_thread
):
    out = lenience.main(
        [
            "--verifier", str(tiny_pair_dir / "verifier"),
            "--drafter", str(peaked_drafter),
            "--data-files", str(text_file),
            "--prompts", "1", "--prompt-len", "16", "--tokens", "8", "--seeds", "0",
            "--eps", "1", "0.1",
            "--json", str(tmp_path / "lenience.json"),
            "--plot", str(tmp_path / "lenience.png"),
        ]
    )  # fmt: skip
    lines = out["table"].splitlines()
    assert lines[0].startswith("| lenience | eps | rule | block_efficiency |")
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:3]) for line in lines[2:]}
    assert rows == {
        ("autoregressive", "n/a", "lossless"),
        ("any", "1", "lossless"),
        ("linear", "0.1", "lossy"),
    }
    assert out["summary"]["drafter"] == str(peaked_drafter)

    by_eps = {r["eps"]: r for r in out["rows"]}
    assert by_eps[None]["block_efficiency"] is None  # the autoregressive baseline drafts nothing
    for r in out["rows"]:
        assert r["verifier_nll"]["mean"] > 0 and 0.0 <= r["rouge_l_f1"]["mean"] <= 1.0
    # the lenient rule is applied: p / 0.1 accepts far more drafts than the lossless rule (0.56 vs 0.23)
    assert by_eps[0.1]["acceptance_rate"]["mean"] > by_eps[1.0]["acceptance_rate"]["mean"] + 0.2
    assert by_eps[0.1]["block_efficiency"]["mean"] > by_eps[1.0]["block_efficiency"]["mean"]

    saved = json.loads((tmp_path / "lenience.json").read_text())
    assert [r["rule"] for r in saved["rows"]] == ["lossless", "lossless", "lossy"]
    assert {r["decoder"]: r["lossless"] for r in saved["results"]["runs"]}["sd linear eps=0.1"] is False
    assert (tmp_path / "lenience.png").stat().st_size > 0


def test_drafter_resolution(lenience, tiny_pair_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_ROOT", str(tmp_path))  # no checkpoints/distillspec runs there
    verifier = str(tiny_pair_dir / "verifier")
    assert lenience.resolve_drafter("pretrained", verifier) == str(tiny_pair_dir / "drafter")
    assert lenience.resolve_drafter(None, verifier) == str(tiny_pair_dir / "drafter")
    assert lenience.resolve_drafter("/some/drafter", verifier) == "/some/drafter"


def test_outputs_are_filed_by_decoder_seed_and_prompt(lenience):
    from train.evaluation import Generation

    collect = lenience.OutputCollector(2)
    for seed in (0, 1):
        for i in (1, 0):  # any order: each lands at its prompt's place
            collect(Generation(None, "ar", 1.0, seed, i, [seed, i]))
            collect(Generation("drafter", "sd eps=1", 1.0, seed, i, [9, i]))
    assert collect.by_seed(lenience.AR_LABEL, [0, 1]) == {0: [[0, 0], [0, 1]], 1: [[1, 0], [1, 1]]}
    assert collect.by_seed("sd eps=1", [1]) == {1: [[9, 0], [9, 1]]}
    with pytest.raises(RuntimeError, match="at seeds \\[2\\]"):
        collect.by_seed("sd eps=1", [0, 2])
