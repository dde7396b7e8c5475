"""The eagle3 method's settings (conf/method/eagle3.yaml) and how they build its drafter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from train.config import ConfigError, require
from train.export.speculators import check_vllm_aux_layers
from train.models.eagle3_drafter import Eagle3Drafter
from train.training.feature_drafters import FeatureDrafterSettings

__all__ = ["Eagle3Config"]


@dataclass
class Eagle3Config(FeatureDrafterSettings):
    """Hyperparameters of EAGLE-3 training (``method=eagle3``; the shared ones:
    :class:`~train.training.feature_drafters.FeatureDrafterSettings`); validated before any model loads.
    ``aux_layers``: vLLM's EAGLE-3 fuses exactly three, so another count needs ``vllm_export: false``
    (checked at start-up, before any training)."""

    ttt_steps: int = 7
    """Training-time test: drafting steps unrolled per sequence (the authors' 7)."""
    decay: float = 0.8
    """Weight of step k's loss: decay**k."""
    speculative_tokens: int = 3
    """The chain length the speculators export advertises to vLLM (its ``num_speculative_tokens``)."""

    def __post_init__(self) -> None:
        self.check_common()
        require(self.ttt_steps >= 1, "method.ttt_steps", ">= 1", self.ttt_steps)
        require(
            self.max_len > self.ttt_steps + 2,
            "method.max_len",
            f"> ttt_steps + 2 ({self.ttt_steps + 2})",
            self.max_len,
        )
        require(
            isinstance(self.decay, int | float) and not isinstance(self.decay, bool) and 0 < self.decay <= 1,
            "method.decay",
            "in (0, 1]",
            self.decay,
        )
        require(self.speculative_tokens >= 1, "method.speculative_tokens", ">= 1", self.speculative_tokens)
        if self.vllm_export and self.aux_layers is not None:
            try:
                check_vllm_aux_layers(self.aux_layers)
            except ValueError as err:
                raise ConfigError(
                    f"method.aux_layers: {err}; or set method.vllm_export=false to export eagle3/ only"
                ) from None

    def drafter(self, verifier: Any, tokenizer: Any, train_answers: list[Any]) -> Eagle3Drafter:
        """``init`` loaded, or a fresh drafter over the ``draft_vocab_size`` most frequent answer tokens
        (the eos ids always among them)."""
        if self.init is not None:
            drafter = Eagle3Drafter.from_pretrained(self.init)
            require(
                drafter.vocab_size == int(verifier.config.vocab_size),
                "method.init",
                f"a drafter for a vocabulary of {verifier.config.vocab_size}",
                f"{self.init} (vocab_size={drafter.vocab_size})",
            )
            return drafter
        ids = self.draft_ids(verifier, tokenizer, train_answers)
        try:
            return Eagle3Drafter.from_verifier(verifier, aux_layers=self.aux_layers, draft_ids=ids)
        except ValueError as err:  # the layers do not fit this verifier
            raise ConfigError(f"method.aux_layers: {err}") from None
