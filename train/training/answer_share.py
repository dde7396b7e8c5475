"""The verifier's answers generated once for a run, on its accelerator, and shared by its ranks.

A method that trains on the verifier's answers asks for them in ``build()``, before Lightning has a
process group. Without care every rank would generate all of them on the CPU while the first waits at the
rendezvous. Here:

- **where**: :func:`answer_device` is this rank's accelerator (``cuda:<LOCAL_RANK>`` when the trainer
  runs on GPUs), where :func:`~train.models.answers_vllm.answer_prompts` generates them (the verifier
  moved there for the generation only, or kept off it while vLLM's own copy generates);
- **who**: :func:`generate_once`, under a launcher that starts every rank at once (torchrun, srun; read
  through Lightning's own environment classes), gives each rank every ``world``-th prompt; each writes
  its share to a part file, rank 0 merges them in prompt order and writes the cache once, and the others
  wait for that file (the folder must be on a filesystem every node sees, as the run directory is).
  Lightning's own launcher starts the other ranks only at ``fit``: its first process generates all of them
  and the others find the cache. A single process holds ``<folder>.lock``, so runs started together
  generate once;
- **once**: the caller's cache check (``cached``) runs first; a folder whose recipe matches serves every
  later run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from filelock import FileLock
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

from train.models.answers import Answer, load_answers, save_answers
from train.models.loading import one_local_device

log = logging.getLogger(__name__)

__all__ = [
    "answer_device",
    "generate_once",
    "launched_ranks",
    "merge_shares",
    "prompts_digest",
    "recipe_cache",
    "recipe_digest",
    "stored_recipe",
]

#: Recipe fields renamed since caches were written (issue 53), old -> new: the log-probabilities kept per
#: answer token were ``top_k``. A manifest (``answers.json``, ``sampled.json``) is read under the new names,
#: so an answers folder generated before the rename still serves the same recipe.
RENAMED_RECIPE_KEYS = {"top_k": "top_logprobs"}

T = TypeVar("T")

WAIT_SECONDS = 6 * 3600.0
"""How long a rank waits for the others' shares (or for rank 0's merged file) before it gives up."""


def launched_ranks() -> tuple[int, int]:
    """``(rank, world size)`` of a launcher that starts every rank at once (torchrun, srun), as Lightning
    reads them; ``(0, 1)`` otherwise (one process, or Lightning's own launcher before ``fit``)."""
    if TorchElasticEnvironment.detect():
        elastic = TorchElasticEnvironment()
        return elastic.global_rank(), elastic.world_size()
    if SLURMEnvironment.detect():
        slurm = SLURMEnvironment()
        return slurm.global_rank(), slurm.world_size()
    return 0, 1


def answer_device(accelerator: str) -> torch.device:
    """Where this rank generates answers: its own GPU when the trainer's ``accelerator`` runs on GPUs
    (:func:`~train.models.loading.one_local_device`), else the CPU."""
    devices = one_local_device(accelerator)
    return torch.device("cuda", devices[0]) if isinstance(devices, list) else torch.device("cpu")


def merge_shares(shares: Sequence[Sequence[Answer]]) -> list[Answer]:
    """The answers in prompt order from ``shares[r]``, rank r's answers to prompts r, r + world, ..."""
    world = len(shares)
    total = sum(len(s) for s in shares)
    return [shares[i % world][i // world] for i in range(total)]


def prompts_digest(prompts: Sequence[Sequence[int]]) -> str:
    """A short digest of a list of token-id prompts, in order."""
    return hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()[:16]


def stored_recipe(recipe: Any) -> Any:
    """A recipe read from a cache's manifest, its old field names (:data:`RENAMED_RECIPE_KEYS`) read as the
    new ones (a field already under its new name wins); anything but a mapping as it is."""
    if not isinstance(recipe, dict):
        return recipe
    renamed = {k: v for k, v in recipe.items() if k not in RENAMED_RECIPE_KEYS}
    old = {RENAMED_RECIPE_KEYS[k]: v for k, v in recipe.items() if k in RENAMED_RECIPE_KEYS}
    return {**old, **renamed}


def recipe_digest(recipe: dict[str, Any]) -> str:
    """A short digest of a recipe (plain values): a cache folder's name."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def recipe_cache(
    folder: Path, meta_name: str, recipe: dict[str, Any], serves: Callable[[Any, dict[str, Any]], bool]
) -> tuple[Callable[[], list[Answer] | None], Callable[[list[Answer]], None]]:
    """``(cached, save)`` for :func:`generate_once` over ``folder``: ``answers.pt`` and ``meta_name``
    (``{"recipe": ..., "answers": n, "tokens": n}``, written last, so a cut-off write is regenerated);
    ``serves(cached_recipe, recipe)`` says whether a cached recipe serves this one."""
    meta_path, data_path = folder / meta_name, folder / "answers.pt"

    def cached() -> list[Answer] | None:
        if not (meta_path.is_file() and data_path.is_file()):
            return None
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):  # being rewritten by another process
            return None
        return load_answers(str(data_path)) if serves(stored_recipe(meta.get("recipe")), recipe) else None

    def save(answers: list[Answer]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        meta_path.unlink(missing_ok=True)  # no recipe vouches for the answers while they are rewritten
        _write_atomically(answers, data_path)
        tokens = sum(len(a.answer) for a in answers)
        meta = {"recipe": recipe, "answers": len(answers), "tokens": tokens}
        partial = meta_path.with_name(meta_path.name + ".partial")
        partial.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(partial, meta_path)

    return cached, save


def generate_once(
    folder: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    generate: Callable[[list[list[int]], int], list[Answer]],
    cached: Callable[[], list[Answer] | None],
    save: Callable[[list[Answer]], None],
    label: str,
    timeout_s: float | None = None,
    ranks: tuple[int, int] | None = None,
) -> list[Answer]:
    """The answers to ``prompts``: ``cached()`` when the folder already serves them, else generated once.

    ``generate(share, rank)`` answers a list of prompts (``rank`` tells ranks' random streams apart);
    ``save(answers)`` writes the folder's cache so that ``cached()`` serves it. One process: under
    ``<folder>.lock``. Several ranks launched together: each answers ``prompts[rank::world]``, rank 0 merges
    and saves; a rank waits ``timeout_s`` (default :data:`WAIT_SECONDS`) at most, then raises naming what
    it waited for. ``ranks``: ``(rank, world)``, default :func:`launched_ranks`."""
    root = Path(folder)
    root.parent.mkdir(parents=True, exist_ok=True)
    timeout_s = WAIT_SECONDS if timeout_s is None else timeout_s
    rank, world = ranks or launched_ranks()
    if world == 1:
        with FileLock(f"{os.path.normpath(root)}.lock"):
            hit = cached()
            if hit is not None:
                return hit
            out = generate([list(p) for p in prompts], 0)
            save(out)
            return out
    hit = cached()
    if hit is not None:
        return hit
    parts = root / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    mine = generate([list(p) for p in prompts[rank::world]], rank)
    _write_atomically(mine, parts / f"{rank}-of-{world}.pt")
    log.info("%s: rank %d answered %d of %d prompts", label, rank, len(mine), len(prompts))
    if rank != 0:
        return _wait_for(cached, f"{label}: rank 0's merged answers in {root}", timeout_s)
    paths = [parts / f"{r}-of-{world}.pt" for r in range(world)]
    _wait_for(
        lambda: all(p.is_file() for p in paths) or None, f"{label}: every rank's share in {parts}", timeout_s
    )
    merged = merge_shares([load_answers(str(p)) for p in paths])
    save(merged)
    for path in paths:
        path.unlink(missing_ok=True)
    return merged


def _write_atomically(answers: Sequence[Answer], path: Path) -> None:
    partial = path.with_name(path.name + ".partial")
    save_answers(answers, str(partial))
    os.replace(partial, path)


def _wait_for(ready: Callable[[], T | None], what: str, timeout_s: float, poll_s: float = 2.0) -> T:
    deadline = time.monotonic() + timeout_s
    while (value := ready()) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}: did another rank fail?")
        time.sleep(poll_s)
    return value
