"""The verifier's answers generated once, on the run's accelerator, split across the ranks launched together
(issue 43, item 1): train/training/answer_share.py and its callers in answer_data.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_llama
from train.models.answers import Answer
from train.models.loading import on_device
from train.training import answer_share
from train.training import answer_sources as answer_data
from train.training.answer_share import (
    answer_device,
    generate_once,
    launched_ranks,
    merge_shares,
    recipe_cache,
)
from train.training.answer_sources import greedy_answers, sampled_answers


def _answer(prompt: list[int], tag: int = 0) -> Answer:
    return Answer(
        prompt,
        [tag, *prompt],
        torch.zeros(len(prompt) + 1, 1, dtype=torch.int32),
        torch.zeros(len(prompt) + 1, 1),
    )


class _Counted:
    """A fake ``generate(share, rank)`` that answers each prompt with its rank as the first token."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[list[int]]]] = []
        self.lock = threading.Lock()

    def __call__(self, share: list[list[int]], rank: int) -> list[Answer]:
        with self.lock:
            self.calls.append((rank, share))
        return [_answer(p, rank) for p in share]


PROMPTS = [[i, i + 1] for i in range(7)]


def test_shares_merge_back_into_prompt_order() -> None:
    shares = [[_answer(p) for p in PROMPTS[r::3]] for r in range(3)]
    assert [a.prompt for a in merge_shares(shares)] == PROMPTS


def test_one_process_generates_once_and_the_next_run_reads_the_cache(tmp_path: Path) -> None:
    generate = _Counted()
    cached, save = recipe_cache(tmp_path / "a", "answers.json", {"k": 1}, lambda have, want: have == want)
    first = generate_once(tmp_path / "a", PROMPTS, generate, cached, save, "answers", ranks=(0, 1))
    again = generate_once(tmp_path / "a", PROMPTS, generate, cached, save, "answers", ranks=(0, 1))
    assert len(generate.calls) == 1 and [a.prompt for a in again] == [a.prompt for a in first] == PROMPTS
    other, save_other = recipe_cache(
        tmp_path / "a", "answers.json", {"k": 2}, lambda have, want: have == want
    )
    generate_once(tmp_path / "a", PROMPTS, generate, other, save_other, "answers", ranks=(0, 1))
    assert len(generate.calls) == 2  # another recipe is generated afresh


def test_ranks_launched_together_each_answer_their_share_and_read_one_merged_cache(tmp_path: Path) -> None:
    """Three ranks (threads here, as torchrun's processes would be): each answers every third prompt,
    rank 0 merges them in prompt order and writes the cache once, every rank returns the same answers."""
    generate, world = _Counted(), 3
    results: dict[int, list[Answer]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            cached, save = recipe_cache(
                tmp_path / "c", "answers.json", {"k": 1}, lambda have, want: have == want
            )
            results[r] = generate_once(
                tmp_path / "c", PROMPTS, generate, cached, save, "answers", timeout_s=60, ranks=(r, world)
            )
        except BaseException as err:  # surfaced by the main thread
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(r for r, _ in generate.calls) == [0, 1, 2]  # every rank answered once
    assert {r: share for r, share in generate.calls} == {r: PROMPTS[r::world] for r in range(world)}
    for r in range(world):
        assert [a.prompt for a in results[r]] == PROMPTS
        assert [a.answer[0] for a in results[r]] == [i % world for i in range(len(PROMPTS))]
    assert not list((tmp_path / "c" / "parts").glob("*.pt"))  # the shares are gone once merged
    # a later run (any world size) reads the merged cache and generates nothing
    cached, save = recipe_cache(tmp_path / "c", "answers.json", {"k": 1}, lambda have, want: have == want)
    generate_once(tmp_path / "c", PROMPTS, generate, cached, save, "answers", ranks=(0, 2))
    assert len(generate.calls) == world


def test_a_rank_that_waits_for_a_missing_share_says_what_it_waited_for(tmp_path: Path) -> None:
    cached, save = recipe_cache(tmp_path / "d", "answers.json", {"k": 1}, lambda have, want: have == want)
    with pytest.raises(TimeoutError, match=r"every rank's share .*another rank fail"):
        generate_once(
            tmp_path / "d", PROMPTS, _Counted(), cached, save, "answers", timeout_s=0.1, ranks=(0, 2)
        )


def test_launched_ranks_read_torchrun_and_srun_and_default_to_one_process(monkeypatch) -> None:
    for var in (
        "TORCHELASTIC_RUN_ID",
        "RANK",
        "WORLD_SIZE",
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_JOB_NAME",
    ):
        monkeypatch.delenv(var, raising=False)
    assert launched_ranks() == (0, 1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert launched_ranks() == (3, 8)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert launched_ranks() == (2, 4)
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # Lightning's rule: not an srun launch
    assert launched_ranks() == (0, 1)


def test_answers_are_generated_on_this_ranks_gpu(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert answer_device("gpu") == torch.device("cuda", 2)
    assert answer_device("auto") == torch.device("cuda", 2)
    assert answer_device("cpu") == torch.device("cpu")


class _Recorded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.moves: list[str] = []

    def to(self, *args, **kwargs):  # type: ignore[override]
        self.moves.append(str(args[0]))
        return self


def test_the_verifier_visits_the_answer_device_and_comes_back(monkeypatch) -> None:
    model = _Recorded()
    with on_device(model, torch.device("cuda", 1)):
        assert model.moves == ["cuda:1"]
    assert model.moves == ["cuda:1", "cpu"]
    with on_device(model, torch.device("cpu")):
        pass
    assert model.moves == ["cuda:1", "cpu"]  # already there: not moved


def test_greedy_answers_are_cached_by_verifier_and_prompts(tmp_path: Path, monkeypatch) -> None:
    """On today's code before this change every call (every rank, every run) generated them again."""
    verifier = tiny_llama(hidden=32, seed=0)
    calls = []
    real = answer_data.answer_prompts

    def counted(*args, **kwargs):
        calls.append(len(args[2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(answer_data, "answer_prompts", counted)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    first = greedy_answers(verifier, [257], prompts, 4, 2, cache_dir=tmp_path)
    again = greedy_answers(verifier, [257], prompts, 4, 2, cache_dir=tmp_path)
    assert calls == [3] and [a.answer for a in again] == [a.answer for a in first]
    other = tiny_llama(hidden=32, seed=1)  # another verifier: its own answers
    greedy_answers(other, [257], prompts, 4, 2, cache_dir=tmp_path)
    greedy_answers(verifier, [257], prompts[:2], 4, 2, cache_dir=tmp_path)  # other prompts
    assert calls == [3, 3, 2]
    assert len(list(tmp_path.glob("greedy-*/answers.pt"))) == 3


def test_sampled_answers_split_across_ranks_use_each_ranks_own_seed(tmp_path: Path, monkeypatch) -> None:
    seeds = []
    monkeypatch.setattr(answer_share, "launched_ranks", lambda: (1, 2))
    monkeypatch.setattr(
        answer_data, "answer_prompts", lambda *a, seed, **k: seeds.append(seed) or [_answer(p) for p in a[2]]
    )
    # rank 1 of 2: answers its share, then waits for rank 0's merge (which never comes here)
    monkeypatch.setattr(answer_share, "WAIT_SECONDS", 0.1)
    with pytest.raises(TimeoutError, match="rank 0's merged answers"):
        sampled_answers(
            tiny_llama(hidden=32), [257], [[1, 2], [3, 4]], 2, 1.0, 4, 2, seed=5, folder=tmp_path / "s"
        )
    assert seeds == [6]
    assert (tmp_path / "s" / "parts" / "1-of-2.pt").is_file()
