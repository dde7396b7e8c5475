"""scripts/lenience.py on the tiny random pair: one prompt x 8 tokens, one seed, eps 1 and 0.1."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT, tiny_llama


@pytest.fixture(scope="module")
def lenience():
    """The script as a module (registered, so the evaluator can import its ``RecordingDecoder``)."""
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
    assert by_eps[None]["block_efficiency"]["mean"] == 1.0  # one token per verifier call
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


def test_recording_decoder_keeps_seeded_generations_only(lenience, one_thread):
    from train.decoding import SamplingParams

    verifier, drafter = tiny_llama(seed=0), tiny_llama(seed=1)
    lossy = lenience.RecordingDecoder(verifier, drafter, "x", gamma=2, lenience="squared", eps=0.5)
    assert lossy.lossless is False and lossy.inner.lenience == "squared" and lossy.inner.eps == 0.5
    assert lenience.RecordingDecoder(verifier, drafter, "y", gamma=2, lenience="linear", eps=1.0).lossless
    assert lenience.RecordingDecoder(verifier, drafter, "ar", inner="ar").lossless
    lenience.OUTPUTS.clear()
    prompt = torch.tensor([[256, 5, 6]])
    lossy.generate(prompt, 3)  # a warm-up: no generator, not kept
    result = lossy.generate(prompt, 4, SamplingParams(1.0), generator=torch.Generator().manual_seed(0))
    recorded = dict(lenience.OUTPUTS)
    assert recorded == {"x": [([256, 5, 6], result.tokens.tolist())]}
    assert lenience.outputs_by_seed("x", [prompt], [7]) == {7: [result.tokens.tolist()]}
    with pytest.raises(RuntimeError, match="expected 1 prompts x 2 seeds"):
        lenience.outputs_by_seed("x", [prompt], [0, 1])
    lenience.OUTPUTS.clear()
