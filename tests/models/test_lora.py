"""LoRA settings and wrapping (train/models/lora.py), shared by every method's ``method.lora``."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import tiny_llama
from train.config import ConfigError
from train.models.lora import LoraSettings, apply_lora, merge_lora


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"enabled": True, "r": 0}, "method.lora.r"),
        ({"rank": 4}, "method.lora must be keys among"),
        ({"dropout": 1.0}, "method.lora.dropout"),
        ("yes", "method.lora must be a mapping"),
    ],
)
def test_bad_settings_name_the_key(value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        LoraSettings.coerce(value)


def test_coerce_defaults_and_passthrough():
    assert LoraSettings.coerce(None) == LoraSettings()
    settings = LoraSettings(enabled=True, r=4)
    assert LoraSettings.coerce(settings) is settings
    assert LoraSettings.coerce({"_target_": "x", "r": 2}).r == 2


def test_adapters_train_and_merge_into_a_plain_copy():
    model = tiny_llama(hidden=32, seed=0)
    wrapped = apply_lora(model, LoraSettings(enabled=True, r=2, alpha=4))
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    merged = merge_lora(wrapped)
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert not any("lora_" in k for k in merged.state_dict())
    assert any("lora_" in n for n, _ in wrapped.named_parameters())  # the trained module is untouched
    plain = torch.nn.Linear(2, 2)
    assert merge_lora(plain) is plain
