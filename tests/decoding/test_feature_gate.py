"""The plain-step gate on the decoders whose drafter reads the verifier's hidden states: EAGLE-3, DFlash and
prediction heads (``plain_steps="auto"``), and the timing of their drafter forward
(train/decoding/proposers/step_probe.py).

Skipped blocks must leave the drafter's state right: after plain steps, a drafted block's drafter state is
what a cache-free forward over the whole sequence gives (EAGLE-3's root logits, DFlash's block logits, the
heads' last hidden state), and the greedy output is the verifier's. Where drafting does not pay (a random
drafter on steep checks) the decoders stop drafting bar the probes. The exact output law at T = 1 while
the gate switches (slow, DFlash's chain). Broken on purpose: a proposer that drops the states of plain
steps fails the state checks; a gate that decides on the block's draw fails the law test.
"""

from __future__ import annotations

import time

import pytest
import torch

import train.decoding.cost_probe as cost_probe
import train.decoding.proposers.gated_proposer as gated
from train.decoding import DFlashDecoder, Eagle3Decoder, HeadsDecoder, SamplingParams
from train.decoding.costs import StepCosts
from train.decoding.draft_gate import DraftGate
from train.decoding.proposers.eagle3_proposer import Eagle3Proposer
from train.decoding.proposers.heads_proposer import HeadsProposer
from train.decoding.proposers.step_probe import proposer_step_seconds

from . import test_dflash_decoding as dflash_tests
from . import test_eagle3_decoding as eagle3_tests
from .decoding_helpers import hf_greedy
from .test_draft_gate import STEEP, _DecidesAfterTheDraw
from .test_heads_decoding import random_heads

PROMPT = [3, 17, 42, 8, 99, 23, 5]
#: drafting that cannot lose: a check of any size costs one step, the drafter nothing
FREE = StepCosts(verify=(1.0,) * 12, draft=0.0)


def _drafting_every(period: int, monkeypatch) -> None:
    """The gate drafts at its 1st, (period + 1)th, ... decision and takes plain steps between (its counter
    per decoder, running on across generations)."""
    counts: dict[int, int] = {}

    def should_draft(self, regime):
        counts[id(self)] = counts.get(id(self), -1) + 1
        return counts[id(self)] % period == 0

    monkeypatch.setattr(DraftGate, "should_draft", should_draft)


@pytest.fixture
def every_third_block(monkeypatch):
    _drafting_every(3, monkeypatch)


@pytest.fixture
def every_other_block(monkeypatch):
    _drafting_every(2, monkeypatch)


def _eagle3(verifier, **kw):
    return Eagle3Decoder(verifier, eagle3_tests.drafter_for(verifier, "reduced"), 4, 3, 10, **kw)


def _dflash(verifier, **kw):
    return DFlashDecoder(verifier, dflash_tests.drafter_for(verifier, "reduced", block_size=5), **kw)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0)], ids=["T0", "T1"])
def test_eagle3_behind_the_gate_keeps_its_cache_through_plain_steps(
    params, eagle3_verifiers, monkeypatch, every_third_block
):
    verifier = eagle3_verifiers["llama"]
    spy = eagle3_tests.Spy(monkeypatch)
    decoder = _eagle3(verifier, plain_steps="auto", costs=STEEP)
    out = decoder.generate(torch.tensor([PROMPT]), 24, params, generator=torch.Generator().manual_seed(0))
    assert out.stats.verifier_calls > 2 * len(spy.records) >= 8  # plain steps between the drafted blocks
    eagle3_tests.check_drafter_state(verifier, decoder.drafter, spy)
    if params.greedy:
        assert out.tokens.tolist() == hf_greedy(verifier, torch.tensor([PROMPT]), 24)


def test_dflash_behind_the_gate_keeps_its_context_through_plain_steps(
    eagle3_verifiers, monkeypatch, every_third_block
):
    verifier = eagle3_verifiers["qwen3"]
    spy = dflash_tests.Spy(monkeypatch)
    decoder = _dflash(verifier, plain_steps="auto", costs=STEEP)
    out = decoder.generate(torch.tensor([PROMPT]), 24)
    assert out.tokens.tolist() == hf_greedy(verifier, torch.tensor([PROMPT]), 24)
    assert out.stats.verifier_calls > 2 * len(spy.records) >= 8
    for sequence, draft, context in spy.records:
        assert context == len(sequence) - 1
        want = dflash_tests.reference_block_logits(verifier, decoder.drafter, sequence)
        assert draft.tokens == decoder.drafter.draft_ids[want.argmax(-1)].tolist()[: len(draft.tokens)]


def _heads_hidden_spy(monkeypatch) -> list[tuple[list[int], torch.Tensor]]:
    """(sequence, the hidden state the heads read) at every draft."""
    records: list[tuple[list[int], torch.Tensor]] = []
    propose = HeadsProposer.propose

    def spy(self, sequence, *args):
        if self._hidden is not None:  # none before the prefill
            records.append((list(sequence), self._hidden.clone()))
        return propose(self, sequence, *args)

    monkeypatch.setattr(HeadsProposer, "propose", spy)
    return records


def _check_heads_read_the_last_state(verifier, records) -> None:
    assert records
    for sequence, hidden in records:
        with torch.no_grad():
            states = verifier(torch.tensor([sequence[:-1]]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(hidden, states[-1][0, -1], atol=1e-4, rtol=1e-4)


def test_heads_behind_the_gate_read_the_last_committed_state(tiny_pairs, monkeypatch, every_third_block):
    verifier, _ = tiny_pairs["llama"]
    records = _heads_hidden_spy(monkeypatch)
    decoder = HeadsDecoder(verifier, random_heads(verifier), plain_steps="auto", costs=STEEP)
    out = decoder.generate(torch.tensor([PROMPT]), 30)
    assert out.tokens.tolist() == hf_greedy(verifier, torch.tensor([PROMPT]), 30)
    assert out.stats.verifier_calls > 2 * len(records) >= 8
    _check_heads_read_the_last_state(verifier, records)


def test_a_proposer_that_misses_plain_steps_states_is_caught(tiny_pairs, monkeypatch, every_third_block):
    """Broken on purpose: the heads keep the state of their last drafted block (observe ignored after
    a plain step), so they draft from a stale position; the state check fails."""
    verifier, _ = tiny_pairs["llama"]
    records = _heads_hidden_spy(monkeypatch)
    observe = HeadsProposer.observe

    def stale(self, states):
        if self._hidden is None or getattr(self, "_drafted", True):
            observe(self, states)
        self._drafted = False

    propose = HeadsProposer.propose

    def marking(self, sequence, *args):
        self._drafted = True
        return propose(self, sequence, *args)

    monkeypatch.setattr(HeadsProposer, "observe", stale)
    monkeypatch.setattr(HeadsProposer, "propose", marking)
    HeadsDecoder(verifier, random_heads(verifier), plain_steps="auto", costs=STEEP).generate(
        torch.tensor([PROMPT]), 30
    )
    with pytest.raises(AssertionError):
        _check_heads_read_the_last_state(verifier, records)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dflash_cost", "heads"])
def test_feature_drafters_that_do_not_pay_become_plain_steps(kind, eagle3_verifiers, tiny_pairs):
    """A random drafter on steep checks: after the warm-up (the first generation) it stops drafting bar
    the probes; where a check of any size costs one step and the drafter nothing it drafts every block.
    Greedy output unchanged."""
    verifier = tiny_pairs["llama"][0] if kind == "heads" else eagle3_verifiers["llama"]
    build = {
        "eagle3": _eagle3,
        "dflash": _dflash,
        # cut by cost as well: the cut chooses the drafts a block checks, the gate whether the forward runs
        "dflash_cost": lambda v, **kw: _dflash(v, draft_length="cost", **kw),
        "heads": lambda v, **kw: HeadsDecoder(v, random_heads(v), **kw),
    }[kind]
    ids = torch.tensor([PROMPT])
    ref = hf_greedy(verifier, ids, 60)
    steep = build(verifier, plain_steps="auto", costs=STEEP)
    assert steep.generate(ids, 60).tokens.tolist() == ref  # the warm-up
    gated = steep.generate(ids, 60)
    never = build(verifier, costs=STEEP).generate(ids, 60)
    assert gated.tokens.tolist() == ref == never.tokens.tolist()
    assert gated.stats.drafter_calls < never.stats.drafter_calls / 3, (gated.stats, never.stats)
    flat = build(verifier, plain_steps="auto", costs=FREE)
    flat.generate(ids, 60)
    drafted = flat.generate(ids, 60)
    assert drafted.tokens.tolist() == ref
    assert drafted.stats.drafter_calls >= never.stats.drafter_calls * 0.9, (drafted.stats, never.stats)


def test_bad_gate_settings_raise(eagle3_verifiers):
    verifier = eagle3_verifiers["llama"]
    with pytest.raises(ValueError, match="plain_steps"):
        _eagle3(verifier, plain_steps="sometimes")


class _SlowHeads(torch.nn.Module):
    """Heads that take 20 ms a forward (a stand-in for a drafter of known cost)."""

    def __init__(self, heads: torch.nn.Module) -> None:
        super().__init__()
        self.inner = heads
        self.num_heads = heads.num_heads
        self.vocab_size = heads.vocab_size
        self.hidden_size = heads.hidden_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return self.inner(hidden)


def test_the_step_probe_times_one_drafter_forward_and_resets_the_proposer(tiny_pairs, eagle3_verifiers):
    verifier, _ = tiny_pairs["llama"]
    decoder = HeadsDecoder(verifier, _SlowHeads(random_heads(verifier)))
    seconds = proposer_step_seconds(decoder._proposer, decoder._verifier, decoder.depth, repeats=3)
    assert 0.02 <= seconds < 0.05, seconds
    assert decoder._proposer._hidden is None  # reset: the next generate starts clean
    # EAGLE-3: per forward (a block's catch-up and one forward per level), the proposer reset
    e3 = _eagle3(eagle3_verifiers["llama"])
    per_forward = proposer_step_seconds(e3._proposer, e3._verifier, e3.depth, repeats=3)
    assert 0 < per_forward < 0.05
    assert isinstance(e3._proposer, Eagle3Proposer) and e3._proposer.cache_length == 0


def test_drafter_steps_are_cached_per_draft_shape(eagle3_verifiers, monkeypatch, tmp_path):
    """Two trees of one pair are two measurements (a wider tree's forward costs more), each made once."""
    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path / "costs.json"))
    monkeypatch.setattr(cost_probe, "_MEMO", {})
    timed: list[int] = []
    import train.decoding.proposers.step_probe as step_probe

    monkeypatch.setattr(step_probe, "proposer_step_seconds", lambda p, v, depth: timed.append(depth) or 0.01)
    verifier = eagle3_verifiers["llama"]
    wide, narrow = (
        _eagle3(verifier),
        Eagle3Decoder(verifier, eagle3_tests.drafter_for(verifier, "reduced"), 4, 1, 4),
    )
    for decoder in (wide, narrow, wide, narrow):
        costs = decoder.measure_costs()
        assert costs.draft == 0.01 and len(costs.verify) >= max(9, decoder.tree.total_tokens + 1)
    assert timed == [4, 4]
    monkeypatch.setattr(cost_probe, "_MEMO", {})  # a new process: both from the disk cache
    assert wide.measure_costs().draft == narrow.measure_costs().draft == 0.01
    assert timed == [4, 4]


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["gate", "broken_on_purpose"])
def test_the_output_law_holds_while_dflash_drafts_every_other_block(
    broken, eagle3_law_verifier, every_other_block, monkeypatch
):
    """4,000 sampled runs of 4 tokens at T = 1 (about a minute each: slow), a DFlash chain in every other
    block (the gate decides three times a run, so a run drafts right after the prefill or after a plain
    step, whose states the drafter then catches up on): tokens 2 and 3 against the verifier's law by
    chi-square (alpha 1e-4). Broken on purpose: a gate that keeps a draft only when the drafter found its
    first token likely (a decision on this block's draw) fails it."""
    if broken:
        monkeypatch.setattr(gated, "GatedProposer", _DecidesAfterTheDraw)
    stat, df, accepted = dflash_tests.law_statistic(
        eagle3_law_verifier, SamplingParams(1.0), plain_steps="auto", costs=STEEP
    )
    if broken:
        assert stat > dflash_tests.chi2_critical(df), (stat, df)
        return
    assert stat < dflash_tests.chi2_critical(df), (stat, df)
    assert accepted > 0.05 * dflash_tests.LAW_RUNS  # drafts were accepted: the rule was exercised
