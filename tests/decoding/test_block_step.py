"""The block step both schedules share (train/decoding/block_step.py): what a verdict commits (EOS, the
token budget), what a block records, and that both loops go through it: broken on purpose once, both
loops' EOS checks fail."""

from __future__ import annotations

import pytest
import torch

import train.decoding.block_step as block_step
from train.decoding import SpeculativeDecoder
from train.decoding.block_step import Settled, committed_tokens, record_verdict
from train.decoding.draft import Draft
from train.decoding.metrics import DecodeStats
from train.decoding.rules.verdict import Verdict

from .decoding_helpers import TableLM, overlapped
from .test_decoding_greedy import chain_table

EOS = 1


@pytest.mark.parametrize(
    "path,next_token,room,expected",
    [
        ([0, 1], 7, 10, Settled([4, 5, 7], False)),  # the path, then the verifier's token
        ([0, 1], EOS, 10, Settled([4, 5, EOS], True)),  # an EOS as the verifier's token ends it
        ([0, 1, 2], 7, 10, Settled([4, 5, EOS], True)),  # an accepted EOS: no bonus token after it
        ([0, 1, 2], None, 10, Settled([4, 5, EOS], True)),  # the tree walk drew none there
        ([0, 1], 7, 2, Settled([4, 5], True)),  # the budget cuts the block
        ([0, 1], 7, 3, Settled([4, 5, 7], True)),  # ... exactly at its end
        ([], 7, 1, Settled([7], True)),
    ],
)
def test_committed_tokens(path, next_token, room, expected):
    draft = Draft.chain([4, 5, EOS])
    verdict = Verdict(path, next_token, len(path), 0.0)
    assert committed_tokens(draft, verdict, frozenset({EOS}), room) == expected


def test_record_verdict_counts_a_chain_and_a_tree():
    stats = DecodeStats(max_draft=3)
    record_verdict(stats, Draft.chain([4, 5, 6]), Verdict([0], 9, 2, 1.5))
    assert (stats.drafted, stats.accepted, stats.tested, stats.discarded, stats.rollbacks) == (3, 1, 2, 1, 1)
    assert stats.sum_expected_acceptance == 1.5 and stats.position_tested == [1, 1, 0]
    tree = Draft([4, 5, 6, 7], [-1, -1, 0, 2], None, [0, 1, 0, 0])  # depth 3: 4 nodes, a path of 2
    stats = DecodeStats(max_draft=3)
    record_verdict(stats, tree, Verdict([0, 2], 9, 3, 2.0))
    assert (stats.drafted, stats.accepted, stats.discarded, stats.rollbacks) == (3, 2, 2, 1)
    record_verdict(stats, Draft(), Verdict([], 9, 0, 0.0))  # a plain step records nothing
    assert stats.drafted == 3


def test_both_loops_commit_through_the_block_step(monkeypatch):
    """Broken on purpose: a block step that keeps the token after an accepted EOS. The synchronous and the
    asynchronous loop both emit it (each commits through the one step), so their EOS checks see it."""
    table = chain_table(8, [5, 2, 3, EOS, 4])
    decoders = {
        "sync": SpeculativeDecoder(TableLM(table), TableLM(table), gamma=6),
        "async": overlapped(TableLM(table), TableLM(table), gamma=6, idle="wait"),
    }
    for decoder in decoders.values():
        assert decoder.generate(torch.tensor([[5]]), 20, eos_token_id=EOS).tokens.tolist() == [2, 3, EOS]

    def no_eos_cut(draft, verdict, eos, room):
        tokens = [draft.tokens[i] for i in verdict.path] + ([] if verdict.next is None else [verdict.next])
        return Settled(tokens[:room], len(tokens) >= room)

    monkeypatch.setattr(block_step, "committed_tokens", no_eos_cut)
    for name, decoder in decoders.items():
        out = decoder.generate(torch.tensor([[5]]), 20, eos_token_id=EOS).tokens.tolist()
        assert out[:3] == [2, 3, EOS] and len(out) > 3, name
