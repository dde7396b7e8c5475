"""A test-side reader of the speculators EAGLE-3 layout: it knows only the format (config.json keys and
tensor names as vllm-project/speculators writes them), not our exporter, and rebuilds an
:class:`~train.models.eagle3_drafter.Eagle3Drafter` from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from train.models.eagle3_drafter import Eagle3Drafter

LAYER = "layers.0."
EXPECTED = {
    "fc.weight",
    *(f"{LAYER}self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"{LAYER}mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"{LAYER}{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}
"""Every tensor a speculators EAGLE-3 folder must hold (``embed_tokens.weight`` is optional)."""


def read_config(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text())


def load_speculators(folder: str | Path, verifier: torch.nn.Module | None = None) -> Eagle3Drafter:
    """The drafter in ``folder``; its embeddings from the file, else from ``verifier``."""
    config = read_config(folder)
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["norm_before_residual"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert config["target_hidden_size"] == layer["hidden_size"]
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    assert set(tensors) - {"embed_tokens.weight"} == EXPECTED, sorted(set(tensors) ^ EXPECTED)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    n, vocab = config["draft_vocab_size"], layer["vocab_size"]
    assert tensors["lm_head.weight"].shape[0] == n == tensors["d2t"].numel()
    assert tensors["t2d"].numel() == vocab and int(tensors["t2d"].sum()) == n
    drafter = Eagle3Drafter(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer["head_dim"],
        vocab_size=vocab,
        draft_vocab_size=n,
        # speculators' ids are "input of layer i": Hugging Face's hidden_states index, unchanged
        aux_layers=config["eagle_aux_hidden_state_layer_ids"],
        rms_norm_eps=layer["rms_norm_eps"],
        rope_parameters=layer["rope_parameters"],
        max_position_embeddings=layer["max_position_embeddings"],
        hidden_act=layer["hidden_act"],
    )
    if "embed_tokens.weight" not in tensors:
        assert verifier is not None, "no embed_tokens.weight in the folder: pass the verifier"
        tensors["embed_tokens.weight"] = (
            verifier.get_input_embeddings().weight.detach().cpu()  # type: ignore[operator]
        )
    drafter.load_state_dict(tensors, strict=True)
    return drafter
