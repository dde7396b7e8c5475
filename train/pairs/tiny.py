"""The embedded tiny verifier/drafter pair: corpus -> tokenizer -> two pretrained Llama models.

``python train.py experiment=tiny_pair`` builds it; experiments that need it call
:func:`ensure_tiny_pair`, which reuses the cache only when its manifest records the same recipe
and corpus, and rebuilds it otherwise (saying why). The drafter is a deliberately imperfect proxy:
about 9x fewer parameters, fewer steps, and a different, smaller slice of the training files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, get_cosine_schedule_with_warmup

from train.config import TrainerConfig, require, require_decoder_shape
from train.data.corpus import build_corpus
from train.data.lm import pack_sequences
from train.data.tokenizer import train_tokenizer
from train.losses import acceptance_from_logits
from train.methods.pretrain.config import PretrainConfig
from train.methods.pretrain.module import PretrainModule
from train.models.loading import one_local_device
from train.progress import StepProgressBar

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


@dataclass
class TinyModelRecipe:
    """Architecture and schedule of one model of the pair."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    tie_embeddings: bool = False
    max_steps: int = 500
    lr: float = 2e-3
    train_fraction: float = 1.0

    def __post_init__(self) -> None:
        require(self.hidden_size >= 8, "model.tiny.*.hidden_size", ">= 8", self.hidden_size)
        require_decoder_shape("model.tiny.*", self.hidden_size, self.num_heads, self.num_layers)
        require(self.max_steps >= 1, "model.tiny.*.max_steps", ">= 1", self.max_steps)
        require(self.lr > 0, "model.tiny.*.lr", "> 0", self.lr)
        require(0 < self.train_fraction <= 1, "model.tiny.*.train_fraction", "in (0, 1]", self.train_fraction)

    def llama_config(self, vocab_size: int, max_positions: int, bos: int, eos: int, pad: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=max_positions,
            tie_word_embeddings=self.tie_embeddings,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
        )


@dataclass
class TinyPairConfig:
    """The whole recipe of the embedded pair; any change to it invalidates the cache."""

    out_dir: str
    corpus_dir: str
    verifier: TinyModelRecipe
    drafter: TinyModelRecipe
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 16
    max_positions: int = 2048
    val_blocks: int = 64
    warmup_fraction: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.vocab_size >= 300, "model.tiny.vocab_size", ">= 300", self.vocab_size)
        require(
            8 <= self.seq_len <= self.max_positions,
            "model.tiny.seq_len",
            "in [8, max_positions]",
            self.seq_len,
        )
        require(self.batch_size >= 1, "model.tiny.batch_size", ">= 1", self.batch_size)
        require(self.val_blocks >= 1, "model.tiny.val_blocks", ">= 1", self.val_blocks)

    def recipe_hash(self) -> str:
        """Hash of everything that shapes the pair (not where it is written)."""
        recipe = {k: v for k, v in asdict(self).items() if k not in ("out_dir", "corpus_dir")}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def read_manifest(out_dir: str) -> dict[str, Any] | None:
    path = Path(out_dir) / MANIFEST
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def stale_reason(cfg: TinyPairConfig) -> str | None:
    """Why the cached pair cannot be used as it is (None when it can)."""
    manifest = read_manifest(cfg.out_dir)
    if manifest is None:
        return f"no tiny pair under {cfg.out_dir}"
    if manifest.get("recipe_hash") != cfg.recipe_hash():
        return f"the cached pair under {cfg.out_dir} was built from another recipe (model.tiny.* changed)"
    for role in ("verifier", "drafter"):
        if not (Path(cfg.out_dir) / role / "config.json").is_file():
            return f"the cached pair under {cfg.out_dir} lacks its {role}"
    return None


def ensure_tiny_pair(cfg: TinyPairConfig, trainer_cfg: TrainerConfig | None = None) -> dict[str, Any]:
    """Build the pair on first use, rebuild a stale one, and return its manifest."""
    reason = stale_reason(cfg)
    if reason is None:
        log.info("Using the cached tiny pair under %s", cfg.out_dir)
        return read_manifest(cfg.out_dir) or {}
    log.warning("%s: building it now (about 10 minutes on 2 CPU cores).", reason)
    return build_tiny_pair(cfg, trainer_cfg)


def _pretrain_config(recipe: TinyModelRecipe, cfg: TinyPairConfig) -> PretrainConfig:
    return PretrainConfig(
        optimizer=functools.partial(torch.optim.AdamW, lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.95)),
        scheduler=functools.partial(
            get_cosine_schedule_with_warmup,
            num_warmup_steps=max(1, int(cfg.warmup_fraction * recipe.max_steps)),
            num_training_steps=recipe.max_steps,
        ),
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
    )


def _fit(
    model: PreTrainedModel,
    recipe: TinyModelRecipe,
    cfg: TinyPairConfig,
    blocks: Any,
    trainer_cfg: TrainerConfig,
    log_dir: str,
    role: str,
) -> None:
    n = max(cfg.batch_size, int(len(blocks) * recipe.train_fraction))
    # A fraction < 1 trains on the last blocks of the packed stream only: a smaller slice of the corpus.
    subset = blocks.select(range(len(blocks) - n, len(blocks)))
    loader = DataLoader(
        subset,
        batch_size=cfg.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    module = PretrainModule(model, _pretrain_config(recipe, cfg))
    trainer = L.Trainer(
        accelerator=trainer_cfg.accelerator,
        devices=one_local_device(trainer_cfg.accelerator),  # this rank's GPU: any rank may build the pair
        max_steps=recipe.max_steps,
        limit_val_batches=0,
        logger=CSVLogger(save_dir=log_dir, name=role, version=""),
        callbacks=[StepProgressBar()],
        enable_checkpointing=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        log_every_n_steps=min(10, recipe.max_steps),
        default_root_dir=log_dir,
    )
    trainer.fit(module, train_dataloaders=loader)


@torch.inference_mode()
def evaluate_pair(
    verifier: PreTrainedModel, drafter: PreTrainedModel, blocks: Any, batch_size: int = 8
) -> dict[str, float]:
    """Validation perplexity of both models and the drafter's expected acceptance, mean of 1 - TVD."""
    verifier.eval()
    drafter.eval()
    nll = {"verifier": 0.0, "drafter": 0.0}
    acc_sum, tokens = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        ids = blocks[start : start + batch_size]["input_ids"]
        p_logits = verifier(input_ids=ids).logits[:, :-1].float()
        q_logits = drafter(input_ids=ids).logits[:, :-1].float()
        labels = ids[:, 1:]
        n = labels.numel()
        for role, logits in (("verifier", p_logits), ("drafter", q_logits)):
            nll[role] += float(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            )
        acc_sum += float(acceptance_from_logits(q_logits, p_logits)) * n
        tokens += n
    return {
        "verifier_perplexity": math.exp(nll["verifier"] / tokens),
        "drafter_perplexity": math.exp(nll["drafter"] / tokens),
        "expected_acceptance": acc_sum / tokens,
        "val_tokens": float(tokens),
    }


def build_tiny_pair(
    cfg: TinyPairConfig, trainer_cfg: TrainerConfig | None = None, log_dir: str | None = None
) -> dict[str, Any]:
    """Build the corpus, tokenizer and both models into ``cfg.out_dir``; return the manifest."""
    trainer_cfg = trainer_cfg or TrainerConfig()
    t0 = time.perf_counter()
    L.seed_everything(cfg.seed, verbose=False)
    out = Path(cfg.out_dir)
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    log_dir = log_dir or str(tmp / "logs")

    corpus = build_corpus(cfg.corpus_dir)
    corpus_manifest = json.loads((Path(cfg.corpus_dir) / "manifest.json").read_text())
    t_corpus = time.perf_counter()
    tokenizer = train_tokenizer(
        corpus["train"], cfg.vocab_size, tmp / "tokenizer", fingerprint=corpus_manifest["fingerprint"]
    )
    t_tok = time.perf_counter()
    train_blocks = pack_sequences(corpus["train"], tokenizer, cfg.seq_len)
    val_blocks = pack_sequences(corpus["validation"], tokenizer, cfg.seq_len)
    val_blocks = val_blocks.select(range(min(cfg.val_blocks, len(val_blocks))))
    log.info(
        "corpus %.1fs, tokenizer %.1fs, %d train blocks of %d tokens",
        t_corpus - t0,
        t_tok - t_corpus,
        len(train_blocks),
        cfg.seq_len,
    )

    ids = dict(bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    models: dict[str, PreTrainedModel] = {}
    timings: dict[str, float] = {}
    for role, recipe in (("verifier", cfg.verifier), ("drafter", cfg.drafter)):
        L.seed_everything(cfg.seed, verbose=False)
        config = recipe.llama_config(len(tokenizer), cfg.max_positions, **ids)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        start = time.perf_counter()
        _fit(model, recipe, cfg, train_blocks, trainer_cfg, log_dir, role)
        timings[f"{role}_train_seconds"] = time.perf_counter() - start
        model.eval()
        model.save_pretrained(tmp / role)
        tokenizer.save_pretrained(tmp / role)
        models[role] = model

    metrics = evaluate_pair(models["verifier"], models["drafter"], val_blocks)
    params = {role: sum(p.numel() for p in m.parameters()) for role, m in models.items()}
    manifest = {
        "recipe_hash": cfg.recipe_hash(),
        "recipe": {k: v for k, v in asdict(cfg).items() if k not in ("out_dir", "corpus_dir")},
        "corpus_fingerprint": corpus_manifest["fingerprint"],
        "python_version": corpus_manifest.get("python_version"),
        "parameters": params,
        "param_ratio": params["verifier"] / params["drafter"],
        "train_blocks": len(train_blocks),
        "metrics": metrics,
        "seconds": {
            "corpus": t_corpus - t0,
            "tokenizer": t_tok - t_corpus,
            **timings,
            "total": time.perf_counter() - t0,
        },
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return manifest


def format_report(manifest: dict[str, Any]) -> str:
    """The build summary printed at the end of ``experiment=tiny_pair``."""
    m, p, s = manifest["metrics"], manifest["parameters"], manifest["seconds"]
    return "\n".join(
        [
            "| model | parameters | validation perplexity |",
            "|---|---:|---:|",
            f"| verifier | {p['verifier']:,} | {m['verifier_perplexity']:.2f} |",
            f"| drafter | {p['drafter']:,} | {m['drafter_perplexity']:.2f} |",
            "",
            f"expected acceptance (mean 1 - TVD over {int(m['val_tokens'])} validation tokens): "
            f"{m['expected_acceptance']:.4f}",
            f"parameter ratio verifier/drafter: {manifest['param_ratio']:.1f}x; built in {s['total']:.0f}s",
        ]
    )
