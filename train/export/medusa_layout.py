"""Exporting prediction heads: our Hub-mixin folder and the layout vLLM's Medusa loader reads.

``heads/`` is :class:`~train.models.heads.MedusaHeads`'s ``save_pretrained`` (safetensors and a
``config.json`` of its constructor's arguments; ``MedusaHeads.from_pretrained`` loads it back).
``heads_vllm/`` holds the same tensors under the same names (``blocks.{h}.layers.{l}.weight`` /
``.bias``, ``lm_heads.{h}.weight``) with the ``config.json`` vLLM expects of a Medusa speculator:
``model_type: medusa``, ``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers`` (the
residual layers per head) and ``medusa_fc_bias: true`` (our residual layers have a bias).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from train.models.heads import MedusaHeads

__all__ = ["export_heads", "export_vllm_medusa", "load_vllm_medusa"]


def export_heads(heads: MedusaHeads, out_dir: str | os.PathLike[str]) -> Path:
    """``out_dir/heads`` (mixin folder) and ``out_dir/heads_vllm`` (vLLM layout); returns the first."""
    out = Path(out_dir)
    heads.save_pretrained(out / "heads")
    export_vllm_medusa(heads, out / "heads_vllm")
    return out / "heads"


def export_vllm_medusa(heads: MedusaHeads, folder: str | os.PathLike[str]) -> Path:
    """The heads in vLLM's Medusa layout (see the module docstring)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "medusa_fc_bias": True,
        "truncated_vocab_size": None,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in heads.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_vllm_medusa(folder: str | os.PathLike[str]) -> MedusaHeads:
    """Read a vLLM-layout folder back by those names (what a vLLM loader sees)."""
    path = Path(folder)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "medusa":
        raise ValueError(f"{path}/config.json: model_type is {config.get('model_type')!r}, not 'medusa'")
    heads = MedusaHeads(
        config["hidden_size"], config["vocab_size"], config["num_heads"], config["num_hidden_layers"]
    )
    state = load_file(str(path / "model.safetensors"))
    expected = set(heads.state_dict())
    if set(state) != expected:
        raise ValueError(f"{path}: tensors {sorted(set(state) ^ expected)} do not match the Medusa layout")
    with torch.no_grad():
        heads.load_state_dict(state)
    return heads
