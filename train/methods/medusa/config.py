"""The medusa method's settings (conf/method/medusa.yaml) and how they build its module."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from train.config import require
from train.models.answers_vllm import ANSWER_ENGINES
from train.models.lora import LoraSettings
from train.training.optim import check_optimizer

__all__ = ["MedusaConfig"]

log = logging.getLogger(__name__)


@dataclass
class MedusaConfig:
    """Hyperparameters of Medusa-1 / Medusa-2 (``method=medusa`` / ``medusa2``); validated before any
    model loads."""

    optimizer: Any
    scheduler: Any = None
    num_heads: int = 4
    num_layers: int = 1
    decay: float = 0.8
    """Weight of head k's loss: decay**k (the authors' 0.8)."""
    seq_len: int = 64
    batch_size: int = 16
    tree_nodes: int = 16
    """Size of the sparse tree built from the measured per-rank accuracies (saved with the heads)."""
    tree_top: int = 10
    """Ranks measured per head (the authors' top-10)."""
    joint: bool = False
    """Medusa-2: train the verifier too, through LoRA."""
    lora: Any = None
    """Medusa-2's adapters (train.models.lora.LoraSettings;
    the authors' r 32, alpha 16, all linear layers)."""
    heads_weight: float = 0.2
    """Medusa-2: the heads' loss coefficient next to the kept base loss."""
    heads_lr_multiplier: float = 4.0
    """Medusa-2: the heads' learning rate / the adapters' (the optimizer's lr)."""
    backbone_frozen_steps: int = 0
    """Medusa-2: steps at the start during which only the heads train."""
    init_heads: str | None = None
    """Start from exported heads (a heads/ folder or Hub id) instead of the verifier's lm_head; ``auto``:
    the newest Medusa-1 run's heads for this verifier (Medusa-2's authors start from Medusa-1 heads)."""
    self_distill: bool = False
    """Regenerate each block's continuation with the verifier and learn soft targets (see the module doc)."""
    self_distill_temperature: float = 0.3
    prompt_len: int = 16
    """Self-distillation: the corpus tokens each regenerated block starts from."""
    answers: str | None = None
    """Train on the verifier's own answers instead of packed corpus blocks (self-distillation without
    regenerating): a folder of them (e.g. ``checkpoints/smollm2/answers``), ``pair`` (the pair's own,
    generated from the run's data when it has none) or None (the corpus). Heads learn the answer tokens;
    with ``self_distill`` against the verifier's soft targets at those tokens."""
    max_len: int = 384
    """Answers: a sequence longer than this loses prompt tokens from the left."""
    prompt_loss: bool = False
    """Answers: the prompt's tokens are targets too (validation: the answers' only)."""
    num_prompts: int = 256
    """Answers generated for training when none are cached (validation: ``num_val_prompts``)."""
    num_val_prompts: int = 16
    answer_prompt_len: int = 128
    answer_tokens: int = 64
    answer_batch: int = 16
    answer_engine: str = "auto"
    """What generates the answers: auto | vllm | transformers (train/models/answers_vllm.py)."""
    draft_vocab_size: int | None = None
    """Each head projects onto the this many most frequent tokens of the training targets (the eos ids
    among them) instead of the whole vocabulary (models/heads.py); None: the whole vocabulary."""
    ngram_orders: list[int] = field(default_factory=list)
    """n-gram models over token ids (orders 2..4) estimated from the training split and saved with the
    heads (``heads/ngram_<n>/``), for BPD's rescoring (train.decoding.refine, docs/bpd.md)."""

    def __post_init__(self) -> None:
        check_optimizer("method", self.optimizer, self.scheduler)
        require(
            self.answer_engine in ANSWER_ENGINES,
            "method.answer_engine",
            f"one of {ANSWER_ENGINES}",
            self.answer_engine,
        )
        require(self.num_heads >= 1, "method.num_heads", ">= 1", self.num_heads)
        require(self.num_layers >= 0, "method.num_layers", ">= 0", self.num_layers)
        require(
            isinstance(self.decay, int | float) and 0 < self.decay <= 1,
            "method.decay",
            "in (0, 1]",
            self.decay,
        )
        require(
            self.seq_len > self.num_heads + 2,
            "method.seq_len",
            f"> num_heads + 2 ({self.num_heads + 2})",
            self.seq_len,
        )
        require(self.batch_size >= 1, "method.batch_size", ">= 1", self.batch_size)
        require(self.tree_nodes >= 1, "method.tree_nodes", ">= 1", self.tree_nodes)
        require(self.tree_top >= 1, "method.tree_top", ">= 1", self.tree_top)
        require(self.heads_weight > 0, "method.heads_weight", "> 0", self.heads_weight)
        require(self.heads_lr_multiplier > 0, "method.heads_lr_multiplier", "> 0", self.heads_lr_multiplier)
        require(
            self.backbone_frozen_steps >= 0,
            "method.backbone_frozen_steps",
            ">= 0",
            self.backbone_frozen_steps,
        )
        require(
            self.self_distill_temperature > 0,
            "method.self_distill_temperature",
            "> 0",
            self.self_distill_temperature,
        )
        require(
            1 <= self.prompt_len < self.seq_len - self.num_heads - 1,
            "method.prompt_len",
            f"in [1, seq_len - num_heads - 1) = [1, {self.seq_len - self.num_heads - 1})",
            self.prompt_len,
        )
        require(
            all(isinstance(n, int) and 1 <= n <= 4 for n in self.ngram_orders),
            "method.ngram_orders",
            "a list of n-gram orders in 1..4",
            self.ngram_orders,
        )
        for key in ("max_len", "num_prompts", "num_val_prompts", "answer_prompt_len", "answer_batch"):
            require(getattr(self, key) >= 1, f"method.{key}", ">= 1", getattr(self, key))
        require(
            self.answer_tokens >= self.num_heads + 2,
            "method.answer_tokens",
            f">= num_heads + 2 ({self.num_heads + 2})",
            self.answer_tokens,
        )
        require(
            self.draft_vocab_size is None or self.draft_vocab_size >= max(self.tree_top, 2),
            "method.draft_vocab_size",
            f"null or >= tree_top ({self.tree_top})",
            self.draft_vocab_size,
        )
        self.lora = LoraSettings.coerce(self.lora, "method.lora")
        require(
            not self.joint or self.lora.enabled,
            "method.lora.enabled",
            "true for Medusa-2 (joint: true trains the verifier through LoRA adapters only)",
            self.lora.enabled,
        )
