"""The plain-step gate for fixed-shape drafts (train/decoding/draft_gate.py, proposers/gated_proposer.py)
and the decoders that take it (``plain_steps="auto"``: trees, RSD, chains of set gamma).

The gate's arithmetic by hand; the decoders' greedy output equal to Hugging Face's where drafting pays
and where it does not (then plain steps, bar the probes); EOS and every short limit; the exact output law
at T = 1 by chi-square while the gate switches between drafted blocks and plain steps. Broken on purpose
(in the suite): a gate that decides after the draft is drawn, dropping drafts whose first token the
drafter found unlikely, fails the law test.
"""

from __future__ import annotations

import copy

import pytest
import torch

from train.decoding import SamplingParams, SpeculativeDecoder, TreeSpeculativeDecoder
from train.decoding.costs import StepCosts
from train.decoding.draft import Draft
from train.decoding.draft_gate import (
    SHAPE,
    DraftGate,
    drafting_pays,
    hopeless,
    plain_step_gate,
    surely_pays,
)
from train.decoding.proposers.gated_proposer import GatedProposer
from train.decoding.proposers.model_proposer import ModelProposer
from train.decoding.proposers.tree_proposers import TreeProposer

from .decoding_helpers import count_shapes, hf_greedy
from .spec_reference import chi2_critical, chi_square, run_many, table_next, verifier_joint
from .test_tree import EOS, METHODS, PROMPT, fake_pair

#: checks as a float32 CPU shipped them: a check of n > 1 tokens costs about twice a step
STEEP = StepCosts(verify=(1.0, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 2.7, 2.8, 2.9, 3.0), draft=0.2)
#: checks as a bfloat16 machine runs them: nearly flat, a cheap drafter
FLAT = StepCosts(verify=(1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12, 1.14, 1.16, 1.18, 1.2, 1.22), draft=0.02)
#: checks cheap up to 7 tokens and steep past them (float32 on a CPU measured 1.12 / 1.14 / 1.49 / 1.78
#: steps for 3 / 4 / 6 / 8 tokens)
KNEE = StepCosts(verify=(1.0, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 2.6, 2.8, 3.0, 3.2, 3.4), draft=0.2)


def test_the_gate_by_hand():
    assert drafting_pays(3.0, 2.9, 1.0) and not drafting_pays(3.0, 3.1, 1.0)
    with pytest.raises(ValueError):
        drafting_pays(1.0, 0.0, 1.0)
    gate = DraftGate(
        StepCosts(verify=(1.0, 1.5, 2.0), draft=0.25), warmup=2, probe_every=3, probe_blocks=1, decay=0.5
    )
    assert gate.block_seconds(2, 2) == pytest.approx(2.0 + 0.5)
    assert gate.should_draft("greedy") and gate.should_draft("greedy")  # warm-up
    gate.record("greedy", 1, 2.5)
    gate.record("greedy", 2, 2.5)  # decayed sums: 0.5 + 2 = 2.5 tokens in 1.25 + 2.5 = 3.75 s
    assert gate.rate("greedy").tokens == pytest.approx(2.5) and gate.rate("greedy").seconds == pytest.approx(
        3.75
    )
    # 0.67 < 1 token/s: plain steps, a probe after 3, then after 6 (the probe did not pay)
    assert [gate.should_draft("greedy") for _ in range(9)] == [False, False, True] + [False] * 5 + [True]
    assert gate.should_draft(("sampled", 1.0))  # another regime warms up on its own
    gate.record("greedy", 4, 2.5)  # 1.25 + 4 = 5.25 tokens in 1.875 + 2.5 = 4.375 s: 1.2 tokens/s
    assert gate.should_draft("greedy")
    # a probe of several blocks: each drafts, then the gate judges again
    burst = DraftGate(StepCosts(verify=(1.0, 1.5, 2.0), draft=0.25), warmup=1, probe_every=2, probe_blocks=3)
    assert burst.should_draft("greedy")  # warm-up
    burst.record("greedy", 1, 2.5)
    assert [burst.should_draft("greedy") for _ in range(9)] == [False, True, True, True] + [False] * 3 + [
        True
    ] * 2
    with pytest.raises(RuntimeError, match="no step costs"):
        DraftGate().block_seconds(1, 1)
    bad_settings = (
        {"warmup": 0},
        {"probe_every": 0},
        {"probe_longest": 4},
        {"probe_blocks": 0},
        {"decay": 0.0},
    )
    for bad in bad_settings:
        with pytest.raises(ValueError):
            DraftGate(**bad)  # type: ignore[arg-type]
    assert plain_step_gate("never") is None and isinstance(plain_step_gate("auto"), DraftGate)
    with pytest.raises(ValueError, match="plain_steps"):
        plain_step_gate("sometimes")


def _close_drafter(verifier: torch.nn.Module) -> torch.nn.Module:
    drafter = copy.deepcopy(verifier)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=gen))
    return drafter


@pytest.mark.parametrize("method", list(METHODS))
def test_trees_that_do_not_pay_become_plain_steps_and_keep_the_greedy_output(method, tiny_pairs):
    """A random drafter on steep checks: after the warm-up (the first generation's 16 blocks; the gate
    lives as long as the decoder) it stops drafting, bar the probes; a drafter close to the verifier on
    flat checks: it drafts every block. The greedy output is the verifier's either way."""
    verifier, drafter = tiny_pairs["llama"]
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    ref = hf_greedy(verifier, ids, 60)
    dec = TreeSpeculativeDecoder(verifier, drafter, **METHODS[method], plain_steps="auto", costs=STEEP)
    assert dec.generate(ids, 60).tokens.tolist() == ref  # the warm-up
    res = dec.generate(ids, 60)
    assert res.tokens.tolist() == ref
    never = TreeSpeculativeDecoder(verifier, drafter, **METHODS[method]).generate(ids, 60)
    assert res.stats.verifier_calls > 45 and res.stats.drafter_calls < never.stats.drafter_calls / 3, (
        res.stats.verifier_calls,
        res.stats.drafter_calls,
        never.stats.drafter_calls,
    )
    close = TreeSpeculativeDecoder(
        verifier, _close_drafter(verifier), **METHODS[method], plain_steps="auto", costs=FLAT
    )
    res = close.generate(ids, 60)
    assert res.tokens.tolist() == ref
    assert res.stats.accepted >= 30 and res.stats.verifier_calls < 25, res.stats


def test_a_gated_chain_and_a_gated_tree_stop_at_eos_and_at_every_limit(tiny_pairs):
    verifier, drafter = tiny_pairs["llama"]
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    ref = hf_greedy(verifier, ids, 30)
    for costs in (STEEP, FLAT):
        decoders = [
            SpeculativeDecoder(verifier, drafter, gamma=3, plain_steps="auto", costs=costs),
            TreeSpeculativeDecoder(
                verifier, drafter, **METHODS["rsd_c"], plain_steps="auto", costs=costs, lookup_tokens=3
            ),
        ]
        for dec in decoders:
            for eos in ref[1:10]:
                assert dec.generate(ids, 30, eos_token_id=eos).tokens.tolist() == ref[: ref.index(eos) + 1]
            for n in (0, 1, 2, 5):
                assert dec.generate(ids, n).tokens.tolist() == ref[:n]


def test_bad_settings_raise(tiny_pairs):
    verifier, drafter = tiny_pairs["llama"]
    with pytest.raises(ValueError, match="plain_steps"):
        TreeSpeculativeDecoder(verifier, drafter, **METHODS["rsd_c"], plain_steps="always")
    with pytest.raises(ValueError, match="plain_steps='auto' is for draft_length='fixed'"):
        SpeculativeDecoder(verifier, drafter, draft_length="cost", plain_steps="auto")
    with pytest.raises(ValueError, match="fallback_gamma is the chain a gated tree falls back on"):
        TreeSpeculativeDecoder(verifier, drafter, **METHODS["rsd_c"], fallback_gamma=4)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="fallback_gamma must be an integer"):
            TreeSpeculativeDecoder(
                verifier,
                drafter,
                **METHODS["rsd_c"],
                plain_steps="auto",
                fallback_gamma=bad,  # type: ignore[arg-type]
            )


class _DecidesAfterTheDraw(GatedProposer):
    """Broken on purpose: drafts first, then keeps the draft only when the drafter found its first token
    likely (a decision that depends on this block's draw)."""

    def propose(self, sequence, budget, params, generator, eos, stats):  # type: ignore[no-untyped-def]
        draft = self.inner.propose(sequence, budget, params, generator, eos, stats)
        if draft.tokens and draft.q is not None and float(draft.q[0, draft.tokens[0]]) < 0.4:
            return Draft()
        return draft


T1 = SamplingParams(temperature=1.0)


@pytest.mark.parametrize("broken", [False, True], ids=["gate", "broken_on_purpose"])
def test_the_output_law_is_the_verifiers_while_the_gate_switches(broken, monkeypatch):
    """3,000 sampled decodes of the table pair (q != p, EOS in play) through RSD-C behind the gate, on
    checks that cost about what the trees yield, so that runs mix drafted blocks and plain steps;
    chi-square (alpha 1e-4) against the verifier's enumerated law."""
    import train.decoding.proposers.gated_proposer as gated

    if broken:
        monkeypatch.setattr(gated, "GatedProposer", _DecidesAfterTheDraw)
    verifier, drafter, table = fake_pair("q!=p")
    costs = StepCosts(verify=tuple(1.0 + 0.33 * i for i in range(12)), draft=0.05)
    dec = TreeSpeculativeDecoder(verifier, drafter, **METHODS["rsd_c"], plain_steps="auto", costs=costs)
    n, max_new = 3000, 4
    runs = run_many(dec, PROMPT, max_new, T1, n, seed=0, eos=EOS)
    law = verifier_joint(table_next(table, T1), PROMPT, max_new, (EOS,))
    stat, df = chi_square(runs.counts, law, n)
    if broken:
        assert stat > chi2_critical(df), (stat, df)
        return
    assert stat < chi2_critical(df), (stat, df)
    drafted_runs = sum(1 for s in runs.stats if s.drafter_calls > 0)
    assert 300 < drafted_runs < n - 300, drafted_runs  # runs with trees and runs of plain steps alone


def test_the_warm_up_ends_early_only_when_even_an_optimistic_reading_loses():
    # four one-token blocks: optimistically 1 + 2 x 0.75 / 2 = 1.75 tokens a block
    assert hopeless(4, 4.0, 4.0, 4 * 2.3, 1.0, 0.75)  # a tree costing 2.3 steps (float32)
    assert not hopeless(4, 4.0, 4.0, 4 * 1.4, 1.0, 0.75)  # a chain costing 1.4 steps (bfloat16)
    assert not hopeless(0, 0.0, 0.0, 0.0, 1.0, 0.75)
    # a wide spread is read as such: blocks of 1 and 5 tokens, mean 3, deviation 2
    assert not hopeless(4, 12.0, 52.0, 4 * 4.5, 1.0, 0.75) and hopeless(4, 12.0, 52.0, 4 * 5.1, 1.0, 0.75)

    def drafted(costs: StepCosts, committed: list[int]) -> list[bool]:
        gate = DraftGate(costs, probe_every=100)
        decisions = []
        for c in committed:
            decisions.append(gate.should_draft("greedy"))
            if decisions[-1]:
                gate.record("greedy", c, gate.block_seconds(4, 4))
        return decisions

    ones = [1] * 16
    assert drafted(STEEP, ones) == [True] * 4 + [False] * 12  # ends after 4: 2.3 + 0.8 steps a block
    assert drafted(FLAT, ones) == [True] * 16  # 1.08 + 0.08 steps a block: the whole warm-up
    # a drafter whose first blocks were unlucky but then pay keeps drafting on steep checks
    assert drafted(STEEP, [1, 1, 5, 5, 5, 5] + [5] * 10) == [True] * 16


def test_the_gate_records_every_drafted_block_the_last_one_too(tiny_pairs):
    """Each drafted block reaches the gate's counts, the one that ends a generation (at the limit or at
    EOS) included: short generations would otherwise lean to the blocks that were rejected early.
    Broken on purpose (by hand): committing after the loop's ``done`` check leaves the count short by one
    block per generation and fails this test."""
    verifier, drafter = tiny_pairs["llama"]
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    ref = hf_greedy(verifier, ids, 30)
    for dec in (
        SpeculativeDecoder(verifier, _close_drafter(verifier), gamma=3, plain_steps="auto", costs=FLAT),
        TreeSpeculativeDecoder(verifier, drafter, **METHODS["rsd_c"], plain_steps="auto", costs=FLAT),
    ):
        gate = dec._gate
        assert gate is not None
        drafted_blocks = 0
        for n, eos in ((2, None), (5, None), (12, None), (30, ref[7])):
            res = dec.generate(ids, n, eos_token_id=eos)
            drafted_blocks += res.stats.position_drafted[0] if res.stats.position_drafted else 0
            assert gate.rate("greedy").total.blocks == drafted_blocks, (n, eos, res.stats)
        assert drafted_blocks >= 4


def test_a_probe_ends_after_its_first_block_only_when_even_an_optimistic_reading_of_it_loses():
    """A probe drafts ``probe_blocks`` blocks so that one unlucky block cannot lock a paying drafter out;
    but where the probe's own blocks lose even read optimistically (the warm-up's rule), the rest of it
    is plain steps: a one-token block of a check costing 3.1 steps ends it, the same block of one costing
    1.16 steps does not. Broken on purpose (by hand): without the early end the steep probes last 4
    blocks and this fails."""

    def decisions(costs: StepCosts, n: int) -> list[bool]:
        gate = DraftGate(costs, warmup=4, probe_every=2, probe_longest=2, probe_blocks=4)
        made = []
        for _ in range(n):
            made.append(gate.should_draft("greedy"))
            if made[-1]:
                gate.record("greedy", 1, gate.block_seconds(4, 4))
        return made

    warm_up = [True] * 4
    assert decisions(STEEP, 12) == warm_up + [False, True] * 4
    assert decisions(FLAT, 14) == warm_up + [False, True, True, True, True] * 2


def test_a_probe_that_paid_restarts_the_rate_from_its_own_blocks():
    """Two probe blocks that paid beyond doubt decide alone: blended into a rate that decays over about ten
    blocks they would move it too little, and a drafter that starts to pay would wait for the next probe
    (or need probes of four blocks, about two steps for a token each where checks are steep). A probe
    that paid by a margin its two blocks cannot vouch for, or did not pay, is blended as any block is.
    Broken on purpose (by hand): without the restart the gate refuses after the good probe and this
    fails; restarting on any probe that paid (``drafting_pays`` for ``surely_pays``) fails it too."""
    # two blocks of 6 tokens at 3.1 steps each: 12 - 2 x 0.75 x sqrt(2) = 9.9 tokens >= 6.2 steps
    assert surely_pays(2, 12.0, 72.0, 6.2, 1.0, 0.75) and not surely_pays(2, 8.0, 32.0, 6.2, 1.0, 0.75)
    assert not surely_pays(0, 0.0, 0.0, 0.0, 1.0, 0.75)

    def run(committed: list[int]) -> tuple[DraftGate, list[bool]]:
        gate = DraftGate(STEEP, warmup=4, probe_every=8, probe_blocks=2)
        decisions, blocks = [], iter(committed)
        while len(decisions) < 14:
            decisions.append(gate.should_draft("greedy"))
            if decisions[-1]:
                gate.record("greedy", next(blocks), gate.block_seconds(4, 4))
        return gate, decisions

    block = DraftGate(STEEP).block_seconds(4, 4)  # 3.1 steps
    paid, decisions = run([1] * 4 + [6] * 3)  # a bad warm-up, then a probe of two six-token blocks
    assert decisions == [True] * 4 + [False] * 7 + [True] * 3
    rate = paid.rate("greedy")  # restarted from the probe (12 tokens in 6.2 steps), then one more block
    assert rate.tokens == pytest.approx(0.9 * 12 + 6)
    assert rate.seconds == pytest.approx(0.9 * 2 * block + block)

    # a probe of two four-token blocks paid (8 tokens in 6.2 steps), but not beyond doubt: blended
    lucky, decisions = run([1] * 4 + [4, 4] + [1])
    ones = sum(0.9**i for i in range(2, 6))
    assert lucky.rate("greedy").tokens == pytest.approx(0.9 * 4 + 4 + ones)
    assert decisions == [True] * 4 + [False] * 7 + [True] * 2 + [False]

    # a probe whose first block committed one token (hopeless at 3.1 steps: the probe ends there)
    unpaid, decisions = run([1] * 5)
    assert decisions == [True] * 4 + [False] * 7 + [True] + [False] * 2
    ones = sum(0.9**i for i in range(5))  # five one-token blocks, decayed: the rate went on as before
    assert unpaid.rate("greedy").tokens == pytest.approx(ones)


def test_a_shape_must_beat_its_fallbacks_rate_where_that_beats_a_plain_step():
    """``rival``: what a token of the decoder's fallback has cost. A shape whose blocks pay 1.25 tokens a
    step drafts against plain steps, not against a fallback that paid 2 tokens a step; a rival slower
    than a plain step changes nothing (the shape is still weighed against plain steps)."""
    gate = DraftGate(StepCosts(verify=(1.0, 1.5, 2.0), draft=0.25), warmup=1, probe_every=100)
    assert gate.should_draft("greedy")
    gate.record("greedy", 5, 4.0)
    assert gate.should_draft("greedy") and gate.should_draft("greedy", rival=1.5)
    assert not gate.should_draft("greedy", rival=0.5)


def test_the_gate_chooses_between_a_shape_its_fallback_and_a_plain_step():
    """:meth:`DraftGate.choose` by hand: the shape's warm-up, then the fallback's; a fallback that paid 2
    tokens a step takes the blocks of a shape that paid 1.25; a fallback that paid less than the shape is
    tried again after ``probe_every`` shape blocks, the interval doubling while the shape keeps winning.
    Without a fallback the answers are :meth:`should_draft`'s. Broken on purpose (by hand): ``choose``
    without the rival keeps the shape in the first case and fails; without the fallback's probes the
    second fails."""
    costs = StepCosts(verify=(1.0, 1.5, 2.0), draft=0.25)

    def run(fallback_tokens: int, n: int) -> str:
        """The choices as letters: S the shape, F the fallback."""
        gate = DraftGate(costs, warmup=2, warmup_least=2, probe_every=3, probe_longest=12)
        made = ""
        for _ in range(n):
            shape = gate.choose("greedy", True) == SHAPE
            made += "S" if shape else "F"
            if shape:
                gate.record("greedy", 5, 4.0)  # 1.25 tokens a step
            else:
                gate.record_fallback("greedy", fallback_tokens, 2.0)
        return made

    # the fallback paid 2 tokens a step: it keeps the blocks, the shape probed after 3 refusals, then 6
    # (each probe one block: at 1.25 tokens a step it cannot beat the fallback even read optimistically)
    assert run(4, 12) == "SS" + "FF" + "FF" + "S" + "FFFFF"
    # a fallback that paid 1 token a step (as plain steps): the shape holds, the fallback tried at the 3rd,
    # 6th and 12th shape block in a row
    assert run(2, 30) == "SS" + "FF" + "SSF" + "SSSSSF" + "SSSSSSSSSSSF" + "SSSSS"
    plain = DraftGate(costs, warmup=1, probe_every=100)
    assert plain.choose("greedy", False) == SHAPE
    plain.record("greedy", 1, 2.0)
    assert plain.choose("greedy", False) is None and plain.rival("greedy") is None


@pytest.mark.parametrize("method", list(METHODS))
def test_a_tree_that_pays_less_than_its_chain_falls_back_on_the_chain(method, tiny_pairs, monkeypatch):
    """Checks steep past 7 tokens and a drafter close to the verifier: a tree of 10 nodes commits at most
    4 tokens for a check of 11 (3.8 steps: it does not pay), a chain of 3 drafts about 4 for a check of 4
    (2 steps). With ``fallback_gamma`` the tree gives way to the chain after its warm-up: fewer verifier
    calls than the tree gated to plain steps alone, fewer tokens checked a call, the greedy output Hugging
    Face's. A random drafter on steep checks: the chain's own length policy takes plain steps (bar the
    probes). Broken on purpose (by hand): a fallback that is never used (``fallback=None`` in
    ``behind_gate``) fails the count of chains."""
    verifier, drafter = tiny_pairs["llama"]
    close = _close_drafter(verifier)
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    ref = hf_greedy(verifier, ids, 60)
    counts = count_shapes(monkeypatch, TreeProposer)  # before the decoders, which bind the chain's propose
    plain = TreeSpeculativeDecoder(verifier, close, **METHODS[method], plain_steps="auto", costs=KNEE)
    chain = TreeSpeculativeDecoder(
        verifier, close, **METHODS[method], plain_steps="auto", costs=KNEE, fallback_gamma=6
    )
    for dec in (plain, chain):
        assert dec.generate(ids, 60).tokens.tolist() == ref  # the warm-up
    counts.update(tree=0, chain=0, chain_drafted=0)
    res = chain.generate(ids, 60)
    assert res.tokens.tolist() == ref
    assert counts["chain_drafted"] > 3 * counts["tree"], counts
    trees = plain.generate(ids, 60)
    assert trees.tokens.tolist() == ref
    assert res.stats.verifier_calls < trees.stats.verifier_calls, (res.stats, trees.stats)
    assert res.stats.verifier_tokens / res.stats.verifier_calls < 7.5, res.stats
    # a random drafter: the chain's own length policy takes plain steps where no draft pays
    random = TreeSpeculativeDecoder(
        verifier, drafter, **METHODS[method], plain_steps="auto", costs=STEEP, fallback_gamma=6
    )
    assert random.generate(ids, 60).tokens.tolist() == ref
    counts.update(tree=0, chain=0, chain_drafted=0)
    res = random.generate(ids, 60)
    assert res.tokens.tolist() == ref
    drafted = counts["chain_drafted"] + counts["tree"]
    assert res.stats.verifier_calls > 45 and drafted < 12, (counts, res.stats)
    for eos in ref[1:10]:
        assert chain.generate(ids, 60, eos_token_id=eos).tokens.tolist() == ref[: ref.index(eos) + 1]
    for n in (0, 1, 2, 5):
        assert chain.generate(ids, n).tokens.tolist() == ref[:n]


def _chain_decided_after_the_draw(self, sequence, budget, params, generator, eos, stats):  # type: ignore[no-untyped-def]
    """Broken on purpose: the fallback chain is dropped for a plain step when the drafter found its first
    token likely (a decision that depends on this block's draw)."""
    self._fed = []
    draft = ModelProposer.propose(self, sequence, budget, params, generator, eos, stats)
    if draft.tokens and draft.q is not None and float(draft.q[0, draft.tokens[0]]) > 0.5:
        self._pending = None
        return Draft()
    return draft


@pytest.mark.parametrize("broken", [False, True], ids=["fallback", "broken_on_purpose"])
def test_the_output_law_is_the_verifiers_while_a_tree_falls_back_on_its_chain(broken, monkeypatch):
    """6,000 sampled decodes of the table pair (a generic drafter, EOS in play) through RSD-C with a
    fallback chain, on checks where trees and chains pay about alike: runs mix both; chi-square (alpha
    1e-4) against the verifier's enumerated law (chi-square 50 against a critical 95 when measured).
    Broken on purpose: a chain dropped for a plain step when the drafter gave its first draft more than
    0.5 (seven chains in ten): chi-square 145 (3,000 decodes read it at 80 against 78, too close)."""
    if broken:
        monkeypatch.setattr(TreeProposer, "propose_chain", _chain_decided_after_the_draw)
    counts = count_shapes(monkeypatch, TreeProposer)  # before the decoder, which binds the chain's propose
    verifier, drafter, table = fake_pair("generic")
    costs = StepCosts(verify=tuple(1.0 + 0.16 * i for i in range(12)), draft=0.05)
    dec = TreeSpeculativeDecoder(
        verifier, drafter, **METHODS["rsd_c"], plain_steps="auto", costs=costs, fallback_gamma=4
    )
    n, max_new = 6000, 4
    runs = run_many(dec, PROMPT, max_new, T1, n, seed=0, eos=EOS)
    law = verifier_joint(table_next(table, T1), PROMPT, max_new, (EOS,))
    stat, df = chi_square(runs.counts, law, n)
    if broken:
        assert stat > chi2_critical(df), (stat, df, counts)
        return
    assert stat < chi2_critical(df), (stat, df)
    assert counts["tree"] > 600 and counts["chain_drafted"] > 1000, counts  # both shapes drafted


# ----------------------------------------------------------------------------- a gated chain's cut


def _count_cuts(monkeypatch) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Count the model proposer's whole chains and its cut chains (drafted or not) from here on."""
    counts = {"whole": 0, "cut": 0, "cut_drafted": 0}
    whole, cut = ModelProposer.propose, ModelProposer.propose_cut

    def count_whole(self, *args):  # type: ignore[no-untyped-def]
        counts["whole"] += self.length is None  # (the cut calls propose with its policy set)
        return whole(self, *args)

    def count_cut(self, *args):  # type: ignore[no-untyped-def]
        draft = cut(self, *args)
        counts["cut"] += 1
        counts["cut_drafted"] += bool(draft.tokens)
        return draft

    monkeypatch.setattr(ModelProposer, "propose", count_whole)
    monkeypatch.setattr(ModelProposer, "propose_cut", count_cut)
    return counts


#: checks cheap up to 3 tokens and steep past them, a cheap drafter
NARROW = StepCosts(verify=(1.0, 1.05, 1.1, 2.5, 2.8, 3.1, 3.4, 3.7, 4.0), draft=0.05)


def test_a_gated_fixed_chain_falls_back_on_its_cut(tiny_pairs, monkeypatch):
    """A drafter near the verifier (about half its drafts accepted) on checks steep past 3 tokens: its whole
    chain of 6 costs 3.7 steps to check, more than it commits, so gated alone it takes plain steps (about 1.5
    tokens checked a call); its chain cut by cost checks the first drafts, which pay. With ``fallback_cut``
    the gate gives the blocks to the cut after its warm-up (the whole chain only in its probes): under 0.7
    of the verifier calls of the chain gated alone, the greedy output Hugging Face's, EOS and every short
    limit. A random drafter on steep checks: the cut's own length policy takes plain steps. Broken by hand:
    without the fallback (``behind_gate(..., None)``) the count of cuts fails."""
    verifier, drafter = tiny_pairs["llama"]
    ids = torch.tensor([[0, 5, 9, 3, 7]])
    ref = hf_greedy(verifier, ids, 60)
    counts = _count_cuts(monkeypatch)
    close = _close_drafter(verifier)
    cut = SpeculativeDecoder(verifier, close, gamma=6, plain_steps="auto", costs=NARROW, fallback_cut=True)
    whole = SpeculativeDecoder(verifier, close, gamma=6, plain_steps="auto", costs=NARROW)
    for dec in (cut, whole):
        assert dec.generate(ids, 60).tokens.tolist() == ref  # the warm-ups
    counts.update(whole=0, cut=0, cut_drafted=0)
    res = cut.generate(ids, 60)
    assert res.tokens.tolist() == ref
    assert counts["cut_drafted"] > 2 * counts["whole"], counts  # the whole chain only in its probes
    alone = whole.generate(ids, 60)
    assert alone.tokens.tolist() == ref
    assert res.stats.verifier_calls < 0.7 * alone.stats.verifier_calls, (res.stats, alone.stats)
    for eos in ref[1:10]:
        assert cut.generate(ids, 60, eos_token_id=eos).tokens.tolist() == ref[: ref.index(eos) + 1]
    for n in (0, 1, 2, 5):
        assert cut.generate(ids, n).tokens.tolist() == ref[:n]
    random = SpeculativeDecoder(
        verifier, drafter, gamma=4, plain_steps="auto", costs=STEEP, fallback_cut=True
    )
    assert random.generate(ids, 60).tokens.tolist() == ref
    res = random.generate(ids, 60)
    assert res.tokens.tolist() == ref
    assert res.stats.verifier_calls > 45 and res.stats.drafter_calls < 12, res.stats
    for bad in (
        {"fallback_cut": True},
        {"fallback_cut": True, "plain_steps": "auto", "confidence_threshold": 0.3},
        {"fallback_cut": 1, "plain_steps": "auto"},
    ):
        with pytest.raises(ValueError, match="fallback_cut"):
            SpeculativeDecoder(verifier, drafter, **bad)  # type: ignore[arg-type]


def _cut_decided_after_the_draw(self, sequence, budget, params, generator, eos, stats):  # type: ignore[no-untyped-def]
    """Broken on purpose: the cut chain is dropped for a plain step when the drafter gave its first draft
    more than 0.5 (a decision that depends on this block's draw)."""
    draft = _PROPOSE_CUT(self, sequence, budget, params, generator, eos, stats)
    if draft.tokens and draft.q is not None and float(draft.q[0, draft.tokens[0]]) > 0.5:
        self._pending = None
        return Draft()
    return draft


_PROPOSE_CUT = ModelProposer.propose_cut


@pytest.mark.parametrize("broken", [False, True], ids=["fallback", "broken_on_purpose"])
def test_the_output_law_is_the_verifiers_while_a_chain_falls_back_on_its_cut(broken, monkeypatch):
    """6,000 sampled decodes of the table pair (a generic drafter, EOS in play) through a gated chain of 3
    that falls back on its cut, on checks where the two pay about alike: runs mix whole chains, cut chains
    and plain steps; chi-square (alpha 1e-4) against the verifier's enumerated law. Broken on purpose: a cut
    chain dropped for a plain step when its first draft was likely."""
    if broken:
        monkeypatch.setattr(ModelProposer, "propose_cut", _cut_decided_after_the_draw)
    counts = _count_cuts(monkeypatch)
    verifier, drafter, table = fake_pair("generic")
    costs = StepCosts(verify=tuple(1.0 + 0.16 * i for i in range(12)), draft=0.05)
    dec = SpeculativeDecoder(verifier, drafter, gamma=3, plain_steps="auto", costs=costs, fallback_cut=True)
    n, max_new = 6000, 4
    runs = run_many(dec, PROMPT, max_new, T1, n, seed=0, eos=EOS)
    law = verifier_joint(table_next(table, T1), PROMPT, max_new, (EOS,))
    stat, df = chi_square(runs.counts, law, n)
    if broken:
        assert stat > chi2_critical(df), (stat, df, counts)
        return
    assert stat < chi2_critical(df), (stat, df)
    assert counts["whole"] > 300 and counts["cut_drafted"] > 1000, counts  # both drafted
