"""What every drafter trained on the verifier's hidden states (EAGLE-3, DFlash) shares: the settings of its
answers, batches, feature cache and draft vocabulary (:class:`FeatureDrafterSettings`, validated before any
model loads), and the build of its training data from them (:func:`feature_drafter_data`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from train.config import require
from train.models.answers import Answer
from train.models.answers_vllm import ANSWER_ENGINES
from train.models.draft_vocab import frequent_tokens
from train.models.fingerprint import verifier_fingerprint
from train.training.answer_data import answer_batches, answer_eos_ids
from train.training.answer_share import answer_device, prompts_digest, recipe_digest
from train.training.answer_sources import answers_cache_dir, method_answers, sampled_answers
from train.training.optim import check_optimizer

__all__ = ["FeatureDrafterSettings", "feature_drafter_data"]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class FeatureDrafterSettings:
    """The settings a drafter on the verifier's features trains with (conf/method/eagle3.yaml and
    dflash.yaml document each)."""

    optimizer: Any
    scheduler: Any = None
    answers: str | None = None
    """A folder of the verifier's answers (one ``.pt`` file per split); ``pair``: the pair's own
    (generated when it has none); None: generate them from the run's data (greedy)."""
    num_prompts: int = 1024
    num_val_prompts: int = 32
    prompt_len: int = 256
    answer_tokens: int = 128
    answer_batch: int = 16
    answer_engine: str = "auto"
    """What generates the answers: auto | vllm | transformers (train/models/answers_vllm.py)."""
    sampled_answers: int = 0
    """More training answers: this many per training prompt, sampled from the verifier at
    ``sampled_temperature`` (cached in ``sampled_answers_dir``; null: keyed by the recipe under the
    run's answer cache)."""
    sampled_temperature: float = 1.0
    sampled_answers_dir: str | None = None
    max_len: int = 512
    """Prompt + answer tokens per training row (longer rows lose prompt tokens from the left)."""
    batch_size: int = 8
    group_by_length: bool = True
    feature_cache_gb: float = 0.0
    """Keep each row's verifier features in CPU memory after its first pass, up to this many GiB
    (:mod:`train.training.feature_cache`); 0: the verifier runs every step."""
    feature_cache_dir: str | None = None
    """Save the kept features here; the next run with the same verifier and layers reads them back."""
    prompt_loss: bool = False
    """Train on the verifier's rows over the prompt too, not only the answer's (validation: the answer's)."""
    draft_vocab_size: int | None = 8192
    """Rows of the drafter's head: the most frequent tokens of the training answers; None: all."""
    aux_layers: list[int] | None = None
    """The verifier's ``hidden_states`` indices the drafter fuses; None: [2, L//2, L-3]."""
    vllm_export: bool = True
    """Also export the speculators folder vLLM loads."""
    init: str | None = None
    """Start from an exported drafter (a folder or Hub id) instead of a fresh one."""
    compare_pair_drafter: bool = True
    """The finish step also measures the pair's own drafter (chain SD), when the pair has one."""

    def check_common(self) -> None:
        """Validate the shared settings (a ConfigError naming the key)."""
        check_optimizer("method", self.optimizer, self.scheduler)
        require(
            self.answer_engine in ANSWER_ENGINES,
            "method.answer_engine",
            f"one of {ANSWER_ENGINES}",
            self.answer_engine,
        )
        for key in ("num_prompts", "num_val_prompts", "answer_batch", "batch_size"):
            require(getattr(self, key) >= 1, f"method.{key}", ">= 1", getattr(self, key))
        gb = self.feature_cache_gb
        require(_number(gb) and gb >= 0, "method.feature_cache_gb", ">= 0", gb)
        require(
            self.feature_cache_dir is None or self.feature_cache_gb > 0,
            "method.feature_cache_dir",
            "null unless method.feature_cache_gb > 0 (the rows it saves are the ones kept in memory)",
            self.feature_cache_dir,
        )
        require(self.sampled_answers >= 0, "method.sampled_answers", ">= 0", self.sampled_answers)
        t = self.sampled_temperature
        require(_number(t) and t > 0, "method.sampled_temperature", "> 0", t)
        require(self.prompt_len >= 2, "method.prompt_len", ">= 2", self.prompt_len)
        require(self.answer_tokens >= 2, "method.answer_tokens", ">= 2", self.answer_tokens)
        require(
            self.draft_vocab_size is None or self.draft_vocab_size >= 1,
            "method.draft_vocab_size",
            ">= 1 or null (the full vocabulary)",
            self.draft_vocab_size,
        )
        require(
            self.aux_layers is None or (len(self.aux_layers) >= 1 and min(self.aux_layers) >= 0),
            "method.aux_layers",
            "null or a non-empty list of hidden_states indices",
            self.aux_layers,
        )
        require(isinstance(self.vllm_export, bool), "method.vllm_export", "true or false", self.vllm_export)

    def default_sampled_dir(self, verifier: Any, train_answers: list[Any], spec: Any) -> str:
        """Where the sampled answers are cached when ``sampled_answers_dir`` is null: a folder of the run's
        answer cache named by what they are sampled from (the verifier's weights, the prompts, T)."""
        key = {
            "verifier": verifier_fingerprint(verifier),
            "prompts": prompts_digest([a.prompt for a in train_answers]),
            "temperature": self.sampled_temperature,
            "per_prompt": self.sampled_answers,
        }
        return str(Path(answers_cache_dir(spec)) / f"sampled-{recipe_digest(key)}")

    def draft_ids(self, verifier: Any, tokenizer: Any, train_answers: list[Any]) -> list[int] | None:
        """The ``draft_vocab_size`` most frequent answer tokens (the eos ids always among them), or None
        for the full vocabulary."""
        vocab = int(verifier.config.vocab_size)
        if self.draft_vocab_size is None or self.draft_vocab_size >= vocab:
            return None
        always = answer_eos_ids(verifier, tokenizer)
        return frequent_tokens((a.answer for a in train_answers), self.draft_vocab_size, always=always)


def feature_drafter_data(
    cfg: FeatureDrafterSettings, pair: Any, spec: Any
) -> tuple[dict[str, list[Answer]], L.LightningDataModule]:
    """The verifier's answers (cached or generated, plus ``sampled_answers`` per training prompt) and their
    batches."""
    verifier, tokenizer = pair.verifier, pair.tokenizer
    answers = method_answers(cfg, pair, spec, cfg.prompt_len)
    extra = sampled_answers(
        verifier,
        answer_eos_ids(verifier, tokenizer),
        [a.prompt for a in answers["train"]],
        cfg.sampled_answers,
        cfg.sampled_temperature,
        cfg.answer_tokens,
        cfg.answer_batch,
        spec.seed,
        cfg.sampled_answers_dir or cfg.default_sampled_dir(verifier, answers["train"], spec),
        engine=cfg.answer_engine,
        device=answer_device(spec.trainer.accelerator),
    )
    answers = {**answers, "train": answers["train"] + extra}
    data = answer_batches(
        answers,
        verifier,
        tokenizer,
        cfg.batch_size,
        cfg.max_len,
        spec.seed,
        cfg.prompt_loss,
        cfg.group_by_length,
    )
    return answers, data
