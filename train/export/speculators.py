"""Exporting an EAGLE-3 drafter in vLLM's speculators format (docs/eagle3.md#export-the-speculators-format).

vLLM loads a folder with ``config.json`` (``speculators_model_type: "eagle3"``, the draft layer as a
Llama ``transformer_layer_config``, ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids``, ...)
and ``model.safetensors`` with speculators' tensor names (vllm-project/speculators,
``src/speculators/models/eagle3/core.py`` and ``model_definitions.py``): ``fc.weight``,
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``, ``norm.weight``,
``lm_head.weight`` (N, h), ``d2t`` (int64, N), ``t2d`` (bool, V) and, optionally,
``embed_tokens.weight``. :class:`~train.models.eagle3_drafter.Eagle3Drafter` uses these names itself, so its
state dict is written as it is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from train.models.eagle3_drafter import Eagle3Drafter

__all__ = [
    "load_speculators",
    "export_speculators",
    "from_speculators_layer_ids",
    "VLLM_AUX_LAYERS",
    "check_vllm_aux_layers",
    "rope_scaling_of",
    "speculators_config",
    "to_speculators_layer_ids",
]


def to_speculators_layer_ids(hf_indices: Sequence[int]) -> list[int]:
    """Our aux layers (Hugging Face ``hidden_states`` indices) as ``eagle_aux_hidden_state_layer_ids``.

    The same numbers. vLLM's models capture ``hidden_states + residual`` inside the layer loop *before*
    running layer ``idx`` when ``idx in aux_hidden_state_layers`` (e.g. ``vllm/model_executor/models/
    llama.py``): the stream entering layer idx, which is Hugging Face's ``hidden_states[idx]``
    (``hidden_states[0]`` is the embeddings). speculators agrees: its default is ``[2, L//2, L-3]``
    (``resolve_target_layer_ids``) and its ``launch_vllm.py`` appends ``num_hidden_layers`` for the
    last layer's output. SGLang / SpecForge number the output of layer i, one less; never those here.
    ``tests/models/test_eagle3.py`` checks the exported ids against the inputs of the verifier's layers."""
    return [int(i) for i in hf_indices]


def from_speculators_layer_ids(ids: Sequence[int]) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` back to ``hidden_states`` indices (the same numbers; see
    :func:`to_speculators_layer_ids`)."""
    return [int(i) for i in ids]


VLLM_AUX_LAYERS = 3
"""How many verifier layers vLLM's EAGLE-3 fuses: its ``fc`` takes ``3 * hidden_size`` inputs."""


def check_vllm_aux_layers(aux_layers: Sequence[int]) -> None:
    """Raise ValueError, naming ``method.aux_layers``, unless the drafter fuses exactly
    :data:`VLLM_AUX_LAYERS` layers: vLLM would build a ``fc`` of another shape and refuse the weights."""
    if len(aux_layers) != VLLM_AUX_LAYERS:
        raise ValueError(
            f"the speculators format (vLLM's EAGLE-3) fuses exactly {VLLM_AUX_LAYERS} verifier layers "
            f"(fc input = {VLLM_AUX_LAYERS} x hidden_size), and this drafter fuses {len(aux_layers)} "
            f"({list(aux_layers)}); train it with method.aux_layers=null (EAGLE-3's [2, L//2, L-3]) or a "
            f"list of {VLLM_AUX_LAYERS} hidden_states indices to export it for vLLM"
        )


def rope_scaling_of(rope_parameters: Mapping[str, Any]) -> dict[str, Any] | None:
    """transformers' ``rope_scaling`` (before 5.0, which vLLM and older readers take) for the layer's
    ``rope_parameters``: the same entries without ``rope_theta`` (written at the top level), e.g.
    Llama-3.1's ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, ...}``; None for
    plain RoPE (``rope_type`` default), which those readers assume when the key is absent."""
    if rope_parameters.get("rope_type", "default") == "default":
        return None
    return {key: value for key, value in rope_parameters.items() if key != "rope_theta"}


def speculators_config(
    drafter: Eagle3Drafter,
    verifier_name_or_path: str,
    speculative_tokens: int = 3,
    verifier_architectures: Sequence[str] = (),
) -> dict[str, Any]:
    """The ``config.json`` dictionary of the export (see the module docstring). Raises ValueError for a
    drafter vLLM cannot load (:func:`check_vllm_aux_layers`)."""
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    check_vllm_aux_layers(drafter.aux_layers)
    layer = drafter.layer_config.to_dict()
    layer["architectures"] = ["LlamaForCausalLM"]
    for key in ("_name_or_path", "transformers_version", "id2label", "label2id"):
        layer.pop(key, None)
    # older readers (vLLM / transformers before rope_parameters) read rope_theta at the top level
    layer.setdefault("rope_theta", drafter.rope_parameters["rope_theta"])
    scaling = rope_scaling_of(drafter.rope_parameters)
    if scaling is not None:  # Llama-3.1-style scaling, which those readers find under rope_scaling only
        layer.setdefault("rope_scaling", scaling)
    weight = drafter.fc.weight
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier_name_or_path,
                "architectures": list(verifier_architectures),
            },
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": drafter.draft_vocab_size,
        # written even at its default: tools disagree on the default when it is absent. Ours takes the
        # residual from the feature before hidden_norm.
        "norm_before_residual": False,
        "target_hidden_size": drafter.hidden_size,
        "eagle_aux_hidden_state_layer_ids": to_speculators_layer_ids(drafter.aux_layers),
        "dtype": str(weight.dtype).removeprefix("torch."),
    }


def export_speculators(
    drafter: Eagle3Drafter,
    out_dir: str | os.PathLike[str],
    verifier_name_or_path: str,
    speculative_tokens: int = 3,
    verifier_architectures: Sequence[str] = (),
    include_embeddings: bool = True,
) -> Path:
    """Write ``drafter`` to ``out_dir`` in the speculators format and return the folder.

    speculative_tokens: the chain length vLLM drafts by default; include_embeddings: also write the
    (frozen, verifier's) ``embed_tokens.weight`` (speculators writes it; without it a reader must take
    the verifier's)."""
    config = speculators_config(drafter, verifier_name_or_path, speculative_tokens, verifier_architectures)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {
        name: tensor.detach().to("cpu").contiguous()
        for name, tensor in drafter.state_dict().items()
        if include_embeddings or name != "embed_tokens.weight"
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def load_speculators(folder: str | os.PathLike[str]) -> Eagle3Drafter:
    """The drafter a speculators folder (:func:`export_speculators`) holds, every tensor checked by
    ``load_state_dict(strict=True)``; raises ValueError when ``config.json`` is not an EAGLE-3 speculators
    config or the folder has no ``embed_tokens.weight`` (exported with ``include_embeddings=False``:
    the verifier's embeddings are needed then, and this loader does not take a verifier)."""
    path = Path(folder)
    config = json.loads((path / "config.json").read_text())
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{path}: config.json is not an EAGLE-3 speculators config")
    layer = config["transformer_layer_config"]
    drafter = Eagle3Drafter(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer["head_dim"],
        vocab_size=layer["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        aux_layers=from_speculators_layer_ids(config["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=layer["rms_norm_eps"],
        rope_parameters=layer.get("rope_parameters"),
        max_position_embeddings=layer["max_position_embeddings"],
        hidden_act=layer["hidden_act"],
    )
    tensors = load_file(str(path / "model.safetensors"))
    if "embed_tokens.weight" not in tensors:
        raise ValueError(f"{path} holds no embed_tokens.weight: it loads only beside its verifier")
    drafter.load_state_dict(tensors, strict=True)
    return drafter
