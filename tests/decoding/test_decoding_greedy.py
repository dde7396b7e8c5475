"""Greedy losslessness against Hugging Face generate, EOS / truncation cases, vocab alignment, errors."""

from __future__ import annotations

import copy

import pytest
import torch

from train.decoding import AutoregressiveDecoder, SamplingParams, SpeculativeDecoder

from .decoding_helpers import EOS, TableLM, build, hf_greedy, tiny_config


def prompt(n: int = 8, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_greedy_matches_hf_generate(tiny_pairs, arch):
    verifier, drafter = tiny_pairs[arch]
    for seed in (0, 1):
        ids = prompt(6 + 5 * seed, seed)
        ref = torch.tensor(hf_greedy(verifier, ids, 24, eos=None))
        ar = AutoregressiveDecoder(verifier).generate(ids, 24)
        assert torch.equal(ar.tokens, ref)
        assert ar.stats.verifier_calls == 24 and ar.stats.drafted == 0
        for gamma in (1, 2, 4, 7):
            res = SpeculativeDecoder(verifier, drafter, gamma=gamma).generate(ids, 24)
            assert torch.equal(res.tokens, ref), (arch, gamma, seed)
            s = res.stats
            assert s.new_tokens == 24
            assert 1 <= s.new_tokens / s.verifier_calls <= gamma + 1
            assert s.drafter_calls == s.drafted  # one drafter forward per drafted token
            assert s.accepted <= s.drafted


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_adaptive_draft_length_keeps_the_greedy_output(tiny_pairs, arch):
    """A confidence threshold ends some chains early (and lets others run to gamma); the output is
    still the verifier's greedy one, and every stop follows a draft below the threshold."""
    verifier, drafter = tiny_pairs[arch]
    sharp = copy.deepcopy(drafter)
    with torch.no_grad():  # a random tiny drafter is near uniform over 128 ids: spread its confidences
        sharp.get_output_embeddings().weight.mul_(12.0 if arch == "gpt2" else 40.0)  # medians 0.5-0.9
    gamma = 5
    for seed in (0, 1):
        ids = prompt(6 + 5 * seed, seed)
        ref = hf_greedy(verifier, ids, 32, eos=None)
        res = SpeculativeDecoder(verifier, sharp, gamma=gamma, confidence_threshold=0.5).generate(ids, 32)
        assert res.tokens.tolist() == ref, (arch, seed)
        drafted = res.stats.position_drafted
        assert drafted[0] > drafted[-1] > 0, drafted  # some chains stopped early, some ran to gamma
        assert res.stats.drafter_calls == res.stats.drafted


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_self_drafting_accepts_everything(tiny_pairs, arch):
    verifier, _ = tiny_pairs[arch]
    ids = prompt()
    res = SpeculativeDecoder(verifier, verifier, gamma=3).generate(ids, 16)
    assert res.tokens.tolist() == hf_greedy(verifier, ids, 16, eos=None)
    assert res.stats.accepted == res.stats.drafted
    assert res.stats.verifier_calls == 4  # 16 tokens / (gamma + 1)
    assert res.stats.sum_expected_acceptance == res.stats.tested


def test_eos_matches_hf(llama_pair):
    verifier, drafter = llama_pair
    ids = prompt(seed=3)
    free = hf_greedy(verifier, ids, 30, eos=None)
    eos = free[10]  # a token that the greedy continuation produces at position >= 10
    first = free.index(eos)
    ref = torch.tensor(hf_greedy(verifier, ids, 30, eos=eos))
    assert ref.tolist() == free[: first + 1]
    assert AutoregressiveDecoder(verifier).generate(ids, 30, eos_token_id=eos).tokens.tolist() == ref.tolist()
    for gamma in (1, 3, 5):
        res = SpeculativeDecoder(verifier, drafter, gamma=gamma).generate(ids, 30, eos_token_id=eos)
        assert res.tokens.tolist() == ref.tolist()
        assert res.stats.new_tokens == first + 1
        # several EOS ids (any of them stops)
        res = SpeculativeDecoder(verifier, drafter, gamma=gamma).generate(ids, 30, eos_token_id=[9999, eos])
        assert res.tokens.tolist() == ref.tolist()


@pytest.mark.parametrize("n", [1, 2, 5, 6, 11])
def test_max_new_tokens_mid_block(llama_pair, n):
    verifier, _ = llama_pair
    ids = prompt(seed=4)
    ref = torch.tensor(hf_greedy(verifier, ids, n, eos=None))
    for gamma in (1, 4, 7):
        res = SpeculativeDecoder(verifier, verifier, gamma=gamma).generate(ids, n)
        assert torch.equal(res.tokens, ref)
        assert res.stats.new_tokens == n


def chain_table(vocab: int, chain: list[int], strength: float = 10.0) -> torch.Tensor:
    """Logit table where token chain[i] is followed (almost surely) by chain[i + 1]."""
    table = torch.zeros(vocab, vocab)
    for a, b in zip(chain, chain[1:], strict=False):
        table[a, b] = strength
    return table


def test_eos_inside_draft_ends_without_bonus():
    # 5 -> 2 -> 3 -> EOS(1); both models agree, so the draft (which stops at EOS) is fully accepted
    table = chain_table(8, [5, 2, 3, EOS, 4])
    v, d = TableLM(table), TableLM(table)
    res = SpeculativeDecoder(v, d, gamma=6).generate(torch.tensor([[5]]), 20, eos_token_id=EOS)
    assert res.tokens.tolist() == [2, 3, EOS]
    s = res.stats
    assert s.verifier_calls == 1 and s.drafted == 3 and s.accepted == 3 and s.new_tokens == 3
    assert s.position_drafted == [1, 1, 1]  # grows with the deepest draft, not sized by gamma
    assert d.calls == 3
    # sampling regime, same behaviour (the chain is near-deterministic)
    res = SpeculativeDecoder(v, d, gamma=6).generate(
        torch.tensor([[5]]),
        20,
        SamplingParams(temperature=0.01),
        eos_token_id=EOS,
        generator=torch.Generator(),
    )
    assert res.tokens.tolist() == [2, 3, EOS]
    assert res.stats.verifier_calls == 1


def test_eos_as_bonus_token():
    table = chain_table(8, [5, 2, 3, EOS])
    v, d = TableLM(table), TableLM(table)
    res = SpeculativeDecoder(v, d, gamma=2).generate(torch.tensor([[5]]), 20, eos_token_id=EOS)
    assert res.tokens.tolist() == [2, 3, EOS]
    assert res.stats.verifier_calls == 1 and res.stats.accepted == 2 and res.stats.drafted == 2


def test_eos_drafted_but_rejected_continues():
    v = TableLM(chain_table(8, [5, 2, 3, 6, 7, 4]))
    d = TableLM(chain_table(8, [5, 2, EOS]))
    res = SpeculativeDecoder(v, d, gamma=4).generate(torch.tensor([[5]]), 5, eos_token_id=EOS)
    assert res.tokens.tolist() == [2, 3, 6, 7, 4]


def test_eos_as_correction_token():
    v = TableLM(chain_table(8, [5, 2, EOS]))
    d = TableLM(chain_table(8, [5, 2, 3, 6]))
    res = SpeculativeDecoder(v, d, gamma=3).generate(torch.tensor([[5]]), 10, eos_token_id=EOS)
    assert res.tokens.tolist() == [2, EOS]
    assert res.stats.accepted == 1 and res.stats.position_tested == [1, 1, 0]


def test_gamma_one_counts(llama_pair):
    verifier, drafter = llama_pair
    res = SpeculativeDecoder(verifier, drafter, gamma=1).generate(prompt(), 12)
    s = res.stats
    assert s.position_drafted[0] == s.drafted >= s.verifier_calls - 1  # the last block may draft 0
    assert len(s.position_drafted) == 1
    assert s.position_tested == s.position_drafted
    assert s.verifier_calls == s.new_tokens - s.accepted


@pytest.mark.parametrize(("v_vocab", "d_vocab"), [(160, 128), (128, 150)])
def test_vocab_alignment_keeps_the_verifier_whole(v_vocab, d_vocab):
    """Output sizes differ (padded embeddings): the output is still exactly the verifier's.

    (160, 128): the verifier's rows past 128 are made attractive, so it emits ids the drafter can
    neither propose nor embed; the drafter must be fed them safely and greedy output must equal plain
    greedy decoding over the verifier's whole vocabulary (the old decoder cut p to 128 ids and
    diverged). (128, 150): the drafter's extra rows are attractive; it must never propose them.
    """
    verifier = build(tiny_config("qwen3", 64, vocab=v_vocab), 5)
    drafter = build(tiny_config("qwen3", 32, vocab=d_vocab), 6)
    common = min(v_vocab, d_vocab)
    with torch.no_grad():
        for m, v in ((verifier, v_vocab), (drafter, d_vocab)):
            if v > common:
                m.get_output_embeddings().weight[common:] = 5 * m.get_output_embeddings().weight[:1]
    ids = prompt(vocab=common)
    ref = AutoregressiveDecoder(verifier).generate(ids, 15).tokens.tolist()
    with torch.no_grad():
        hf = verifier.generate(ids, max_new_tokens=15, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ref == hf[0, ids.shape[1] :].tolist()
    if v_vocab > d_vocab:
        assert max(ref) >= common  # the case under test: the verifier emits ids the drafter lacks
    dec = SpeculativeDecoder(verifier, drafter, gamma=3)
    assert dec.vocab_size == v_vocab
    assert dec.generate(ids, 15).tokens.tolist() == ref
    res = dec.generate(ids, 40, SamplingParams(temperature=1.5), generator=torch.Generator().manual_seed(0))
    assert res.tokens.max() < v_vocab and len(res.tokens) == 40


def test_max_new_tokens_zero(llama_pair):
    verifier, drafter = llama_pair
    for dec in (SpeculativeDecoder(verifier, drafter), AutoregressiveDecoder(verifier)):
        res = dec.generate(prompt(), 0)
        assert res.tokens.shape == (0,) and res.tokens.dtype == torch.long
        assert res.stats.new_tokens == 0 and res.stats.verifier_calls == 0


def test_bad_inputs(llama_pair):
    verifier, drafter = llama_pair
    for g in (0, -1):
        with pytest.raises(ValueError, match="gamma"):
            SpeculativeDecoder(verifier, drafter, gamma=g)
    with pytest.raises(ValueError, match="lenience"):
        SpeculativeDecoder(verifier, drafter, lenience="cubic", eps=0.5)
    for eps in (0.0, 1.5):
        with pytest.raises(ValueError, match="eps"):
            SpeculativeDecoder(verifier, drafter, lenience="linear", eps=eps)
    for t in (-0.1, 1.0):
        with pytest.raises(ValueError, match="confidence_threshold"):
            SpeculativeDecoder(verifier, drafter, confidence_threshold=t)
    for dec in (SpeculativeDecoder(verifier, drafter), AutoregressiveDecoder(verifier)):
        with pytest.raises(ValueError, match="empty prompt"):
            dec.generate(torch.zeros(1, 0, dtype=torch.long), 4)
        with pytest.raises(ValueError, match="max_position_embeddings"):
            dec.generate(prompt(10), 250)  # 10 + 250 > 256
        with pytest.raises(ValueError, match="batch size 1"):
            dec.generate(torch.zeros(2, 3, dtype=torch.long), 4)
        with pytest.raises(ValueError, match="max_new_tokens"):
            dec.generate(prompt(), -1)
        with pytest.raises(TypeError, match="SamplingParams"):
            dec.generate(prompt(), 4, params={"temperature": 1.0})  # type: ignore[arg-type]
    # exactly at the limit is allowed; the drafter's limit is checked too
    small = TableLM(torch.zeros(8, 8), max_pos=16)
    assert len(SpeculativeDecoder(small, small).generate(torch.tensor([[3] * 6]), 10).tokens) == 10
    with pytest.raises(ValueError, match="max_position_embeddings"):
        SpeculativeDecoder(TableLM(torch.zeros(8, 8)), small).generate(torch.tensor([[3] * 6]), 11)
