"""The verifier's own answers as training data: where they come from and how they are batched.

A method that trains on the verifier's outputs (EAGLE-3) reads prompt + answer sequences. The answers
are either a cached folder (one ``.pt`` file per split, validation and train, of :func:`train.models.answers.save_answers`,
e.g. the real pair's ``checkpoints/smollm2/answers``, generated once by the pair build) or generated
here, greedily, by the verifier from prompts of the run's data config.

A batch (:func:`collate_answers`) holds right-padded ``input_ids`` / ``attention_mask`` and
``loss_mask``: True on the rows whose next token is an answer token (row ``len(prompt) - 1`` predicts the
answer's first token), so a loss on the verifier's row j counts only what the drafter will be asked to
guess; and ``index``, each row's place in its split (what a per-row cache is keyed by).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from filelock import FileLock
from rich.progress import Progress
from torch.utils.data import DataLoader
from transformers.trainer_pt_utils import LengthGroupedSampler

from train.config import ConfigError
from train.data.lm import make_prompts
from train.data.sources import load_text_dataset
from train.models.answers import Answer, generate_answers, load_answers, save_answers
from train.models.loading import eos_token_ids

log = logging.getLogger(__name__)

__all__ = [
    "AnswerDataModule",
    "answer_row",
    "cached_answers",
    "collate_answers",
    "answer_batches",
    "answer_eos_ids",
    "generated_answers",
    "pair_answers_folder",
    "run_answers",
    "sampled_answers",
]

SPLITS = ("train", "validation")


def answer_row(answer: Answer, max_len: int, prompt_loss: bool = False) -> dict[str, torch.Tensor] | None:
    """``input_ids`` (prompt + answer; a sequence longer than ``max_len`` loses prompt tokens from the
    left) and ``loss_mask`` (True on the rows that predict an answer token; with ``prompt_loss``, on every
    row that predicts a token of the sequence, prompt included). None for an empty answer or one that
    alone does not fit ``max_len``."""
    if not answer.answer or len(answer.answer) >= max_len:
        return None
    ids = list(answer.prompt) + list(answer.answer)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    first = 0 if prompt_loss else max(len(answer.prompt) - 1, 0)
    mask[first : len(ids) - 1] = True
    cut = max(0, len(ids) - max_len)
    return {"input_ids": torch.tensor(ids[cut:], dtype=torch.long), "loss_mask": mask[cut:]}


def collate_answers(rows: Sequence[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` (``pad_id``), ``attention_mask`` (long) and ``loss_mask`` (bool), (B, T);
    ``index`` (B,) long when the rows carry one."""
    width = max(len(r["input_ids"]) for r in rows)
    batch = {
        "input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
        "loss_mask": torch.zeros((len(rows), width), dtype=torch.bool),
    }
    if all("index" in r for r in rows):
        batch["index"] = torch.stack([torch.as_tensor(r["index"], dtype=torch.long) for r in rows])
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n] = row["input_ids"]
        batch["attention_mask"][i, :n] = 1
        batch["loss_mask"][i, :n] = row["loss_mask"]
    return batch


def cached_answers(folder: str | os.PathLike[str], key: str = "method.answers") -> dict[str, list[Answer]]:
    """``{"train": [...], "validation": [...]}`` from ``folder``; a ConfigError naming ``key`` when a
    split's file is missing."""
    root = Path(folder)
    missing = [s for s in SPLITS if not (root / f"{s}.pt").is_file()]
    if missing:
        raise ConfigError(
            f"{key}: {root} has no {', '.join(f'{s}.pt' for s in missing)} (a folder of the verifier's "
            "answers, e.g. checkpoints/smollm2/answers, written by the pair build); or set it to null to "
            "generate answers from the run's data"
        )
    return {s: load_answers(str(root / f"{s}.pt")) for s in SPLITS}


def answer_eos_ids(verifier: Any, tokenizer: Any) -> list[int]:
    """The ids that end an answer (:func:`train.models.loading.eos_token_ids`: the tokenizer's eos,
    then the verifier's generation config's); ValueError when neither names one."""
    ids = eos_token_ids(tokenizer, verifier)
    if not ids:
        raise ValueError("neither the verifier's generation config nor the tokenizer names an eos token")
    return ids


def generated_answers(
    verifier: Any,
    tokenizer: Any,
    data: Any,
    counts: dict[str, int],
    prompt_len: int,
    answer_tokens: int,
    batch_size: int,
    seed: int,
) -> dict[str, list[Answer]]:
    """The verifier's greedy answers (``answer_tokens`` at most) to ``counts[split]`` prompts of each
    split of ``data`` (a data config), each prompt at most ``prompt_len`` tokens."""
    splits = load_text_dataset(data, tokenizer)
    eos = answer_eos_ids(verifier, tokenizer)
    out: dict[str, list[Answer]] = {}
    for split, count in counts.items():
        prompts = make_prompts(splits[split], tokenizer, prompt_len, count, seed, continuation_len=0)
        rows = [list(ids) for ids in prompts["input_ids"]]
        out[split] = generate_answers(verifier, rows, eos, answer_tokens, batch_size=batch_size, top_k=1)
    return out


def pair_answers_folder(model: Any) -> str | None:
    """Where the pair of a model config keeps the verifier's answers: the real pair's build writes them
    to ``<model.smollm2.out_dir>/answers``; None for a pair that has none (the tiny pair, a Hub pair)."""
    build = getattr(model, "smollm2", None)
    return None if build is None else str(Path(build.out_dir) / "answers")


def run_answers(
    source: str | None,
    pair: Any,
    spec: Any,
    counts: dict[str, int],
    prompt_len: int,
    answer_tokens: int,
    answer_batch: int,
) -> dict[str, list[Answer]]:
    """A method's training answers from its ``method.answers`` setting ``source``: a folder (cached, all
    used); ``"pair"``: the pair's own cached answers (:func:`pair_answers_folder`), generated like None
    for a pair without them; None: ``counts[split]`` answers generated greedily from the run's data."""
    folder = pair_answers_folder(spec.model) if source == "pair" else source
    if folder is not None:
        return cached_answers(folder)
    return generated_answers(
        pair.verifier, pair.tokenizer, spec.data, counts, prompt_len, answer_tokens, answer_batch, spec.seed
    )


def sampled_answers(
    verifier: Any,
    eos: Sequence[int],
    prompts: Sequence[Sequence[int]],
    per_prompt: int,
    temperature: float,
    answer_tokens: int,
    batch_size: int,
    seed: int,
    folder: str | os.PathLike[str] | None = None,
    top_k: int = 1,
) -> list[Answer]:
    """``per_prompt`` answers to each prompt sampled from the verifier at ``temperature`` (full
    distribution, ``answer_tokens`` at most), with its ``top_k`` most likely tokens at each answer token,
    generated once: with a ``folder`` they are cached there (``answers.pt``, and ``sampled.json`` whose
    recipe names the prompts by hash) and reused while the recipe holds (a cache keeping more than
    ``top_k`` serves too: the real pair's build keeps 16 for its drafter, EAGLE-3 reads the same answers);
    a new recipe regenerates them. ``<folder>.lock`` is held meanwhile, so ranks or runs started together
    generate them once. [] for ``per_prompt`` 0."""
    if per_prompt <= 0 or not prompts:
        return []
    recipe = {
        "prompts": hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()[:16],
        "per_prompt": per_prompt,
        "temperature": temperature,
        "answer_tokens": answer_tokens,
        "seed": seed,
        "verifier": str(getattr(verifier.config, "_name_or_path", "")),
        "top_k": top_k,
    }

    def generate() -> list[Answer]:
        rows = [p for p in prompts for _ in range(per_prompt)]
        with Progress(transient=True) as bar:
            task = bar.add_task(f"sampled answers (T = {temperature:g})", total=len(rows))
            return generate_answers(
                verifier,
                rows,
                eos,
                answer_tokens,
                batch_size=batch_size,
                top_k=top_k,
                temperature=temperature,
                seed=seed,
                on_batch=lambda n: bar.advance(task, n),
            )

    if folder is None:
        return generate()
    root = Path(folder)
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{os.path.normpath(root)}.lock"):  # ranks and runs started together: one generates
        meta_path = root / "sampled.json"
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            if _serves(meta.get("recipe"), recipe) and (root / "answers.pt").is_file():
                return load_answers(str(root / "answers.pt"))
        start = time.perf_counter()
        out = generate()
        seconds = time.perf_counter() - start
        tokens = sum(len(a.answer) for a in out)
        log.info("sampled answers: %d (%d tokens) in %.0f s", len(out), tokens, seconds)
        root.mkdir(parents=True, exist_ok=True)
        meta_path.unlink(missing_ok=True)  # no recipe vouches for the answers while they are rewritten
        save_answers(out, str(root / "answers.pt"))
        meta = {"recipe": recipe, "answers": len(out), "tokens": tokens, "seconds": round(seconds, 1)}
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")  # last: a cut-off write is regenerated
    return out


def _serves(cached: Any, wanted: dict[str, Any]) -> bool:
    """Whether sampled answers cached under recipe ``cached`` serve ``wanted``: the same recipe, keeping
    at least as many top tokens (a recipe from before ``top_k`` was recorded kept 1)."""
    if not isinstance(cached, dict):
        return False
    rest = {k: v for k, v in cached.items() if k != "top_k"}
    return rest == {k: v for k, v in wanted.items() if k != "top_k"} and int(cached.get("top_k", 1)) >= int(
        wanted["top_k"]
    )


def answer_batches(
    answers: dict[str, list[Answer]],
    verifier: Any,
    tokenizer: Any,
    batch_size: int,
    max_len: int,
    seed: int,
    prompt_loss: bool = False,
    group_by_length: bool = False,
) -> AnswerDataModule:
    """:class:`AnswerDataModule` padded with the tokenizer's pad id (else the first eos id)."""
    pad = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else answer_eos_ids(verifier, tokenizer)[0]
    )
    return AnswerDataModule(answers, int(pad), batch_size, max_len, seed, prompt_loss, group_by_length)


class AnswerDataModule(L.LightningDataModule):
    """Batches of :func:`collate_answers` over the train / validation answers (train shuffled with a
    seeded generator, the last incomplete batch dropped; under DDP / FSDP Lightning shards them).
    ``prompt_loss``: training rows count the prompt's rows too (validation always the answers' only).
    ``group_by_length``: training batches of rows of similar length (transformers'
    ``LengthGroupedSampler``: shuffled, then sorted by length within mega-batches of up to 50 batches), so
    little of a batch is padding (on the real pair's answers, padded tokens / real ones 1.28 -> 1.02)."""

    def __init__(
        self,
        answers: dict[str, list[Answer]],
        pad_id: int,
        batch_size: int,
        max_len: int,
        seed: int = 0,
        prompt_loss: bool = False,
        group_by_length: bool = False,
    ) -> None:
        super().__init__()
        self.pad_id, self.batch_size, self.seed = pad_id, batch_size, seed
        self.group_by_length = group_by_length
        self.rows = {
            split: [
                r
                for a in answers.get(split, [])
                if (r := answer_row(a, max_len, prompt_loss and split == "train")) is not None
            ]
            for split in SPLITS
        }
        for rows in self.rows.values():
            for i, row in enumerate(rows):
                row["index"] = torch.tensor(i)
        if len(self.rows["train"]) < batch_size:
            raise ConfigError(
                f"method.batch_size: {batch_size} is more than the {len(self.rows['train'])} usable "
                f"training answers (non-empty, shorter than method.max_len = {max_len})"
            )

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        sampler = None
        if shuffle and self.group_by_length:
            lengths = [len(r["input_ids"]) for r in self.rows[split]]
            sampler = LengthGroupedSampler(self.batch_size, lengths=lengths, generator=generator)
        return DataLoader(
            self.rows[split],  # type: ignore[arg-type]
            batch_size=self.batch_size,
            shuffle=shuffle and sampler is None,
            sampler=sampler,
            drop_last=shuffle,
            collate_fn=self._collate,
            generator=generator,
        )

    def _collate(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate_answers(rows, self.pad_id)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", shuffle=False)
