"""Exact resume and whole validations under DDP (issue 43, item 10): two gloo processes on the CPU. An
answer cache's checkpoint state carries every rank's answers (Lightning writes rank 0's checkpoint,
every rank loads it); validation sums are added over the ranks, not rank 0's alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.fsdp import gloo_rank, run_ranks
from train.training.across_ranks import merged_over_ranks, summed_over_ranks
from train.training.answer_cache import AnswerCache

TIMEOUT_S = 120


def _worker(rank: int, out: str) -> None:
    with gloo_rank(rank, 2, out):
        sums = summed_over_ranks({"tokens": 10.0 * (rank + 1), f"seen_on_{rank}": 1.0})
        merged = merged_over_ranks({f"row{rank}": rank, "shared": rank})
        cache = AnswerCache(generate=None, pad_token_id=0)  # type: ignore[arg-type]
        cache.add([1, 2, rank], [7, rank])
        state = cache.state()
        restored = AnswerCache(generate=None, pad_token_id=0)  # type: ignore[arg-type]
        restored.load(state)
        outcome = {
            "sums": sums,
            "merged": merged,
            "answers": sorted(torch.tensor(list(c)).tolist() for c in restored.answers.values()),
        }
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.slow
def test_sums_and_caches_are_made_whole_over_the_ranks(tmp_path: Path) -> None:
    run_ranks(_worker, tmp_path, timeout_s=TIMEOUT_S)
    for rank in (0, 1):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["sums"] == {"tokens": 30.0, "seen_on_0": 1.0, "seen_on_1": 1.0}
        assert outcome["merged"] == {"row0": 0, "row1": 1, "shared": 0}  # the lowest rank's value wins
        assert outcome["answers"] == [[7, 0], [7, 1]]  # rank 0's checkpoint holds rank 1's answer too


def test_in_one_process_everything_is_as_it_was() -> None:
    assert summed_over_ranks({"a": 2.0}) == {"a": 2.0}
    assert merged_over_ranks({"k": 1}) == {"k": 1}
