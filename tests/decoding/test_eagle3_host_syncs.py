"""EAGLE-2 tree drafting and the training-time test read the device a fixed number of times, not once
per row and child (issue 43, item 6). On the CPU a host sync is a tensor turned into Python numbers
(``int``, ``float``, ``bool``, ``.item()``, ``.tolist()``): each is a device round trip on a GPU, so
they are counted here; the outputs stay those the greedy-equality tests check."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from train.decoding import Eagle3Decoder
from train.decoding.proposers.eagle3_proposer import Eagle3Proposer
from train.decoding.proposers.eagle3_tree import node_mask
from train.models.eagle3_ttt import ttt_loss

from .test_eagle3_decoding import PROMPTS, drafter_for

SYNCS = ("__int__", "__float__", "__bool__", "__index__", "item", "tolist")


@contextmanager
def counted(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...] = SYNCS) -> Iterator[Counter[str]]:
    """Inside, every call of a ``torch.Tensor`` method in ``names`` is counted (by name)."""
    calls: Counter[str] = Counter()
    with monkeypatch.context() as patch:
        for name in names:
            original = getattr(torch.Tensor, name)

            def wrapper(self, *args, _original=original, _name=name, **kwargs):
                calls[_name] += 1
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, functools.wraps(original)(wrapper))
        yield calls


def test_an_eagle2_tree_reads_the_device_once_per_level(eagle3_verifiers, monkeypatch):
    """depth 5, branching 8: the old per-row, per-child ``int``/``float`` made about 2 x 8 x 8 reads a
    level."""
    depth, branching = 5, 8
    per_draft: list[int] = []
    grow = Eagle3Proposer._grow

    def counting_grow(self, *args, **kwargs):
        with counted(monkeypatch) as calls:
            result = grow(self, *args, **kwargs)
        per_draft.append(sum(calls.values()))
        return result

    monkeypatch.setattr(Eagle3Proposer, "_grow", counting_grow)
    verifier = eagle3_verifiers["llama"]
    Eagle3Decoder(verifier, drafter_for(verifier), depth, branching, 32).generate(
        torch.tensor([PROMPTS[0]]), 12
    )
    assert per_draft
    # the root's top-k (2), each deeper level's children (2 a level), the kept nodes' target ids (1)
    assert max(per_draft) <= 2 + 2 * (depth - 1) + 1, per_draft


def test_node_mask_is_written_on_the_host_and_copied_once(monkeypatch):
    seen = [[0], [0, 1], [2], [2, 3], [0, 1, 4], [5]]
    expected = torch.zeros(1, 1, len(seen), 3 + 6, dtype=torch.bool)
    expected[..., :3] = True
    for row, slots in enumerate(seen):
        for j in slots:
            expected[0, 0, row, 3 + j] = True
    with counted(monkeypatch, ("__setitem__",)) as writes:
        mask = node_mask(3, 6, seen, torch.device("cpu"))
    assert torch.equal(mask, expected)
    assert writes["__setitem__"] <= 2  # the committed columns, then every node's slots at once


def test_the_ttt_loss_asks_the_device_nothing_per_step(monkeypatch):
    """The old early exit (``bool(kept.any())``) and count (``int(kept.sum())``) read it twice a step."""
    torch.manual_seed(0)
    from tests.models.test_eagle3 import llama_verifier

    verifier = llama_verifier()
    drafter = drafter_for(verifier, seed=3)
    ids = torch.randint(0, verifier.config.vocab_size, (2, 12))
    with torch.no_grad():
        out = verifier(ids, output_hidden_states=True)
    aux = torch.cat(drafter.aux_features(out.hidden_states), dim=-1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1] = False  # a row with no target: its steps keep nothing
    with counted(monkeypatch) as calls:
        result = ttt_loss(drafter, aux, ids, out.logits, mask, steps=4, chain_stats=False)
    assert sum(calls.values()) == 0, calls
    assert len(result.counts) == 4 and all(int(n) >= 0 for n in result.counts)
    with counted(monkeypatch) as calls:
        nothing_kept = ttt_loss(drafter, aux, ids, out.logits, torch.zeros_like(mask), steps=2)
    assert sum(calls.values()) == 0, calls
    assert [float(x) for x in nothing_kept.losses] == [0.0, 0.0]  # as before: no NaN from 0 / 0
    assert [int(n) for n in nothing_kept.counts] == [0, 0]
