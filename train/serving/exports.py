"""A run's exports as vLLM serves them: which folders a run holds, the ``speculative_config`` vLLM takes for
each, and the chain this project's evaluator decodes with the same drafter to compare acceptance.

vLLM drafts a chain of ``num_speculative_tokens`` tokens, the most likely one at each step at T = 0:

- ``draft_model``: a drafter model (``drafter/``, a transformers causal LM: DistillSpec's, the pair's).
  The engine's counterpart: chain speculative decoding with ``gamma`` = that number.
- ``medusa``: prediction heads in vLLM's Medusa layout (``heads_vllm/``); one token per head, so the
  number is the heads'. The counterpart: the heads' top-1 chain (BPD).
- ``eagle3``: an EAGLE-3 drafter in the speculators layout (``eagle3_speculators/``). The counterpart:
  the EAGLE-3 decoder with a tree of one branch of that depth.
- ``dflash``: a DFlash drafter in the speculators layout (``dflash_speculators/``): one forward drafts its
  block's ``block_size - 1`` slots, whatever was asked (vLLM's block is 1 + that number positions, and
  the drafter was trained on its own block length). The counterpart: the DFlash decoder's whole chain.

SD^2's steering module (``steering/``) has no vLLM method: a steered drafter reads the verifier's hidden
states into a drafter model's, which none of vLLM's proposers do.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.export.kinds import export_kind

__all__ = ["ServedExport", "served_exports", "served_export"]

VLLM_METHODS: dict[str, str] = {
    "drafter": "draft_model",
    "heads_vllm": "medusa",
    "eagle3_speculators": "eagle3",
    "dflash_speculators": "dflash",
}
"""The vLLM ``speculative_config.method`` of each export kind vLLM serves."""

NOT_SERVED: dict[str, str] = {
    "steering": (
        "SD^2's steering module has no vLLM method (no proposer reads the verifier's states into a drafter)"
    ),
    "heads": "serve heads_vllm/, the same heads in vLLM's Medusa layout",
    "eagle3": "serve eagle3_speculators/, the same drafter in the speculators layout",
    "dflash": "serve dflash_speculators/, the same drafter in the speculators layout",
}


@dataclass(frozen=True)
class ServedExport:
    """One export folder, how vLLM serves it and how this project's evaluator decodes the same chain."""

    folder: Path
    kind: str
    num_speculative_tokens: int

    @functools.cached_property
    def method(self) -> str:
        if self.kind == "dflash_speculators":  # dflash, or dspark for a drafter with a Markov head
            return str(_config(self.folder)["speculators_model_type"])
        return VLLM_METHODS[self.kind]

    def speculative_config(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "model": str(self.folder),
            "num_speculative_tokens": self.num_speculative_tokens,
        }

    def decoder_entry(self) -> dict[str, Any]:
        """The evaluator's decoder config (``eval.decoders`` entry) for vLLM's chain."""
        k = self.num_speculative_tokens
        if self.kind == "drafter":
            return {"name": f"sd_g{k}", "_target_": "train.decoding.SpeculativeDecoder", "gamma": k}
        if self.kind == "heads_vllm":
            tree = [[0] * (i + 1) for i in range(k)]
            return {
                "name": "heads_chain",
                "_target_": "train.decoding.HeadsDecoder",
                "tree": tree,
                "acceptance": "rejection",
            }
        if self.kind == "dflash_speculators":
            return {"name": f"dflash_chain{k}", "_target_": "train.decoding.DFlashDecoder", "gamma": k}
        return {
            "name": f"eagle3_chain{k}",
            "_target_": "train.decoding.Eagle3Decoder",
            "depth": k,
            "branching": 1,
            "total_tokens": k,
        }


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def served_export(folder: str | os.PathLike[str], num_speculative_tokens: int = 4) -> ServedExport:
    """The export in ``folder`` as vLLM serves it; ``num_speculative_tokens`` is the chain's length for a
    drafter model or EAGLE-3 (Medusa drafts one token per head). Raises ValueError for a kind vLLM does
    not serve, with the reason."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json, not an exported drafter folder")
    kind = export_kind(path)
    if kind not in VLLM_METHODS:
        raise ValueError(f"{path} holds a {kind!r} export: {NOT_SERVED[kind]}")
    k = num_speculative_tokens
    if kind == "heads_vllm":
        k = int(_config(path)["num_heads"])
    elif kind == "dflash_speculators":  # its whole block: vLLM feeds 1 + k positions, and a non-causal
        # block of another length is not the one the drafter was trained on
        k = int(_config(path)["block_size"]) - 1
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    return ServedExport(path, kind, k)


def served_exports(run_dir: str | Path, num_speculative_tokens: int = 4) -> list[ServedExport]:
    """Every export in a run directory that vLLM serves (its immediate subfolders with a config.json)."""
    run = Path(run_dir)
    found = []
    for folder in sorted(p for p in run.iterdir() if (p / "config.json").is_file()):
        if export_kind(folder) in VLLM_METHODS:
            found.append(served_export(folder, num_speculative_tokens))
    return found
