"""The eagle3 method's settings (conf/method/eagle3.yaml) and how they build its module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from train.config import ConfigError, require
from train.export.speculators import check_vllm_aux_layers
from train.models.answers_vllm import ANSWER_ENGINES
from train.models.draft_vocab import frequent_tokens
from train.models.eagle3_drafter import Eagle3Drafter
from train.models.fingerprint import verifier_fingerprint
from train.training.answer_data import answer_eos_ids
from train.training.answer_share import prompts_digest, recipe_digest
from train.training.answer_sources import answers_cache_dir
from train.training.optim import check_optimizer

__all__ = ["Eagle3Config"]


@dataclass
class Eagle3Config:
    """Hyperparameters of EAGLE-3 training (``method=eagle3``); validated before any model loads."""

    optimizer: Any
    scheduler: Any = None
    answers: str | None = None
    """A folder of the verifier's answers (one ``.pt`` file per split, validation and train, e.g. the real
    pair's ``checkpoints/smollm2/answers``); ``pair``: the pair's own (generated when it has none); None:
    generate them from the run's data (greedy)."""
    num_prompts: int = 1024
    """Answers generated for training when ``answers`` is None (the cached ones are all used)."""
    num_val_prompts: int = 32
    prompt_len: int = 256
    """Generated answers: the prompt's tokens at most."""
    answer_tokens: int = 128
    """Generated answers: their tokens at most."""
    answer_batch: int = 16
    answer_engine: str = "auto"
    """What generates the answers: auto | vllm | transformers (train/models/answers_vllm.py)."""
    sampled_answers: int = 0
    """More training answers: this many per training prompt, sampled from the verifier at
    ``sampled_temperature``. The greedy answers show the drafter one path per prompt; sampled ones show it
    the paths decoding at T > 0 follows, in more contexts. Generated on the first run (batches of
    ``answer_batch``) and cached in ``sampled_answers_dir`` (null: under ``<paths.checkpoints_dir>/answers``,
    keyed by the recipe)."""
    sampled_temperature: float = 1.0
    sampled_answers_dir: str | None = None
    max_len: int = 512
    """Prompt + answer tokens per training row (longer rows lose prompt tokens from the left)."""
    batch_size: int = 8
    group_by_length: bool = True
    """Training batches of rows of similar length (transformers' ``LengthGroupedSampler``), so that a batch
    computes little padding (measured in docs/eagle3.md)."""
    feature_cache_gb: float = 0.0
    """Keep each row's verifier features in CPU memory after its first pass, up to this many GiB, so later
    epochs skip the verifier (:mod:`train.methods.eagle3.feature_cache`); 0: online every epoch."""
    feature_cache_dir: str | None = None
    """A folder for the kept features: saved after every epoch that added rows, read at the start of the next
    run when the same verifier (configuration, weights, fused layers, precision, device kind) computed them,
    so runs after the first train offline on the rows they share; null: memory only.
    Needs ``feature_cache_gb``."""
    prompt_loss: bool = False
    """Train on the verifier's rows over the prompt too, not only the answer's (validation: the answer's):
    the same verifier forward gives 2-3x the targets; the authors train on answers only,
    with far more of them."""
    ttt_steps: int = 7
    """Training-time test: drafting steps unrolled per sequence (the authors' 7)."""
    decay: float = 0.8
    """Weight of step k's loss: decay**k."""
    draft_vocab_size: int | None = 8192
    """Rows of the drafter's head: the most frequent tokens of the training answers (d2t / t2d);
    None or >= the verifier's vocabulary: the full vocabulary."""
    aux_layers: list[int] | None = None
    """The verifier's ``hidden_states`` indices fused by ``fc``; None: EAGLE-3's [2, L//2, L-3].
    vLLM's EAGLE-3 fuses exactly three: another count needs ``vllm_export: false`` (checked at start-up,
    before any training)."""
    vllm_export: bool = True
    """Also export ``eagle3_speculators/``, the folder vLLM's EAGLE-3 loads (exactly three fused layers);
    false: ``eagle3/`` only."""
    init: str | None = None
    """Start from an exported drafter (an Eagle3Drafter folder or Hub id) instead of a fresh one."""
    speculative_tokens: int = 3
    """The chain length the speculators export advertises to vLLM (its ``num_speculative_tokens``)."""
    compare_pair_drafter: bool = True
    """The finish step also measures the pair's own drafter (chain SD), when the pair has one."""

    def __post_init__(self) -> None:
        check_optimizer("method", self.optimizer, self.scheduler)
        require(
            self.answer_engine in ANSWER_ENGINES,
            "method.answer_engine",
            f"one of {ANSWER_ENGINES}",
            self.answer_engine,
        )
        for key in ("num_prompts", "num_val_prompts", "answer_batch", "batch_size", "ttt_steps"):
            require(getattr(self, key) >= 1, f"method.{key}", ">= 1", getattr(self, key))
        require(
            isinstance(self.feature_cache_gb, int | float)
            and not isinstance(self.feature_cache_gb, bool)
            and self.feature_cache_gb >= 0,
            "method.feature_cache_gb",
            ">= 0",
            self.feature_cache_gb,
        )
        require(
            self.feature_cache_dir is None or self.feature_cache_gb > 0,
            "method.feature_cache_dir",
            "null unless method.feature_cache_gb > 0 (the rows it saves are the ones kept in memory)",
            self.feature_cache_dir,
        )
        require(self.sampled_answers >= 0, "method.sampled_answers", ">= 0", self.sampled_answers)
        require(
            isinstance(self.sampled_temperature, int | float)
            and not isinstance(self.sampled_temperature, bool)
            and self.sampled_temperature > 0,
            "method.sampled_temperature",
            "> 0",
            self.sampled_temperature,
        )
        require(self.prompt_len >= 2, "method.prompt_len", ">= 2", self.prompt_len)
        require(self.answer_tokens >= 2, "method.answer_tokens", ">= 2", self.answer_tokens)
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
        require(self.speculative_tokens >= 1, "method.speculative_tokens", ">= 1", self.speculative_tokens)
        require(isinstance(self.vllm_export, bool), "method.vllm_export", "true or false", self.vllm_export)
        if self.vllm_export and self.aux_layers is not None:
            try:
                check_vllm_aux_layers(self.aux_layers)
            except ValueError as err:
                raise ConfigError(
                    f"method.aux_layers: {err}; or set method.vllm_export=false to export eagle3/ only"
                ) from None

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
        vocab = int(verifier.config.vocab_size)
        ids = None
        if self.draft_vocab_size is not None and self.draft_vocab_size < vocab:
            always = answer_eos_ids(verifier, tokenizer)
            ids = frequent_tokens((a.answer for a in train_answers), self.draft_vocab_size, always=always)
        try:
            return Eagle3Drafter.from_verifier(verifier, aux_layers=self.aux_layers, draft_ids=ids)
        except ValueError as err:  # the layers do not fit this verifier
            raise ConfigError(f"method.aux_layers: {err}") from None
