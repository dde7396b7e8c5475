"""The eagle3 method's settings (conf/method/eagle3.yaml) and how they build its drafter."""

from __future__ import annotations

from dataclasses import dataclass

from train.config import ConfigError, require
from train.export.speculators import check_vllm_aux_layers
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
