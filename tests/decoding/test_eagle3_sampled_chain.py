"""Eagle3Decoder's ``sampled_chain`` (EAGLE-1's sampling at T > 0): each draft is a chain whose q rows are
the drafter's warped distributions along the chain (checked against a cache-free sequential forward), the
drafter's cache is back to the committed positions after every draft, T = 0 keeps the tree (greedy
equality with HF ``generate``), and a chain handed the wrong q is caught by the law test (the law itself
is tested in test_eagle3_decoding.py, both ways of drafting)."""

from __future__ import annotations

import pytest
import torch

from train.decoding import Draft, Eagle3Decoder, SamplingParams
from train.decoding.proposers.eagle3_proposer import Eagle3Proposer
from train.decoding.sampling import warp

from .decoding_helpers import hf_greedy
from .spec_reference import chi2_critical
from .test_eagle3_decoding import PROMPTS, drafter_for, law_statistic, sequential_children


class ChainSpy:
    """Records every non-empty draft with the sequence it continues
    and the drafter's cache length after it."""

    def __init__(self, monkeypatch) -> None:
        self.records: list[tuple[list[int], Draft, int]] = []
        propose = Eagle3Proposer.propose
        spy = self

        def propose_spy(self, sequence, *args):
            draft = propose(self, sequence, *args)
            if len(draft):
                spy.records.append((list(sequence), draft, self.cache_length))
            return draft

        monkeypatch.setattr(Eagle3Proposer, "propose", propose_spy)


def drafts_under_eos(monkeypatch) -> list[tuple[frozenset[int], Draft]]:
    """Every non-empty draft the EAGLE-3 proposer makes from now on, with the eos set it drafted under
    (a list that fills as the test decodes)."""
    drafted: list[tuple[frozenset[int], Draft]] = []
    propose = Eagle3Proposer.propose

    def propose_spy(self, sequence, budget, params, generator, eos, stats):
        draft = propose(self, sequence, budget, params, generator, eos, stats)
        if len(draft):
            drafted.append((eos, draft))
        return draft

    monkeypatch.setattr(Eagle3Proposer, "propose", propose_spy)
    return drafted


def sampled_drafts(verifier, vocab: str, params: SamplingParams, monkeypatch, **decoder_kw):
    """(verifier, drafter, ChainSpy records) of 24 tokens decoded from ``PROMPTS[0]`` by an
    ``Eagle3Decoder(verifier, drafter, 4, 3, 10, **decoder_kw)`` with a random drafter (seed 2)."""
    drafter = drafter_for(verifier, vocab, seed=2)
    spy = ChainSpy(monkeypatch)
    decoder = Eagle3Decoder(verifier, drafter, 4, 3, 10, **decoder_kw)
    decoder.generate(torch.tensor([PROMPTS[0]]), 24, params, generator=torch.Generator().manual_seed(0))
    assert len(spy.records) > 3
    return verifier, drafter, spy.records


#: The regimes every sampled draft's q rows are checked under, times both draft vocabularies.
SAMPLED_REGIMES = pytest.mark.parametrize(
    ("params", "draft_temperature"),
    [(SamplingParams(1.0), 1.0), (SamplingParams(0.7, top_k=4), 1.0), (SamplingParams(1.0), 0.6)],
    ids=["T1", "T0.7-top_k4", "T1-draft_temperature0.6"],
)
BOTH_VOCABS = pytest.mark.parametrize("vocab", ["full", "reduced"])


def stops_at_the_limit_and_at_eos(decoder: Eagle3Decoder, eos: int = 7) -> int:
    """Sampled decoding gives exactly n tokens for small limits, and nothing after an eos; returns eos."""
    gen = torch.Generator().manual_seed(1)
    for n in (1, 2, 3, 9):
        out = decoder.generate(torch.tensor([PROMPTS[1]]), n, SamplingParams(1.0), generator=gen)
        assert len(out.tokens) == n
    for _ in range(20):
        out = decoder.generate(
            torch.tensor([PROMPTS[1]]), 30, SamplingParams(1.5), eos_token_id=eos, generator=gen
        ).tokens.tolist()
        assert eos not in out[:-1]
    return eos


@SAMPLED_REGIMES
@BOTH_VOCABS
def test_chain_q_rows_are_the_warped_sequential_drafts(
    params, draft_temperature, vocab, eagle3_verifiers, monkeypatch
):
    """Each q row is the drafter's sequential-forward logits divided by ``draft_temperature``, warped like
    the verifier's (temperature, top-k), at the target ids."""
    verifier, drafter, records = sampled_drafts(
        eagle3_verifiers["llama"],
        vocab,
        params,
        monkeypatch,
        sampled_chain=True,
        draft_temperature=draft_temperature,
    )
    vocab_size = verifier.config.vocab_size
    for sequence, draft, cached in records:
        assert draft.is_chain and 1 <= len(draft) <= 4 and draft.q is not None
        assert cached == len(sequence) - 1  # the chain's nodes left the cache
        assert draft.support is not None and torch.equal(draft.support, drafter.draft_ids)  # q kept compact
        q = draft.dense_q(vocab_size)
        for i, token in enumerate(draft.tokens):
            logits = sequential_children(verifier, drafter, sequence, draft, i - 1)
            warped = warp(logits.float() / draft_temperature, params)
            want = torch.zeros(vocab_size).index_copy_(0, drafter.draft_ids, warped)
            torch.testing.assert_close(q[i], want, atol=1e-5, rtol=1e-4)
            assert q[i, token] > 0 and int(drafter.draft_ids[draft.columns[i]]) == token


def test_temperature_zero_keeps_the_tree_and_the_greedy_output(eagle3_verifiers, monkeypatch):
    verifier = eagle3_verifiers["qwen3"]
    decoder = Eagle3Decoder(verifier, drafter_for(verifier, "reduced"), 4, 3, 10, sampled_chain=True)
    spy = ChainSpy(monkeypatch)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        reference = hf_greedy(verifier, ids, 17)
        assert decoder.generate(ids, 17).tokens.tolist() == reference
    assert any(not draft.is_chain for _, draft, _ in spy.records)  # trees at T = 0
    assert all(draft.q is None for _, draft, _ in spy.records)


def test_a_sampled_chain_stops_at_eos_and_within_the_budget(eagle3_verifiers, monkeypatch):
    """Drafting stops after an eos. Checked only on the drafts made under that eos: the helper's first
    decodes pass no ``eos_token_id``, and there its id is an ordinary token (a check over every draft
    held only while no such draft happened to carry it)."""
    verifier = eagle3_verifiers["llama"]
    drafted = drafts_under_eos(monkeypatch)
    decoder = Eagle3Decoder(verifier, drafter_for(verifier), 5, 2, 8, sampled_chain=True)
    eos = stops_at_the_limit_and_at_eos(decoder)
    under_eos = [draft for stop, draft in drafted if stop]
    assert under_eos and all(stop == {eos} for stop, _ in drafted if stop)
    assert any(draft.tokens[-1] == eos for draft in under_eos)  # not vacuous: an eos was drafted
    for draft in under_eos:
        assert eos not in draft.tokens[:-1]  # drafting stops after an eos


# 4,000 seeded decodes (~65 s): slow, as the other break-on-purpose law tests; the law test it breaks
# runs by default (test_eagle3_decoding.py)
@pytest.mark.slow
def test_a_chain_with_the_wrong_q_is_caught(eagle3_law_verifier, monkeypatch):
    """Broken on purpose: each node after the first is handed the q of the node before it (off by one), so
    the rule weighs the token by a distribution it was not drawn from. (Dropping q altogether would not be
    a bug: a candidate drawn independently of the verifier's randomness may be verified as a point mass,
    losslessly but with lower acceptance.)"""
    sample_chain = Eagle3Proposer._chain_of

    def off_by_one(self, *args):
        draft, forwards, confidences = sample_chain(self, *args)
        q = torch.cat([draft.q[:1], draft.q[:-1]])
        return (
            Draft.chain(draft.tokens, q, support=draft.support, columns=draft.columns),
            forwards,
            confidences,
        )

    monkeypatch.setattr(Eagle3Proposer, "_chain_of", off_by_one)
    stat, df, _ = law_statistic(eagle3_law_verifier, SamplingParams(1.0), sampled_chain=True)
    assert stat > chi2_critical(df), (stat, df)


@pytest.mark.parametrize("value", [0.0, -1.0, True])
def test_draft_temperature_must_be_positive(eagle3_verifiers, value):
    verifier = eagle3_verifiers["llama"]
    with pytest.raises(ValueError, match="draft_temperature must be > 0"):
        Eagle3Decoder(verifier, drafter_for(verifier), 4, 3, 10, sampled_chain=True, draft_temperature=value)
