"""Eagle3Decoder's ``fallback_gamma``: where the gated tree (or the sampled chain) has not paid, a chain of
the same drafter cut by cost instead of a plain step. Greedy equality with HF ``generate`` with EOS and
length limits; the tree gives way to its chain on checks steep past 5 tokens, and holds on flat ones; a
random drafter on steep checks takes plain steps; the chain's q rows at T > 0 are the sampled chain's;
the chain's length policy learns from what the verifier accepted; the exact law at T = 1 while blocks
switch between trees, chains and plain steps, and a chain decided after its draw caught by it (slow)."""

from __future__ import annotations

import pytest
import torch

from train.decoding import Draft, Eagle3Decoder, SamplingParams
from train.decoding.costs import StepCosts
from train.decoding.length_policy import regime
from train.decoding.proposers.eagle3_proposer import Eagle3Proposer
from train.decoding.sampling import warp

from .decoding_helpers import count_shapes, hf_greedy
from .spec_reference import chi2_critical, chi_square, run_many
from .test_eagle3_decoding import (
    LAW_PROMPT,
    LAW_RUNS,
    PROMPTS,
    OracleDrafter,
    drafter_for,
    sequential_children,
    tokens_2_and_3,
)

#: checks cheap up to 5 tokens and steep past them (float32 on a CPU: 1.04 / 1.53 / 2.18 steps for 2 / 3 /
#: 8 tokens, measured), the drafter's forward a tenth of a step
KNEE = StepCosts(verify=(1.0, 1.05, 1.1, 1.15, 1.2, 2.4, 2.6, 2.8, 3.0, 3.2), draft=0.1)
#: checks as a bfloat16 machine runs them: nearly flat
FLAT = StepCosts(verify=(1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12, 1.14, 1.16, 1.18), draft=0.02)
#: checks twice a step from two tokens on, a dear drafter
STEEP = StepCosts(verify=(1.0, 2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.6, 2.7, 2.8), draft=0.3)


def oracle(verifier, n: int = 80) -> tuple[OracleDrafter, torch.Tensor, list[int]]:
    """A drafter that knows the greedy continuation of PROMPTS[0], the prompt, and that continuation."""
    ids = torch.tensor([PROMPTS[0]])
    reference = hf_greedy(verifier, ids, n)
    return OracleDrafter.from_verifier(verifier).set_reference(PROMPTS[0] + reference), ids, reference


def gated(verifier, drafter, costs: StepCosts, fallback_gamma: int = 4, **kw) -> Eagle3Decoder:
    """EAGLE-3's 8-node tree (depth 4, branching 4) behind the gate, under ``costs``."""
    return Eagle3Decoder(
        verifier, drafter, 4, 4, 8, plain_steps="auto", costs=costs, fallback_gamma=fallback_gamma, **kw
    )


def test_a_tree_that_pays_less_than_its_chain_falls_back_on_the_chain(eagle3_verifiers, monkeypatch):
    """An oracle drafter on checks steep past 5 tokens: its 8-node tree commits 5 tokens for a check of 9
    (2.8 steps and 4 drafter forwards: it pays, 1.6 tokens a step), its chain of 4 the same 5 for a check
    of 5 (1.2 steps and 4 forwards: 3.1 tokens a step). With ``fallback_gamma`` the tree gives way to the
    chain after its warm-up: about 5 tokens checked a call instead of 9, as many verifier calls, the
    greedy output Hugging Face's; on flat checks the tree keeps its blocks. Broken on purpose (by hand): a
    fallback never used (``fallback=None`` in ``behind_gate``) fails the count of chains."""
    verifier = eagle3_verifiers["llama"]
    drafter, ids, reference = oracle(verifier)
    counts = count_shapes(monkeypatch, Eagle3Proposer)  # before the decoders, which bind the chain's propose
    chain = gated(verifier, drafter, KNEE)
    trees = gated(verifier, drafter, KNEE, fallback_gamma=0)
    for dec in (chain, trees):
        assert dec.generate(ids, 80).tokens.tolist() == reference  # the warm-up
    counts.update(tree=0, chain=0, chain_drafted=0)
    res = chain.generate(ids, 80)
    assert res.tokens.tolist() == reference
    assert counts["chain_drafted"] > 3 * counts["tree"], counts
    assert res.stats.verifier_tokens / res.stats.verifier_calls < 6.0, res.stats
    alone = trees.generate(ids, 80)
    assert alone.tokens.tolist() == reference
    assert alone.stats.verifier_tokens / alone.stats.verifier_calls > 7.5, alone.stats
    assert res.stats.verifier_calls <= alone.stats.verifier_calls + 2
    for eos in reference[3:12]:
        assert (
            chain.generate(ids, 80, eos_token_id=eos).tokens.tolist() == reference[: reference.index(eos) + 1]
        )
    for n in (0, 1, 2, 5):
        assert chain.generate(ids, n).tokens.tolist() == reference[:n]
    # flat checks: the tree commits as much for a check that costs hardly more; it keeps its blocks
    flat = gated(verifier, drafter, FLAT)
    flat.generate(ids, 80)
    counts.update(tree=0, chain=0, chain_drafted=0)
    assert flat.generate(ids, 80).tokens.tolist() == reference
    assert counts["tree"] > 2 * counts["chain"], counts


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_a_random_drafter_falls_back_to_plain_steps_and_keeps_greedy_output(arch, vocab, eagle3_verifiers):
    """A random drafter on checks twice a step: neither the tree nor the chain pays, so nearly every block
    is a plain step (the chain's own length policy refuses it, bar the probes); greedy output Hugging
    Face's with EOS and limits, in every shape (a tree, a chain, prompt lookup first)."""
    verifier = eagle3_verifiers[arch]
    drafter = drafter_for(verifier, vocab)
    for shape in ({}, {"lookup_tokens": 3}):
        dec = gated(verifier, drafter, STEEP, **shape)
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            reference = hf_greedy(verifier, ids, 40)
            assert dec.generate(ids, 40).tokens.tolist() == reference
            for n in (0, 1, 2, 17):
                assert dec.generate(ids, n).tokens.tolist() == reference[:n], (prompt, n)
            for eos in reference[2:6]:
                out = dec.generate(ids, 40, eos_token_id=eos).tokens.tolist()
                assert out == reference[: reference.index(eos) + 1]
        res = dec.generate(torch.tensor([PROMPTS[0]]), 40)
        assert res.stats.drafter_calls < 12, res.stats
        if not shape:  # (prompt lookup's copies pay on this repetitive verifier, at no drafter cost)
            assert res.stats.verifier_calls > 33, res.stats


def test_the_chain_q_rows_are_the_sampled_chains_and_its_length_learns(eagle3_verifiers, monkeypatch):
    """At T = 1 the fallback chain's q rows are the drafter's sequential-forward logits divided by
    ``draft_temperature`` and warped, at the target ids (as ``sampled_chain``'s); its nodes leave the
    drafter's cache; it is never longer than ``fallback_gamma``; and every chain teaches the length policy
    (its calibration holds one outcome per draft the verifier tested)."""
    verifier = eagle3_verifiers["llama"]
    drafter = drafter_for(verifier, "reduced", seed=2)
    chains: list[tuple[list[int], Draft, int]] = []
    propose_chain = Eagle3Proposer.propose_chain

    def spy(self, sequence, *args):  # type: ignore[no-untyped-def]
        draft = propose_chain(self, sequence, *args)
        if draft.tokens:
            chains.append((list(sequence), draft, self.cache_length))
        return draft

    monkeypatch.setattr(Eagle3Proposer, "propose_chain", spy)
    dec = gated(verifier, drafter, KNEE, fallback_gamma=3, sampled_chain=True, draft_temperature=0.8)
    params = SamplingParams(1.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        dec.generate(torch.tensor([PROMPTS[0]]), 30, params, generator=gen)
    assert len(chains) > 3
    vocab_size = verifier.config.vocab_size
    for sequence, draft, cached in chains:
        assert draft.is_chain and 1 <= len(draft) <= 3 and draft.q is not None
        assert cached == len(sequence) - 1
        q = draft.dense_q(vocab_size)
        for i, token in enumerate(draft.tokens):
            logits = sequential_children(verifier, drafter, sequence, draft, i - 1)
            want = torch.zeros(vocab_size).index_copy_(
                0, drafter.draft_ids, warp(logits.float() / 0.8, params)
            )
            torch.testing.assert_close(q[i], want, atol=1e-5, rtol=1e-4)
            assert q[i, token] > 0
    assert dec.length is not None
    taught = sum(dec.length.calibration(regime(params)).tested)
    assert taught >= len(chains), (taught, len(chains))


def test_fallback_gamma_settings_are_checked(eagle3_verifiers):
    verifier = eagle3_verifiers["llama"]
    drafter = drafter_for(verifier)
    with pytest.raises(ValueError, match="fallback_gamma is the chain a gated tree falls back on"):
        Eagle3Decoder(verifier, drafter, 4, 4, 8, fallback_gamma=4)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="fallback_gamma must be an integer"):
            Eagle3Decoder(verifier, drafter, 4, 4, 8, plain_steps="auto", fallback_gamma=bad)  # type: ignore[arg-type]
    assert Eagle3Decoder(verifier, drafter, 4, 4, 8, plain_steps="auto", fallback_gamma=6).draft_budget == 6
    with pytest.raises(RuntimeError, match="needs a length policy"):
        Eagle3Proposer(drafter, verifier.config.vocab_size).propose_chain(
            [1, 2], 3, SamplingParams(), None, frozenset(), None
        )  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the law at T = 1

#: nearly flat checks, where the law test's random drafter's chains pay more than its trees but the trees
#: are still tried (after the warm-up, in probes): runs mix both and plain steps (about 700 trees and 5,000
#: drafted chains in 4,000 runs, measured)
MIXED = StepCosts(verify=tuple(1.0 + 0.05 * i for i in range(8)), draft=0.05)


def _chain_decided_after_the_draw(self, sequence, budget, params, generator, eos, stats):  # type: ignore[no-untyped-def]
    """Broken on purpose: the fallback chain is dropped for a plain step when its first draft's q gave the
    drawn token more than 0.3 (a decision that depends on this block's draw)."""
    draft = original_propose_chain(self, sequence, budget, params, generator, eos, stats)
    if (
        draft.tokens
        and draft.q is not None
        and float(draft.dense_q(self.vocab_size)[0, draft.tokens[0]]) > 0.3
    ):
        self._chain = None
        return Draft()
    return draft


original_propose_chain = Eagle3Proposer.propose_chain


# 4,000 seeded decodes each (~60 s): slow, as the other EAGLE-3 law tests
@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True], ids=["fallback", "broken_on_purpose"])
def test_the_output_law_is_the_verifiers_while_the_tree_falls_back_on_its_chain(
    broken, eagle3_law_verifier, monkeypatch
):
    """Tokens 2 and 3 of 4,000 seeded runs of 4 tokens (a random drafter, a depth-3 tree of 6 nodes with a
    fallback chain of 3 drafts) against the verifier's warped law at T = 1, on nearly flat checks: runs mix
    trees, chains and plain steps; chi-square (alpha 1e-4). Broken on purpose: a chain
    dropped for a plain step when its first token was likely under q."""
    if broken:
        monkeypatch.setattr(Eagle3Proposer, "propose_chain", _chain_decided_after_the_draw)
    counts = count_shapes(monkeypatch, Eagle3Proposer)
    params = SamplingParams(1.0)
    law = tokens_2_and_3(eagle3_law_verifier, params)
    dec = Eagle3Decoder(
        eagle3_law_verifier,
        drafter_for(eagle3_law_verifier, seed=3),
        3,
        2,
        6,
        plain_steps="auto",
        costs=MIXED,
        fallback_gamma=3,
    )
    runs = run_many(dec, LAW_PROMPT, 4, params, LAW_RUNS, seed=0)
    tally: dict[tuple[int, ...], int] = {}
    for key, c in runs.counts.items():
        tally[key[1:3]] = tally.get(key[1:3], 0) + c
    stat, df = chi_square(tally, law, LAW_RUNS)
    if broken:
        assert stat > chi2_critical(df), (stat, df, counts)
        return
    assert stat < chi2_critical(df), (stat, df)
    assert counts["tree"] > 300 and counts["chain_drafted"] > 1000, counts


def test_the_fallback_chain_is_never_longer_than_fallback_gamma(eagle3_verifiers, monkeypatch):
    """The loop's budget is the longer of the tree's depth (4) and the fallback chain's; a chain of
    ``fallback_gamma`` = 2 is handed 2 whatever the budget (``gated_proposer.capped``), so no fallback draft
    is longer, and the greedy output stays Hugging Face's. Broken on purpose (by hand): the chain's own
    ``propose_chain`` as the fallback (uncapped, as before) is handed the tree's depth and fails."""
    verifier = eagle3_verifiers["llama"]
    drafter = drafter_for(verifier, "reduced")
    budgets: list[int] = []
    propose_chain = Eagle3Proposer.propose_chain

    def spy(self, sequence, budget, *args):  # type: ignore[no-untyped-def]
        budgets.append(budget)
        return propose_chain(self, sequence, budget, *args)

    monkeypatch.setattr(Eagle3Proposer, "propose_chain", spy)
    dec = gated(verifier, drafter, STEEP, fallback_gamma=2)
    ids = torch.tensor([PROMPTS[0]])
    reference = hf_greedy(verifier, ids, 40)
    for _ in range(3):
        assert dec.generate(ids, 40).tokens.tolist() == reference
    assert budgets and max(budgets) == 2, budgets
