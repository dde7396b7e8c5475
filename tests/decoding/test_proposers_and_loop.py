"""The drafting side (ModelProposer) and the synchronous loop's statistics."""

from __future__ import annotations

import math

import torch

from train.decoding import DecodeStats, Draft, ModelProposer, SamplingParams, SpeculativeDecoder, TimedModel

from .decoding_helpers import EOS, TableLM, build, random_table_lm, tiny_config

GREEDY = SamplingParams()
HOT = SamplingParams(temperature=1.0)


def test_draft_structure():
    chain = Draft.chain([4, 5, 6])
    assert chain.parents == [-1, 0, 1] and chain.is_chain and chain.depths() == [1, 2, 3]
    tree = Draft(tokens=[4, 5, 6, 7], parents=[-1, -1, 0, 0], rank=[0, 1, 1, 0])
    assert not tree.is_chain and tree.depths() == [1, 1, 2, 2]
    assert tree.children(-1) == [0, 1] and tree.children(0) == [3, 2]
    for bad in (dict(tokens=[1], parents=[0]), dict(tokens=[1, 2], parents=[-1])):
        try:
            Draft(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


def test_proposer_q_is_over_the_verifier_vocabulary_with_zero_mass_beyond_the_drafter():
    drafter = random_table_lm(5, seed=1)
    proposer = ModelProposer(TimedModel(drafter), vocab_size=8)
    proposer.start()
    stats = DecodeStats()
    draft = proposer.propose([2, 3], 3, HOT, torch.Generator().manual_seed(0), frozenset(), stats)
    assert draft.q is not None and draft.q.shape == (3, 8)
    assert bool((draft.q[:, 5:] == 0).all())
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(3))
    assert max(draft.tokens) < 5
    assert stats.drafter_calls == 3 and stats.drafter_prefill_calls == 1
    # a larger drafter only proposes ids the verifier has
    big = ModelProposer(TimedModel(random_table_lm(9, seed=2)), vocab_size=6)
    big.start()
    d = big.propose([1], 4, HOT, torch.Generator().manual_seed(0), frozenset(), DecodeStats())
    assert d.q is not None and d.q.shape == (4, 6) and max(d.tokens) < 6


def test_proposer_feeds_unembeddable_ids_as_its_pad_id_and_crops_on_commit():
    drafter = build(tiny_config("llama", 32, vocab=16), 3)  # pad_token_id = 0 (BOS) in the helpers
    proposer = ModelProposer(TimedModel(drafter), vocab_size=20)
    proposer.start()
    stats = DecodeStats()
    proposer.propose([2, 19, 3], 2, GREEDY, None, frozenset(), stats)  # 19 cannot be embedded
    assert proposer._length == 4  # 3 committed + 1 draft fed
    proposer.commit(3)
    assert proposer._length == 3 and proposer._cache.get_seq_length() == 3
    proposer.commit(10)  # nothing to drop
    assert proposer._length == 3


def test_proposer_stops_at_eos():
    table = torch.full((8, 8), -10.0)
    table[5, 2] = table[2, EOS] = table[EOS, 4] = 10.0
    proposer = ModelProposer(TimedModel(TableLM(table)), vocab_size=8)
    proposer.start()
    draft = proposer.propose([5], 6, GREEDY, None, frozenset({EOS}), DecodeStats())
    assert draft.tokens == [2, EOS] and draft.q is None


def test_loop_counts_budget_rollbacks_discards_and_prefill():
    verifier, drafter = random_table_lm(6, seed=10), random_table_lm(6, seed=11)
    res = SpeculativeDecoder(verifier, drafter, gamma=3).generate(torch.tensor([[1, 2]]), 30)
    s = res.stats
    assert s.verifier_prefill_calls == 1 and s.drafter_prefill_calls == 1
    assert 0 < s.verifier_prefill_time <= s.verifier_time
    # every call scores the drafts + 1 token
    assert s.verifier_tokens == s.drafted + s.verifier_calls
    assert s.rollbacks >= 1 and s.rollbacks <= s.verifier_calls
    assert s.discarded == s.drafted - s.tested
    assert sum(s.position_drafted) == s.drafted and sum(s.position_accepted) == s.accepted
    assert sum(s.position_tested) == s.tested
    assert s.new_tokens == 30 == s.accepted + s.verifier_calls  # no EOS: one verifier token per call


def test_draft_confidence_is_the_drafted_tokens_probability():
    """From logits (greedy drafting) it is the softmax at the token; from a distribution, its entry."""
    from train.decoding.proposers.model_proposer import draft_confidence

    logits = torch.log(torch.tensor([1.0, 3.0, 4.0]))
    assert abs(draft_confidence(logits.to(torch.bfloat16), 2, True) - 0.5) < 1e-2
    assert abs(draft_confidence(logits, 1, True) - 0.375) < 1e-6
    assert draft_confidence(torch.tensor([0.1, 0.7, 0.2]), 2, False) == torch.tensor(0.2).item()


def test_a_confident_drafter_drafts_to_the_cap_and_an_unsure_one_stops_after_one():
    """The stop follows the threshold: a table drafter with q(x) = 0.9 drafts gamma tokens per block at
    t = 0.5 and one at t = 0.95 (the unsure draft itself is proposed)."""
    table = torch.full((8, 8), math.log(0.1 / 7))
    table[:, 5] = math.log(0.9)  # every row: token 5 with probability 0.9
    drafter = TableLM(table)
    proposer = ModelProposer(TimedModel(drafter), 8, confidence_threshold=0.5)
    proposer.start()
    stats = DecodeStats(max_draft=4)
    assert proposer.propose([1, 2], 4, SamplingParams(), None, frozenset(), stats).tokens == [5] * 4
    unsure = ModelProposer(TimedModel(drafter), 8, confidence_threshold=0.95)
    unsure.start()
    assert unsure.propose([1, 2], 4, SamplingParams(), None, frozenset(), stats).tokens == [5]
