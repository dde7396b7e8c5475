"""Eagle3Decoder's ``sampled_tree`` (RSD-C's tree at T > 0): every node's children are distinct tokens
drawn from its q, which is the drafter's warped distribution after the node's path (checked against a
cache-free sequential forward), at most ``branching[d]`` of them at depth d; the drafter's cache is back to
the committed positions after every draft; T = 0 keeps the deterministic tree. The law itself is tested
in test_eagle3_decoding.py (``T1-sampled-tree-sharper-q``); here a tree whose siblings are checked by the
wrong rule is caught by it."""

from __future__ import annotations

import pytest
import torch

from train.decoding import Draft, Eagle3Decoder, SamplingParams
from train.decoding.proposers.eagle3_proposer import Eagle3Proposer
from train.decoding.sampling import warp

from .decoding_helpers import hf_greedy
from .spec_reference import chi2_critical
from .test_eagle3_decoding import PROMPTS, drafter_for, law_statistic, sequential_children
from .test_eagle3_sampled_chain import (
    BOTH_VOCABS,
    SAMPLED_REGIMES,
    ChainSpy,
    drafts_under_eos,
    sampled_drafts,
    stops_at_the_limit_and_at_eos,
)


@SAMPLED_REGIMES
@BOTH_VOCABS
def test_tree_q_rows_are_the_parents_warped_sequential_drafts(
    params, draft_temperature, vocab, eagle3_verifiers, monkeypatch
):
    """Node i's q row is the drafter's logits after its *parent's* path (sequential, cache-free forward)
    divided by ``draft_temperature`` and warped, at the target ids; its siblings are distinct, in draw
    order, at most ``branching[depth]`` of them; nothing of the tree stays in the drafter's cache."""
    branching = [3, 2, 1]
    verifier, drafter, records = sampled_drafts(
        eagle3_verifiers["llama"],
        vocab,
        params,
        monkeypatch,
        sampled_tree=branching,
        draft_temperature=draft_temperature,
    )
    vocab_size = verifier.config.vocab_size
    branched = 0
    for sequence, draft, cached in records:
        assert draft.q is not None and draft.kind == "without_replacement"
        assert cached == len(sequence) - 1  # the tree's nodes left the cache
        depths = draft.depths()
        assert max(depths) <= len(branching)
        for parent in {-1, *range(len(draft))}:
            kids = draft.children(parent)
            if not kids:
                continue
            depth = 0 if parent < 0 else depths[parent]
            assert len(kids) <= branching[depth]
            assert len({draft.tokens[k] for k in kids}) == len(kids)  # without replacement
            assert [draft.rank[k] for k in kids] == list(range(len(kids)))
            branched += len(kids) > 1
            logits = sequential_children(verifier, drafter, sequence, draft, parent)
            warped = warp(logits.float() / draft_temperature, params)
            want = torch.zeros(vocab_size).index_copy_(0, drafter.draft_ids, warped)
            for k in kids:
                torch.testing.assert_close(draft.q[k], want, atol=1e-5, rtol=1e-4)
                assert draft.q[k, draft.tokens[k]] > 0
    assert branched > 0


def test_temperature_zero_keeps_the_deterministic_tree_and_the_greedy_output(eagle3_verifiers, monkeypatch):
    verifier = eagle3_verifiers["qwen3"]
    decoder = Eagle3Decoder(verifier, drafter_for(verifier, "reduced"), 4, 3, 10, sampled_tree=[2, 2, 1])
    spy = ChainSpy(monkeypatch)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        assert decoder.generate(ids, 17).tokens.tolist() == hf_greedy(verifier, ids, 17)
    assert all(draft.q is None for _, draft, _ in spy.records)


def test_a_sampled_tree_stops_at_eos_and_within_the_budget(eagle3_verifiers, monkeypatch):
    """A node drafting an eos gets no children. Checked only on the drafts made under that eos:
    the helper's first decodes pass no ``eos_token_id``, and there its id is an ordinary token."""
    verifier = eagle3_verifiers["llama"]
    drafted = drafts_under_eos(monkeypatch)  # every non-empty draft with its eos set
    decoder = Eagle3Decoder(verifier, drafter_for(verifier), 5, 2, 8, sampled_tree=[2, 2, 2, 1, 1])
    eos = stops_at_the_limit_and_at_eos(decoder)
    under_eos = [draft for stop, draft in drafted if stop]
    assert under_eos and all(stop == {eos} for stop, _ in drafted if stop)
    assert any(  # not vacuous: some eos was drafted above the last level, where it could have been expanded
        token == eos and depth < len(decoder.tree.sampled_tree)
        for draft in under_eos
        for token, depth in zip(draft.tokens, draft.depths(), strict=True)
    )
    for draft in under_eos:
        assert all(draft.tokens[p] != eos for p in draft.parents if p >= 0)  # an eos is never expanded


# 4,000 seeded decodes (~65 s): slow, as the other break-on-purpose law tests; the law test it breaks
# runs by default (test_eagle3_decoding.py)
@pytest.mark.slow
def test_a_tree_checked_with_replacement_is_caught(eagle3_law_verifier, monkeypatch):
    """Broken on purpose: the siblings are drawn without replacement but labelled i.i.d., so after a
    rejection the rule checks the next sibling against q instead of q without the rejected token."""
    sample_tree = Eagle3Proposer._sample_tree

    def mislabelled(self, *args):
        draft, forwards = sample_tree(self, *args)
        return Draft(draft.tokens, draft.parents, draft.q, draft.rank, kind="iid"), forwards

    monkeypatch.setattr(Eagle3Proposer, "_sample_tree", mislabelled)
    stat, df, _ = law_statistic(
        eagle3_law_verifier, SamplingParams(1.0), draft_temperature=0.6, sampled_tree=[3, 2, 1]
    )
    assert stat > chi2_critical(df), (stat, df)


@pytest.mark.parametrize("value", [[], [2, 0], [1.5], [True]])
def test_bad_branching_is_refused(eagle3_verifiers, value):
    verifier = eagle3_verifiers["llama"]
    with pytest.raises(ValueError, match="sampled_tree must be a non-empty list of integers >= 1"):
        Eagle3Decoder(verifier, drafter_for(verifier), 4, 3, 10, sampled_tree=value)


def test_a_sampled_chain_and_a_sampled_tree_exclude_each_other(eagle3_verifiers):
    verifier = eagle3_verifiers["llama"]
    with pytest.raises(ValueError, match="exclude each other"):
        Eagle3Decoder(verifier, drafter_for(verifier), 4, 3, 10, sampled_chain=True, sampled_tree=[2, 1])
