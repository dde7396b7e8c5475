"""vLLM 0.32's Medusa speculator as its code computes it (vllm/model_executor/models/medusa.py and
vllm/v1/spec_decode/medusa.py, read 2026-11-27), to check ``heads_vllm/`` (train/export/medusa_layout.py)
without vLLM installed. A test reference, not part of the package; the slow serving test loads the same
folder in vLLM itself (docs/serving.md).

What it reproduces: ``config.json``'s keys; each head a stack of residual blocks ``x + silu(W x + b)``;
each ``lm_heads.{h}`` built with ``vocab_size`` rows, whose weight loader asserts the checkpoint's rows
are exactly that many (a ``token_map`` slices them first, which a checkpoint of truncated rows cannot
survive); logits scattered into ``-inf`` through ``token_map`` when ``truncated_vocab_size < vocab_size``;
and the proposal: each head's argmax, in order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class VllmMedusa:
    def __init__(self, folder: str | os.PathLike[str]) -> None:
        path = Path(folder)
        config = json.loads((path / "config.json").read_text())
        if config.get("model_type") != "medusa":
            raise ValueError(f"{path}/config.json: model_type is {config.get('model_type')!r}, not 'medusa'")
        state = load_file(str(path / "model.safetensors"))
        self.vocab_size = int(config["vocab_size"])
        self.num_heads = int(config["num_heads"])
        truncated = config.get("truncated_vocab_size") or self.vocab_size
        self.token_map = state.pop("token_map", None) if truncated < self.vocab_size else None
        state.pop("token_map", None)
        if config.get("original_lm_head"):
            raise NotImplementedError("one shared lm_head: not a layout draftsmith writes")
        bias = bool(config.get("medusa_fc_bias", False))
        self.blocks: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = []
        self.lm_heads: list[torch.Tensor] = []
        for h in range(self.num_heads):
            layers = []
            for layer in range(int(config["num_hidden_layers"])):
                weight = state.pop(f"blocks.{h}.layers.{layer}.weight")
                layers.append((weight, state.pop(f"blocks.{h}.layers.{layer}.bias") if bias else None))
            self.blocks.append(layers)
            weight = state.pop(f"lm_heads.{h}.weight")
            if self.token_map is not None and weight.shape[0] > self.token_map.shape[0]:
                weight = weight[self.token_map]
            if weight.shape[0] != self.vocab_size:  # VocabParallelEmbedding.weight_loader's assertion
                raise ValueError(
                    f"lm_heads.{h}.weight has {weight.shape[0]} rows; vLLM's loader wants {self.vocab_size}"
                )
            self.lm_heads.append(weight)
        if state:
            raise ValueError(f"{path}: tensors vLLM does not load: {sorted(state)}")

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(num_heads, *hidden.shape[:-1], vocab_size)`` logits."""
        out = []
        for layers, lm_head in zip(self.blocks, self.lm_heads, strict=True):
            x = hidden
            for weight, bias in layers:
                x = x + F.silu(F.linear(x, weight, bias))
            logits = x @ lm_head.T
            if self.token_map is not None:
                full = torch.full((*logits.shape[:-1], self.vocab_size), float("-inf"), dtype=logits.dtype)
                full[..., self.token_map] = logits[..., : len(self.token_map)]
                logits = full
            out.append(logits)
        return torch.stack(out)

    def propose(self, hidden: torch.Tensor) -> torch.Tensor:
        """vLLM's draft: each head's argmax, ``(*hidden.shape[:-1], num_heads)``."""
        return self(hidden).argmax(dim=-1).movedim(0, -1)


def load_vllm_medusa(folder: str | os.PathLike[str]) -> VllmMedusa:
    return VllmMedusa(folder)
