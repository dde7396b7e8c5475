"""What a vLLM Medusa loader sees: the exported ``heads_vllm/`` folder read back by its tensor names and
config keys (train/export/medusa_layout.py writes it). A test reference, not part of the package."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from train.models.heads import MedusaHeads


def load_vllm_medusa(folder: str | os.PathLike[str]) -> MedusaHeads:
    """Read a vLLM-layout folder back by those names (what a vLLM loader sees)."""
    path = Path(folder)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "medusa":
        raise ValueError(f"{path}/config.json: model_type is {config.get('model_type')!r}, not 'medusa'")
    state = load_file(str(path / "model.safetensors"))
    # vLLM's truncated vocabulary: lm_heads of truncated_vocab_size rows, token_map their verifier ids
    truncated = config.get("truncated_vocab_size")
    token_map = state.pop("token_map", None)
    if (truncated is None) != (token_map is None) or (
        token_map is not None and (token_map.dtype != torch.long or len(token_map) != truncated)
    ):
        raise ValueError(f"{path}: truncated_vocab_size {truncated} does not match the token_map tensor")
    heads = MedusaHeads(
        config["hidden_size"],
        config["vocab_size"],
        config["num_heads"],
        config["num_hidden_layers"],
        draft_vocab=None if token_map is None else token_map.tolist(),
    )
    expected = set(heads.state_dict())
    if set(state) != expected:
        raise ValueError(f"{path}: tensors {sorted(set(state) ^ expected)} do not match the Medusa layout")
    with torch.no_grad():
        heads.load_state_dict(state)
    return heads
