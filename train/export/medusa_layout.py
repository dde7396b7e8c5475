"""Exporting prediction heads: our Hub-mixin folder and the layout vLLM's Medusa loader reads.

``heads/`` is :class:`~train.models.heads.MedusaHeads`'s ``save_pretrained`` (safetensors and a
``config.json`` of its constructor's arguments; ``MedusaHeads.from_pretrained`` loads it back).
``heads_vllm/`` holds the same tensors under the same names (``blocks.{h}.layers.{l}.weight`` /
``.bias``, ``lm_heads.{h}.weight``) with the ``config.json`` vLLM expects of a Medusa speculator:
``model_type: medusa``, ``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers`` (the
residual layers per head) and ``medusa_fc_bias: true`` (our residual layers have a bias). Heads over a draft vocabulary
(``draft_vocab``) are what vLLM calls a truncated vocabulary: ``truncated_vocab_size`` is the number of
rows of each ``lm_heads.{h}.weight`` and the ``token_map`` tensor holds the verifier id of each row
(vLLM scatters the heads' logits into the full vocabulary with it, ``-inf`` elsewhere, as
:meth:`MedusaHeads.forward` does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from train.models.heads import MedusaHeads

__all__ = ["export_vllm_medusa", "load_vllm_medusa"]


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
        "truncated_vocab_size": None if heads.draft_vocab is None else len(heads.draft_vocab),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in heads.state_dict().items()}
    if heads.draft_vocab is not None:
        tensors["token_map"] = torch.tensor(heads.draft_vocab, dtype=torch.long)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_vllm_medusa(folder: str | os.PathLike[str]) -> MedusaHeads:
    """The heads a vLLM Medusa folder (:func:`export_vllm_medusa`) holds, every tensor checked by
    ``load_state_dict(strict=True)``; raises ValueError when ``config.json`` is not a Medusa config."""
    path = Path(folder)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "medusa":
        raise ValueError(f"{path}: config.json is not a vLLM Medusa config")
    tensors = load_file(str(path / "model.safetensors"))
    token_map = tensors.pop("token_map", None)
    heads = MedusaHeads(
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        num_heads=config["num_heads"],
        num_layers=config["num_hidden_layers"],
        draft_vocab=None if token_map is None else token_map.tolist(),
    )
    heads.load_state_dict(tensors, strict=True)
    return heads
