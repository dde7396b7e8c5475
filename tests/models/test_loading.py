"""Loading pairs from local folders: real architectures with random weights, vocab alignment, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from tests.conftest import make_tokenizer
from train.config import ModelConfig
from train.models.loading import (
    ModelNotFoundError,
    TokenizerMismatchError,
    check_same_tokenizer,
    eos_token_ids,
    load_model,
    load_pair,
    output_vocab_size,
)


def _save(model_config, tokenizer, path: Path) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _qwen3(vocab: int, hidden: int) -> Qwen3Config:
    """Qwen3 architecture at toy size (the real pair pads its embeddings to different sizes)."""
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def _llama3(vocab: int, hidden: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
    )


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_real_architecture_pair_loads_frozen_verifier(arch: str, tmp_path: Path) -> None:
    tok = make_tokenizer()
    build = _qwen3 if arch == "qwen3" else _llama3
    # Verifier's embeddings padded beyond the tokenizer, drafter's not: as in Qwen3-8B vs Qwen3-0.6B.
    verifier = _save(build(320, 64), tok, tmp_path / "verifier")
    drafter = _save(build(len(tok), 32), tok, tmp_path / "drafter")
    pair = load_pair(ModelConfig(name=arch, verifier=str(verifier), drafter=str(drafter)))
    assert not pair.verifier.training
    assert not any(p.requires_grad for p in pair.verifier.parameters())
    assert any(p.requires_grad for p in pair.drafter.parameters())
    assert output_vocab_size(pair.verifier) == 320
    assert pair.common_vocab_size == len(tok)
    assert 0 < pair.param_ratio < 1
    ids = torch.tensor([tok.encode("def f(): pass")])
    v, d = pair.verifier(ids).logits, pair.drafter(ids).logits
    assert v[..., : pair.common_vocab_size].shape == d[..., : pair.common_vocab_size].shape


def test_verifier_dtype(tmp_path: Path) -> None:
    tok = make_tokenizer()
    path = _save(_llama3(len(tok), 32), tok, tmp_path / "m")
    cfg = ModelConfig(name="x", verifier=str(path), drafter=str(path), verifier_dtype="bfloat16")
    pair = load_pair(cfg)
    assert next(pair.verifier.parameters()).dtype == torch.bfloat16
    assert next(pair.drafter.parameters()).dtype == torch.float32


def test_mismatched_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    verifier = _save(_llama3(260, 32), make_tokenizer(extra="<|mine|>"), tmp_path / "verifier")
    drafter = _save(_llama3(260, 32), make_tokenizer(extra="<|other|>"), tmp_path / "drafter")
    with pytest.raises(TokenizerMismatchError, match="id 259"):
        load_pair(ModelConfig(name="x", verifier=str(verifier), drafter=str(drafter)))


def test_missing_model_path_is_precise(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no model folder"):
        load_model(str(tmp_path / "nothing-here"))


def test_identical_tokenizers_pass() -> None:
    check_same_tokenizer(make_tokenizer(), make_tokenizer())


def test_both_models_must_cover_the_tokenizer(tmp_path: Path) -> None:
    """The *smaller* output size must hold every token: a drafter cut short fails even when the
    verifier's embeddings are padded far beyond the tokenizer."""
    tok = make_tokenizer()
    verifier = _save(_llama3(320, 32), tok, tmp_path / "verifier")
    drafter = _save(_llama3(len(tok) - 3, 32), tok, tmp_path / "drafter")
    with pytest.raises(TokenizerMismatchError, match=r"drafter's output size is only 256"):
        load_pair(ModelConfig(name="x", verifier=str(verifier), drafter=str(drafter)))


def test_eos_token_ids_unions_tokenizer_and_generation_configs() -> None:
    tok = make_tokenizer()  # eos 257
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama3(len(tok), 32))
    model.generation_config.eos_token_id = [300, 257, 301]  # Llama 3 / Qwen3 list several
    other = AutoModelForCausalLM.from_config(_llama3(len(tok), 32))
    other.generation_config.eos_token_id = 302
    assert eos_token_ids(tok, model, other) == [257, 300, 301, 302]
    assert eos_token_ids(tok, model, model) == [257, 300, 301]  # no duplicates
    assert eos_token_ids(tok) == [257]
    assert eos_token_ids(None, torch.nn.Linear(2, 2)) == []  # no generation config: nothing added
