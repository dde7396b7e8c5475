"""Where a method's training answers come from: a folder, the real pair's own answers, or the verifier's
greedy and sampled answers generated for the run, on its accelerator, split across its ranks and cached
(:mod:`train.training.answer_share`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from train.data.lm import make_prompts
from train.data.sources import load_text_dataset
from train.models.answers import Answer
from train.models.answers_vllm import answer_prompts
from train.models.fingerprint import verifier_fingerprint
from train.renames import renamed_keywords
from train.training.answer_data import answer_eos_ids, cached_answers
from train.training.answer_share import (
    answer_device,
    generate_once,
    prompts_digest,
    recipe_cache,
    recipe_digest,
)
from train.training.pair_answers import pair_answers

log = logging.getLogger(__name__)

__all__ = [
    "answers_cache_dir",
    "answered_on",
    "generated_answers",
    "greedy_answers",
    "method_answers",
    "pair_answers_folder",
    "run_answers",
    "sampled_answers",
]


def answered_on(
    device: torch.device | None,
    verifier: Any,
    label: str,
    engine: str,
    prompts: list[list[int]],
    eos: Sequence[int],
    answer_tokens: int,
    **settings: Any,
) -> list[Answer]:
    """:func:`~train.models.answers_vllm.answer_prompts` on ``device`` (default: where the verifier is),
    with a transient progress bar named ``label``."""
    with Progress(transient=True) as bar:
        task = bar.add_task(label, total=len(prompts))
        return answer_prompts(
            engine,
            verifier,
            prompts,
            eos,
            answer_tokens,
            on_batch=lambda n: bar.advance(task, n),
            device=device,
            **settings,
        )


def method_answers(cfg: Any, pair: Any, spec: Any, prompt_len: int) -> dict[str, list[Answer]]:
    """:func:`run_answers` for a method's settings ``cfg`` (its ``answers``, ``num_prompts``,
    ``num_val_prompts``, ``answer_tokens``, ``answer_batch`` and ``answer_engine``), prompts of
    ``prompt_len`` tokens."""
    counts = {"train": cfg.num_prompts, "validation": cfg.num_val_prompts}
    return run_answers(
        cfg.answers, pair, spec, counts, prompt_len, cfg.answer_tokens, cfg.answer_batch, cfg.answer_engine
    )


def generated_answers(
    pair: Any,
    spec: Any,
    counts: dict[str, int],
    prompt_len: int,
    answer_tokens: int,
    batch_size: int,
    engine: str = "transformers",
) -> dict[str, list[Answer]]:
    """The verifier's greedy answers (``answer_tokens`` at most) to ``counts[split]`` prompts of each
    split of the run's data (``spec.data``, cut with ``spec.seed``), each prompt at most ``prompt_len``
    tokens; generated once (:func:`greedy_answers`), cached under :func:`answers_cache_dir` and on the
    run's accelerator."""
    verifier, tokenizer = pair.verifier, pair.tokenizer
    splits = load_text_dataset(spec.data, tokenizer)
    eos = answer_eos_ids(verifier, tokenizer)
    cache_dir, device = answers_cache_dir(spec), answer_device(spec.trainer.accelerator)
    out: dict[str, list[Answer]] = {}
    for split, count in counts.items():
        prompts = make_prompts(splits[split], tokenizer, prompt_len, count, spec.seed, continuation_len=0)
        rows = [list(ids) for ids in prompts["input_ids"]]
        out[split] = greedy_answers(
            verifier, eos, rows, answer_tokens, batch_size, engine, cache_dir, device, f"answers ({split})"
        )
    return out


# more than 8 parameters: the recipe its cache key holds (verifier, eos, prompts, answer_tokens), then how
# and where they are generated (batch, engine, cache folder, device, progress label)
def greedy_answers(
    verifier: Any,
    eos: Sequence[int],
    prompts: Sequence[Sequence[int]],
    answer_tokens: int,
    batch_size: int,
    engine: str = "transformers",
    cache_dir: str | os.PathLike[str] | None = None,
    device: torch.device | None = None,
    label: str = "answers",
) -> list[Answer]:
    """The verifier's greedy answer to each prompt (``answer_tokens`` at most). With a ``cache_dir`` they
    are generated once, on ``device`` (:func:`~train.training.answer_share.generate_once`: split across
    the ranks of a run) and cached under ``<cache_dir>/greedy-<recipe digest>``, keyed by the verifier's
    weights, the prompts and the settings; a later run with the same recipe reads them."""

    def generate(share: list[list[int]], rank: int) -> list[Answer]:
        return answered_on(
            device, verifier, label, engine, share, eos, answer_tokens, batch_size=batch_size, top_logprobs=1
        )

    if cache_dir is None:
        return generate([list(p) for p in prompts], 0)
    recipe = {
        "kind": "greedy",
        "verifier": verifier_fingerprint(verifier),
        "prompts": prompts_digest(prompts),
        "answer_tokens": answer_tokens,
        "eos": [int(i) for i in eos],
    }
    folder = Path(cache_dir) / f"greedy-{recipe_digest(recipe)}"
    cached, save = recipe_cache(folder, "answers.json", recipe, lambda have, want: have == want)
    return generate_once(folder, prompts, generate, cached, save, label)


def pair_answers_folder(model: Any) -> str | None:
    """Where the pair of a model config keeps the verifier's answers: the real pair's under
    ``<model.smollm2.out_dir>/answers`` (:func:`pair_answers`); None for a pair that has none (the tiny
    pair, a Hub pair)."""
    build = getattr(model, "smollm2", None)
    return None if build is None else str(Path(build.out_dir) / "answers")


def answers_cache_dir(spec: Any) -> str:
    """Where a run caches the answers it generates: ``<paths.checkpoints_dir>/answers``."""
    return str(Path(spec.paths.checkpoints_dir) / "answers")


def run_answers(
    source: str | None,
    pair: Any,
    spec: Any,
    counts: dict[str, int],
    prompt_len: int,
    answer_tokens: int,
    answer_batch: int,
    engine: str = "transformers",
) -> dict[str, list[Answer]]:
    """A method's training answers from its ``method.answers`` setting ``source``: a folder (cached, all
    used); ``"pair"``: the real pair's own (:func:`pair_answers`, generated on first use), generated like
    None for another pair; None: ``counts[split]`` answers generated greedily from the run's data, on the
    run's accelerator, split across its ranks and cached (:func:`greedy_answers`)."""
    if source == "pair":
        own = pair_answers(
            spec.model, pair.verifier, pair.tokenizer, device=answer_device(spec.trainer.accelerator)
        )
        if own is not None:
            return own
    elif source is not None:
        return cached_answers(source)
    return generated_answers(pair, spec, counts, prompt_len, answer_tokens, answer_batch, engine)


# more than 8 parameters: the recipe its cache key holds (verifier, eos, prompts, per_prompt, temperature,
# answer_tokens, seed, top_logprobs), then where they are generated (batch, folder, engine, device)
@renamed_keywords(top_k="top_logprobs")
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
    top_logprobs: int = 1,
    engine: str = "transformers",
    device: torch.device | None = None,
) -> list[Answer]:
    """``per_prompt`` answers to each prompt sampled from the verifier at ``temperature`` (full
    distribution, ``answer_tokens`` at most), with its ``top_logprobs`` most likely tokens at each answer
    token, generated once: with a ``folder`` they are cached there (``answers.pt``, and ``sampled.json``
    whose recipe names the prompts by hash) and reused while the recipe holds (a cache keeping more than
    ``top_logprobs`` serves too: the real pair's build keeps 16 for its drafter, EAGLE-3 reads the same
    answers); a new recipe regenerates them. They are generated on ``device`` (default: the verifier's),
    split across the ranks of a run launched together (each rank samples its share with its own seed;
    :func:`~train.training.answer_share.generate_once`). [] for ``per_prompt`` 0."""
    if per_prompt <= 0 or not prompts:
        return []
    recipe = {
        "prompts": prompts_digest(prompts),
        "per_prompt": per_prompt,
        "temperature": temperature,
        "answer_tokens": answer_tokens,
        "seed": seed,
        "verifier": str(getattr(verifier.config, "_name_or_path", "")),
        "top_logprobs": top_logprobs,
        "eos": [int(i) for i in eos],
    }
    rows = [list(p) for p in prompts for _ in range(per_prompt)]

    def generate(share: list[list[int]], rank: int) -> list[Answer]:
        start = time.perf_counter()
        label = f"sampled answers (T = {temperature:g})"
        kwargs = {
            "batch_size": batch_size,
            "top_logprobs": top_logprobs,
            "temperature": temperature,
            "seed": seed + rank,
        }
        out = answered_on(device, verifier, label, engine, share, eos, answer_tokens, **kwargs)
        tokens = sum(len(a.answer) for a in out)
        log.info("sampled answers: %d (%d tokens) in %.0f s", len(out), tokens, time.perf_counter() - start)
        return out

    if folder is None:
        return generate(rows, 0)
    cached, save = recipe_cache(Path(folder), "sampled.json", recipe, _serves)
    return generate_once(folder, rows, generate, cached, save, "sampled answers")


def _serves(cached: Any, wanted: dict[str, Any]) -> bool:
    """Whether sampled answers cached under recipe ``cached`` serve ``wanted``: the same recipe, keeping
    at least as many top tokens (a recipe from before ``top_logprobs`` was recorded kept 1; one written
    before issue 53 names it ``top_k``, read as ``top_logprobs`` by
    :func:`~train.training.answer_share.stored_recipe`). A recipe from before the stop tokens were
    recorded (2026-11-29) serves any: every run then stopped at its tokenizer's eos."""
    if not isinstance(cached, dict):
        return False
    loose = ("top_logprobs",) if "eos" in cached else ("top_logprobs", "eos")
    kept = int(cached.get("top_logprobs", 1))
    same = {k: v for k, v in cached.items() if k not in loose} == {
        k: v for k, v in wanted.items() if k not in loose
    }
    return same and kept >= int(wanted["top_logprobs"])
