"""The dflash method's settings (conf/method/dflash.yaml) and how they build its drafter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from train.config import ConfigError, require
from train.models.dflash_drafter import DFlashDrafter
from train.training.answer_data import answer_eos_ids
from train.training.feature_drafters import FeatureDrafterSettings

__all__ = ["DFlashConfig"]


@dataclass
class DFlashConfig(FeatureDrafterSettings):
    """Hyperparameters of DFlash training (``method=dflash``; the shared ones:
    :class:`~train.training.feature_drafters.FeatureDrafterSettings`); validated before any model loads."""

    num_layers: int = 1
    """The drafter's decoder layers (the authors use 5 on 8B verifiers); one forward of them drafts a
    block."""
    block_size: int = 8
    """The anchor and the draft slots: one forward drafts ``block_size - 1`` tokens (vLLM's
    ``num_speculative_tokens``)."""
    num_anchors: int = 64
    """Blocks trained per row in one forward, their anchors drawn at random among the answer's positions."""
    gamma: float = 4.0
    """Slot k's loss weight: exp(-(k - 1) / gamma)."""
    mask_token_id: int | None = None
    """The id the draft slots carry; None: the last id of the vocabulary that is no special token."""

    def __post_init__(self) -> None:
        self.check_common()
        require(self.num_layers >= 1, "method.num_layers", ">= 1", self.num_layers)
        require(
            self.block_size >= 2, "method.block_size", ">= 2 (the anchor and one draft slot)", self.block_size
        )
        require(self.num_anchors >= 1, "method.num_anchors", ">= 1", self.num_anchors)
        require(
            isinstance(self.gamma, int | float) and not isinstance(self.gamma, bool) and self.gamma > 0,
            "method.gamma",
            "> 0",
            self.gamma,
        )
        require(
            self.max_len > self.block_size,
            "method.max_len",
            f"> block_size ({self.block_size})",
            self.max_len,
        )

    def drafter(self, verifier: Any, tokenizer: Any, train_answers: list[Any]) -> DFlashDrafter:
        """``init`` loaded, or a fresh drafter over the ``draft_vocab_size`` most frequent answer tokens."""
        vocab = int(verifier.config.vocab_size)
        if self.init is not None:
            drafter = DFlashDrafter.from_pretrained(self.init)
            require(
                drafter.vocab_size == vocab,
                "method.init",
                f"a drafter for a vocabulary of {vocab}",
                f"{self.init} (vocab_size={drafter.vocab_size})",
            )
            return drafter
        require(
            self.mask_token_id is None or 0 <= self.mask_token_id < vocab,
            "method.mask_token_id",
            f"null or an id in [0, {vocab})",
            self.mask_token_id,
        )
        special = [*answer_eos_ids(verifier, tokenizer), *(getattr(tokenizer, "all_special_ids", None) or [])]
        try:
            return DFlashDrafter.from_verifier(
                verifier,
                num_layers=self.num_layers,
                block_size=self.block_size,
                mask_token_id=self.mask_token_id,
                aux_layers=self.aux_layers,
                draft_ids=self.draft_ids(verifier, tokenizer, train_answers),
                special_ids=special,
            )
        except ValueError as err:  # the layers do not fit this verifier
            raise ConfigError(f"method.aux_layers: {err}") from None
