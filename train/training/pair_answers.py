"""The real pair's own answers: the verifier's greedy answers to its chat prompts, generated when a run
first needs them and cached beside the pair by prompt (EAGLE-3, Medusa and the fixed-data DistillSpec
ablation train on them; ``method.answers: pair``)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from rich.progress import Progress

from train.data.chat import chat_set_fingerprint
from train.data.lm import make_prompts
from train.data.sources import DataSourceConfig, load_text_dataset
from train.models.answers import Answer, load_answers, save_answers
from train.models.answers_vllm import answer_prompts
from train.models.loading import eos_token_ids
from train.training.answer_share import stored_recipe

log = logging.getLogger(__name__)

__all__ = ["answers_for", "chat_prompt_ids", "pair_answers"]


def chat_prompt_ids(tokenizer: Any, split: str, count: int, prompt_len: int, seed: int) -> list[list[int]]:
    """``count`` prompts of the embedded chat set's ``split``, rendered with the chat template."""
    splits = load_text_dataset(DataSourceConfig(name="chat", seed=seed), tokenizer)
    prompts = make_prompts(splits[split], tokenizer, prompt_len, count, seed, continuation_len=0)
    return [list(ids) for ids in prompts["input_ids"]]


def pair_answers(
    model: Any,
    verifier: Any,
    tokenizer: Any,
    train_prompts: int | None = None,
    device: torch.device | None = None,
) -> dict[str, list[Answer]] | None:
    """The real pair's greedy answers to its chat prompts (``model.smollm2``: ``train_prompts`` (or the
    ``train_prompts`` given) / ``val_prompts``, ``answer_tokens`` at most, the ``top_logprobs`` largest
    log-probabilities of every answer token), generated when a run first needs them and cached in
    :func:`pair_answers_folder` by prompt: a later run that asks for more prompts generates only the new
    ones. The recipe (``answers.json``, written last, so a cut-off write is regenerated) names what every
    cached answer was made with; another recipe starts the cache afresh (a recipe written before issue 53
    names ``top_logprobs`` ``top_k``: read under the new name, and rewritten so). ``<folder>.lock`` is held
    meanwhile, so runs or ranks started together generate them once; the answers are generated on
    ``device`` (default: the verifier's). None for a pair that is not the real one."""
    build = getattr(model, "smollm2", None)
    if build is None:
        return None
    folder = Path(build.out_dir) / "answers"
    keys = ("answer_tokens", "top_logprobs", "prompt_len", "seed")
    recipe = {**{k: getattr(build, k) for k in keys}, "chat_set": chat_set_fingerprint()}
    counts = {"validation": build.val_prompts, "train": train_prompts or build.train_prompts}
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{os.path.normpath(folder)}.lock"):
        meta_path = folder / "answers.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        fresh = stored_recipe(meta.get("recipe")) != recipe
        folder.mkdir(parents=True, exist_ok=True)
        eos = eos_token_ids(tokenizer, verifier)
        if not eos:
            raise ValueError("neither the verifier's generation config nor the tokenizer names an eos token")
        out: dict[str, list[Answer]] = {}
        for split, count in counts.items():
            path = folder / f"{split}.pt"
            cached = [] if fresh or not path.is_file() else load_answers(str(path))
            prompts = chat_prompt_ids(tokenizer, split, count, build.prompt_len, build.seed)
            out[split] = answers_for(
                prompts, cached, verifier, eos, build, f"the verifier's answers ({split})", device
            )
            if len(out[split]) > len(cached) or fresh:
                meta_path.unlink(missing_ok=True)  # no recipe vouches for the files while they are rewritten
                known = {tuple(a.prompt) for a in out[split]}
                save_answers(out[split] + [a for a in cached if tuple(a.prompt) not in known], str(path))
        tokens = {split: sum(len(a.answer) for a in answers) for split, answers in out.items()}
        meta_path.write_text(json.dumps({"recipe": recipe, "tokens": tokens}, indent=2) + "\n")
    return out


def answers_for(
    prompts: Sequence[Sequence[int]],
    cached: Sequence[Answer],
    verifier: Any,
    eos: list[int],
    build: Any,
    label: str,
    device: torch.device | None = None,
) -> list[Answer]:
    """The answer to each prompt, in order: from ``cached`` when it holds one, else generated now on
    ``device`` (default: where the verifier is)."""
    by_prompt = {tuple(a.prompt): a for a in cached}
    missing = [p for p in prompts if tuple(p) not in by_prompt]
    if missing:
        start = time.perf_counter()
        with Progress(transient=True) as bar:
            task = bar.add_task(label, total=len(missing))
            generated = answer_prompts(
                getattr(build, "answer_engine", "transformers"),
                verifier,
                missing,
                eos,
                build.answer_tokens,
                batch_size=build.answer_batch,
                top_logprobs=build.top_logprobs,
                on_batch=lambda n: bar.advance(task, n),
                device=device,
            )
        by_prompt.update((tuple(a.prompt), a) for a in generated)
        log.info("%s: %d answers generated in %.0f s", label, len(missing), time.perf_counter() - start)
    return [by_prompt[tuple(p)] for p in prompts]
