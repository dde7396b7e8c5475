"""Exporting prediction heads: our Hub-mixin folder and the layout vLLM's Medusa loader reads.

``heads/`` is :class:`~train.models.heads.MedusaHeads`'s ``save_pretrained`` (safetensors and a
``config.json`` of its constructor's arguments; ``MedusaHeads.from_pretrained`` loads it back).
``heads_vllm/`` holds the same tensors under the same names (``blocks.{h}.layers.{l}.weight`` /
``.bias``, ``lm_heads.{h}.weight``) with the ``config.json`` vLLM expects of a Medusa speculator:
``model_type: medusa``, ``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers`` (the
residual layers per head) and ``medusa_fc_bias: true`` (our residual layers have a bias).

Heads over a draft vocabulary (``draft_vocab``) are written with **full-vocabulary** projections. vLLM
0.32 builds each ``lm_heads.{h}`` with ``vocab_size`` rows and refuses a checkpoint with fewer (its
``truncated_vocab_size`` + ``token_map`` path only loads a single shared head, ``original_lm_head``), so
the rows of the draft ids are the trained ones and every other row is their **mean**. vLLM's Medusa
proposes each head's argmax, and a mean row's logit is the mean of the draft rows' logits, never above
their maximum: the argmax over the full vocabulary is the draft vocabulary's, the token the heads propose
in this project's engine. ``config.json`` keeps ``draft_vocab`` (vLLM ignores the key) so
:func:`load_vllm_medusa` gives back the trained heads exactly.
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
    config: dict[str, object] = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "medusa_fc_bias": True,
    }
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in heads.state_dict().items()}
    if heads.draft_vocab is not None:
        config["draft_vocab"] = list(heads.draft_vocab)
        ids = torch.tensor(heads.draft_vocab, dtype=torch.long)
        for h in range(heads.num_heads):
            tensors[f"lm_heads.{h}.weight"] = full_vocabulary_rows(
                tensors[f"lm_heads.{h}.weight"], ids, heads.vocab_size
            )
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def full_vocabulary_rows(draft_rows: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A ``(vocab_size, hidden)`` projection: ``draft_rows`` at ``draft_ids``, their mean everywhere else
    (its logit is the draft logits' mean, so the argmax stays among the draft ids)."""
    full = draft_rows.mean(dim=0, keepdim=True).expand(vocab_size, -1).clone()
    full[draft_ids] = draft_rows
    return full


def load_vllm_medusa(folder: str | os.PathLike[str]) -> MedusaHeads:
    """The heads a vLLM Medusa folder (:func:`export_vllm_medusa`) holds, every tensor checked by
    ``load_state_dict(strict=True)``; heads over a draft vocabulary get back their trained rows (the ids in
    ``config.json``'s ``draft_vocab``; an older export's ``token_map`` tensor is read too). Raises
    ValueError when ``config.json`` is not a Medusa config."""
    path = Path(folder)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") != "medusa":
        raise ValueError(f"{path}: config.json is not a vLLM Medusa config")
    tensors = load_file(str(path / "model.safetensors"))
    token_map = tensors.pop("token_map", None)
    draft_vocab = config.get("draft_vocab") or (None if token_map is None else token_map.tolist())
    heads = MedusaHeads(
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
        num_heads=config["num_heads"],
        num_layers=config["num_hidden_layers"],
        draft_vocab=draft_vocab,
    )
    if draft_vocab is not None:
        ids = torch.tensor(draft_vocab, dtype=torch.long)
        for h in range(heads.num_heads):
            weight = tensors[f"lm_heads.{h}.weight"]
            if (
                weight.shape[0] == heads.vocab_size
            ):  # full-vocabulary rows: the draft ids' are the trained ones
                tensors[f"lm_heads.{h}.weight"] = weight[ids].contiguous()
    heads.load_state_dict(tensors, strict=True)
    return heads
