"""Which kind of export a folder holds, read from its ``config.json``: the Hub push verifies each kind by
its own loader (:mod:`train.export.hub`) and the model card gives each kind its own usage
(:mod:`train.export.model_card`)."""

from __future__ import annotations

import json
from pathlib import Path

EXPORT_KINDS: tuple[str, ...] = (
    "drafter",
    "dflash",
    "dflash_speculators",
    "eagle3",
    "eagle3_speculators",
    "heads",
    "heads_vllm",
    "steering",
)

DFLASH_SPECULATORS_TYPES: tuple[str, ...] = ("dflash", "dspark")
"""The ``speculators_model_type`` values of a ``dflash_speculators`` folder: DFlash, and DSpark (DFlash with
a Markov head, :mod:`train.models.markov_head`); each is also the vLLM method that serves it."""


def export_kind(folder: Path) -> str:
    """Which export ``folder`` holds, from its ``config.json``: ``drafter`` (a transformers causal LM),
    ``eagle3`` (:class:`~train.models.eagle3_drafter.Eagle3Drafter`), ``eagle3_speculators`` (vLLM's
    speculators layout), ``dflash`` (:class:`~train.models.dflash_drafter.DFlashDrafter`),
    ``dflash_speculators`` (its speculators layout), ``heads`` (:class:`~train.models.heads.MedusaHeads`),
    ``heads_vllm`` (vLLM's
    Medusa layout) or ``steering`` (anything else saved by ``PyTorchModelHubMixin``: SD^2's steering
    module)."""
    config_file = Path(folder) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if "speculators_model_type" in config:
        dflash = config["speculators_model_type"] in DFLASH_SPECULATORS_TYPES
        return "dflash_speculators" if dflash else "eagle3_speculators"
    if config.get("model_type") == "medusa":
        return "heads_vllm"
    if "model_type" in config:
        return "drafter"
    if "aux_layers" in config and "mask_token_id" in config and "block_size" in config:
        return "dflash"
    if "aux_layers" in config and "draft_vocab_size" in config:
        return "eagle3"
    if "num_heads" in config and "vocab_size" in config:
        return "heads"
    return "steering"
