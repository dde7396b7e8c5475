"""The dflash method's settings (conf/method/dflash.yaml) and how they build its drafter."""

from __future__ import annotations

from dataclasses import dataclass

from train.config import check_model_source, require
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
    slot_decay: float = 4.0
    """Slot k's loss weight: exp(-(k - 1) / slot_decay) (the authors' gamma; renamed: ``gamma`` is the chain's
    draft length everywhere else)."""
    markov_rank: int = 0
    """DSpark's Markov head: the rank of a bias on each slot's logits from the token before it
    (:mod:`train.models.markov_head`); 0: plain DFlash."""
    mask_token_id: int | None = None
    """The id the draft slots carry; None: the last id of the vocabulary that is no special token."""
    compare_eagle3: str | None = "auto"
    """An EAGLE-3 drafter the finish step measures beside DFlash on the same prompts (an ``eagle3/`` folder
    or Hub id); ``auto``: the newest finished ``experiment=eagle3`` run of this verifier, when there is
    one; None: none."""

    def __post_init__(self) -> None:
        self.check_common()
        require(self.num_layers >= 1, "method.num_layers", ">= 1", self.num_layers)
        require(
            self.block_size >= 2, "method.block_size", ">= 2 (the anchor and one draft slot)", self.block_size
        )
        require(self.num_anchors >= 1, "method.num_anchors", ">= 1", self.num_anchors)
        require(
            isinstance(self.markov_rank, int)
            and not isinstance(self.markov_rank, bool)
            and self.markov_rank >= 0,
            "method.markov_rank",
            "an integer >= 0 (0: no Markov head)",
            self.markov_rank,
        )
        require(
            isinstance(self.slot_decay, int | float)
            and not isinstance(self.slot_decay, bool)
            and self.slot_decay > 0,
            "method.slot_decay",
            "> 0",
            self.slot_decay,
        )
        if self.compare_eagle3 not in (None, "auto"):
            check_model_source("method.compare_eagle3", str(self.compare_eagle3))
        require(
            self.max_len > self.block_size,
            "method.max_len",
            f"> block_size ({self.block_size})",
            self.max_len,
        )
