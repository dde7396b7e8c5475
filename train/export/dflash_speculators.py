"""Exporting a DFlash drafter in the speculators layout vLLM's ``dflash`` method loads (docs/dflash.md).

``config.json``: ``speculators_model_type: "dflash"``, the draft layers as a Qwen3
``transformer_layer_config``
(``num_hidden_layers`` = the drafter's layers; Qwen3 because vLLM's DFlash model is Qwen3-shaped: per-head
``q_norm`` / ``k_norm``), ``draft_vocab_size``, ``block_size``, ``target_hidden_size``,
``aux_hidden_state_layer_ids``, ``mask_token_id``, ``sliding_window_non_causal`` and a
``speculators_config`` whose greedy proposal drafts ``block_size - 1`` tokens (vLLM takes the draft count
from there, not from ``block_size``). ``model.safetensors``: the drafter's state dict under its own names
(``fc``, ``hidden_norm``, ``layers.N.self_attn.{q,k,v,o}_proj``, ``layers.N.self_attn.{q,k}_norm``,
``layers.N.mlp.*``, ``norm``, ``lm_head``, ``embed_tokens``), ``d2t`` when the draft vocabulary is reduced
(vLLM maps draft index i to target id i + d2t[i]; it allocates no ``d2t`` for a full vocabulary).

A drafter with a Markov head (DSpark, :mod:`train.models.markov_head`) is written as speculators' ``dspark``
model type (``architectures: ["DSparkSpeculator"]``, the algorithm ``dspark``, ``markov_rank``,
``markov_head_type: "vanilla"``, no confidence head), its head under ``markov_head.markov_w1`` /
``markov_head.markov_w2`` as vLLM's ``dspark`` method loads them; everything else as for DFlash.

Two details vLLM 0.32-0.33 reads differently from what the names suggest:

- ``aux_hidden_state_layer_ids`` are Hugging Face ``hidden_states`` indices, the stream entering layer i
  (vLLM captures the residual stream after i layers under that id); the authors' own format counts the
  output of layer t, one less, and vLLM adds 1 to those. Ours are written as they are.
- ``sliding_window_non_causal``: vLLM turns it into one causal flag for every draft layer, and a missing
  key reads as non-causal but ``false`` as causal. A DFlash block is non-causal (its slots see each
  other), so ``true`` is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from train.export.kinds import DFLASH_SPECULATORS_TYPES
from train.export.speculators import rope_scaling_of
from train.models.dflash_drafter import DFlashDrafter

__all__ = [
    "dflash_speculators_config",
    "export_dflash_speculators",
    "load_dflash_speculators",
    "speculators_algorithm",
]


def _layer_config(drafter: DFlashDrafter) -> dict[str, Any]:
    """The draft layers as a Qwen3 configuration (what vLLM builds the draft model from)."""
    c = drafter.layer_config
    layer: dict[str, Any] = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": drafter.vocab_size,
        "hidden_size": drafter.hidden_size,
        "intermediate_size": int(c.intermediate_size),
        "num_hidden_layers": drafter.num_layers,
        "num_attention_heads": int(c.num_attention_heads),  # type: ignore[arg-type]
        "num_key_value_heads": int(c.num_key_value_heads),  # type: ignore[arg-type]
        "head_dim": int(c.head_dim),  # type: ignore[arg-type]
        "rms_norm_eps": float(c.rms_norm_eps),
        "hidden_act": str(c.hidden_act),
        "max_position_embeddings": int(c.max_position_embeddings),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * drafter.num_layers,
        "rope_theta": drafter.rope_parameters["rope_theta"],
        "rope_parameters": dict(drafter.rope_parameters),
    }
    scaling = rope_scaling_of(drafter.rope_parameters)
    if scaling is not None:
        layer["rope_scaling"] = scaling
    return layer


def dflash_speculators_config(
    drafter: DFlashDrafter, verifier_name_or_path: str, verifier_architectures: Sequence[str] = ()
) -> dict[str, Any]:
    """The ``config.json`` dictionary of the export (see the module docstring)."""
    algorithm = speculators_algorithm(drafter)
    markov = (
        {"markov_rank": drafter.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": False}
        if drafter.markov_rank
        else {}
    )
    return {
        "architectures": ["DSparkSpeculator" if drafter.markov_rank else "DFlashSpeculator"],
        "speculators_model_type": algorithm,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafter.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier_name_or_path,
                "architectures": list(verifier_architectures),
            },
        },
        "transformer_layer_config": _layer_config(drafter),
        "draft_vocab_size": drafter.draft_vocab_size,
        "block_size": drafter.block_size,
        "target_hidden_size": drafter.hidden_size,
        "aux_hidden_state_layer_ids": [int(i) for i in drafter.aux_layers],
        "mask_token_id": drafter.mask_token_id,
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
        **markov,
    }


def speculators_algorithm(drafter: DFlashDrafter) -> str:
    """``dspark`` for a drafter with a Markov head, else ``dflash`` (the speculators model type and vLLM's
    method)."""
    return "dspark" if drafter.markov_rank else "dflash"


def export_dflash_speculators(
    drafter: DFlashDrafter,
    out_dir: str | os.PathLike[str],
    verifier_name_or_path: str,
    verifier_architectures: Sequence[str] = (),
) -> Path:
    """Write ``drafter`` to ``out_dir`` in the speculators DFlash layout and return the folder."""
    config = dflash_speculators_config(drafter, verifier_name_or_path, verifier_architectures)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    reduced = drafter.draft_vocab_size < drafter.vocab_size
    tensors = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in drafter.state_dict().items()
        if reduced or name not in ("d2t", "t2d")
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_dflash_speculators(folder: str | os.PathLike[str]) -> DFlashDrafter:
    """The drafter a speculators DFlash folder (:func:`export_dflash_speculators`) holds, every tensor
    checked by ``load_state_dict(strict=True)``; ValueError for another kind of config."""
    path = Path(folder)
    config = json.loads((path / "config.json").read_text())
    if config.get("speculators_model_type") not in DFLASH_SPECULATORS_TYPES:
        raise ValueError(f"{path}: config.json is not a DFlash or DSpark speculators config")
    layer = config["transformer_layer_config"]
    drafter = DFlashDrafter(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_layers=layer["num_hidden_layers"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer["head_dim"],
        vocab_size=layer["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        aux_layers=list(config["aux_hidden_state_layer_ids"]),
        block_size=config["block_size"],
        mask_token_id=config["mask_token_id"],
        rms_norm_eps=layer["rms_norm_eps"],
        rope_parameters=layer.get("rope_parameters"),
        max_position_embeddings=layer["max_position_embeddings"],
        hidden_act=layer["hidden_act"],
        markov_rank=int(config.get("markov_rank", 0)),
    )
    tensors = load_file(str(path / "model.safetensors"))
    strict = "d2t" in tensors
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    allowed = set() if strict else {"d2t", "t2d"}
    if set(missing) - allowed or unexpected:
        raise ValueError(f"{path}: tensors missing {sorted(set(missing) - allowed)}, unexpected {unexpected}")
    return drafter
