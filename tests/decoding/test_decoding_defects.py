"""Decoder-level guards for known defect classes, through the public API only.

- vocabulary alignment: verifier output 160 ids, drafter 128 (one tokenizer; the drafter can neither
  propose nor embed ids >= 128): greedy output equals AutoregressiveDecoder's and HF generate's on the
  verifier, the verifier's ids >= 128 do not crash the drafter, and sampling stays exact (ids the
  drafter lacks are emitted with the verifier's probability);
- generators: output depends only on the torch.Generator passed (same seed, same tokens; the global
  RNG is irrelevant);
- metric plumbing: mbsu from the drafter calls actually made, verifier tokens per call;
- several EOS ids: generation stops at whichever comes first.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from train.decoding import (
    AutoregressiveDecoder,
    SamplingParams,
    SpeculativeDecoder,
    summarize,
)

from .decoding_helpers import build, hf_greedy, random_table_lm, tiny_config
from .spec_reference import (
    ExactSpec,
    chi2_critical,
    chi_square,
    mean_and_se,
    per_run,
    reference_greedy,
    run_many,
    table_next,
    trim,
    verifier_joint,
)

T1 = SamplingParams(temperature=1.0)
Z = 4.5


def prompt_ids(seed: int, n: int = 6, vocab: int = 128) -> torch.Tensor:
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- vocabulary alignment


@pytest.fixture(scope="module")
def wide_verifier_pair():
    """(verifier with 160 output ids that emits 150 and other ids >= 128, drafter with 128 ids).

    The drafter is the verifier's perturbed copy cut to the first 128 ids (embeddings and head), so
    blocks accept several tokens and the drafter's cache and inputs are exercised past the ids it
    lacks. The verifier's rows >= 128 are damped, except row 150, made a slightly stronger copy of a
    row it often picks: it emits 150 now and then and the drafter can follow the rest.
    """
    verifier = build(tiny_config("llama", 64, vocab=160), 5)
    with torch.no_grad():
        head = verifier.get_output_embeddings().weight
        head[128:] *= 0.3  # wide ids rare, so the drafter can still follow most of the text
        head[150] = 1.2 * head[114]
    drafter = build(tiny_config("llama", 64, vocab=128), 6)
    state = {}
    g = torch.Generator().manual_seed(7)
    for name, value in verifier.state_dict().items():
        if value.shape and value.shape[0] == 160:
            value = value[:128]
        noise = torch.randn(value.shape, generator=g) * 0.05 * value.std() if value.numel() > 1 else 0
        state[name] = value + noise
    drafter.load_state_dict(state)
    return verifier, drafter.eval()


def test_wide_verifier_greedy_equals_autoregressive_and_hf(wide_verifier_pair):
    """Greedy speculative output == AutoregressiveDecoder == HF generate over the verifier's whole
    vocabulary; the verifier emits ids the drafter cannot embed (150 among them) and nothing crashes.
    A decoder that cuts p to the common 128 ids diverges at the first id >= 128."""
    verifier, drafter = wide_verifier_pair
    seen_wide, seen_150 = False, False
    for seed in (0, 1, 2):
        ids = prompt_ids(seed)
        ref = AutoregressiveDecoder(verifier).generate(ids, 24).tokens.tolist()
        assert ref == hf_greedy(verifier, ids, 24)
        seen_wide |= max(ref) >= 128
        seen_150 |= 150 in ref
        for gamma in (1, 2, 4):
            res = SpeculativeDecoder(verifier, drafter, gamma=gamma).generate(ids, 24)
            assert res.tokens.tolist() == ref, (seed, gamma)
            assert res.stats.accepted <= res.stats.drafted
    assert seen_wide and seen_150


def test_wide_verifier_counts_equal_reference(wide_verifier_pair):
    """Counts equal the cache-free reference (which feeds ids the drafter lacks as its pad id 0)."""
    verifier, drafter = wide_verifier_pair
    ids = prompt_ids(0)
    for gamma in (2, 4):
        ref = reference_greedy(verifier, drafter, ids[0].tolist(), 24, gamma, drafter_pad_id=0)
        s = SpeculativeDecoder(verifier, drafter, gamma=gamma).generate(ids, 24).stats
        assert (s.accepted, s.drafted, s.verifier_calls, s.drafter_calls) == (
            ref.accepted,
            ref.drafted,
            ref.verifier_calls,
            ref.drafter_calls,
        )
        # blocks accept several drafts around the wide ids, so stale drafter state would show
        assert ref.accepted >= 0.3 * ref.drafted and len(trim(ref.position_accepted)) >= 2


def test_wide_verifier_sampling_does_not_crash(wide_verifier_pair):
    verifier, drafter = wide_verifier_pair
    dec = SpeculativeDecoder(verifier, drafter, gamma=3)
    res = dec.generate(
        prompt_ids(3), 40, SamplingParams(temperature=1.5), generator=torch.Generator().manual_seed(0)
    )
    assert len(res.tokens) == 40 and int(res.tokens.max()) < 160


@pytest.mark.parametrize(("v_vocab", "d_vocab"), [(6, 4), (4, 6)])
def test_mismatched_vocab_sampling_is_exact(v_vocab, d_vocab):
    """TableLM fakes of different sizes, gamma 3, EOS = 3, N = 3000: the output law is the verifier's.

    (6, 4): ids 4 and 5 exist only for the verifier; they carry ~1/3 of its mass, so a decoder that cut
    p to the common ids would never emit them (chi-square infinite). The drafter is fed id 0 for them.
    (4, 6): the drafter's extra ids are strongly preferred by it; it must never propose them, and its
    proposal is its distribution over the common ids (counts checked against the exact law).
    """
    verifier = random_table_lm(v_vocab, 21)
    drafter = random_table_lm(d_vocab, 22)
    if d_vocab > v_vocab:
        drafter.table[:, v_vocab:] += 3.0
    prompt, max_new, gamma, n, eos = (2, 0), 4, 3, 3000, 3
    target = verifier_joint(table_next(verifier, T1), prompt, max_new, (eos,))
    wide_mass = sum(p for k, p in target.items() if any(t >= min(v_vocab, d_vocab) for t in k))
    if v_vocab > d_vocab:
        assert wide_mass > 0.3
    dec = SpeculativeDecoder(verifier, drafter, gamma=gamma)
    runs = run_many(dec, prompt, max_new, T1, n, seed=0, eos=eos)
    stat, df = chi_square(runs.counts, target, n)
    assert stat < chi2_critical(df), (stat, df)
    accepted, tested = sum(per_run(runs, "accepted")), sum(per_run(runs, "tested"))
    expected = sum(per_run(runs, "sum_expected"))
    a = expected / tested
    assert abs(accepted - expected) <= Z * math.sqrt(tested * a * (1 - a))
    assert accepted > 0
    if d_vocab > v_vocab:  # the drafter's law over the common ids: counts match the exact expectations
        want = ExactSpec(
            table_next(verifier, T1), table_next(drafter, T1, v_vocab), prompt, max_new, gamma, (eos,)
        ).expectations()
        for name in ("accepted", "tested", "sum_expected"):
            m, se = mean_and_se(per_run(runs, name))
            assert abs(m - want[name]) <= Z * se, (name, m, want[name])


# ---------------------------------------------------------------- generators


def test_same_generator_seed_same_output(llama_pair):
    """Sampling depends only on the generator: the same seed gives the same tokens and counts, whatever
    the global RNG did in between; another seed gives other tokens."""
    verifier, drafter = llama_pair
    ids = prompt_ids(4)
    params = SamplingParams(temperature=1.0, top_k=50)
    for dec in (SpeculativeDecoder(verifier, drafter, gamma=3), AutoregressiveDecoder(verifier)):
        torch.manual_seed(1)
        a = dec.generate(ids, 20, params, generator=torch.Generator().manual_seed(123))
        torch.manual_seed(2)
        torch.rand(17)
        b = dec.generate(ids, 20, params, generator=torch.Generator().manual_seed(123))
        assert a.tokens.tolist() == b.tokens.tolist()
        assert (a.stats.accepted, a.stats.drafted, a.stats.verifier_calls) == (
            b.stats.accepted,
            b.stats.drafted,
            b.stats.verifier_calls,
        )
        others = [
            dec.generate(ids, 20, params, generator=torch.Generator().manual_seed(s)).tokens.tolist()
            for s in (5, 6, 7)
        ]
        assert any(o != a.tokens.tolist() for o in others)


def test_generator_state_advances_between_calls(llama_pair):
    """One generator threaded through two calls gives the same two outputs as a fresh generator with
    the same seed threaded the same way (nothing else feeds the draws)."""
    verifier, drafter = llama_pair
    dec = SpeculativeDecoder(verifier, drafter, gamma=2)
    ids = prompt_ids(5)
    outs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(9)
        outs.append([dec.generate(ids, 12, T1, generator=g).tokens.tolist() for _ in range(2)])
    assert outs[0] == outs[1]


# ---------------------------------------------------------------- mbsu and verifier tokens


def test_verifier_tokens_per_call_is_gamma_plus_one_on_full_blocks(llama_pair):
    """Self-drafting at T = 0 accepts every draft: every block drafts gamma tokens and the verifier
    scores gamma + 1 per call; drafter calls per verifier call are gamma."""
    verifier, _ = llama_pair
    twin = copy.deepcopy(verifier)
    for gamma in (1, 3, 4):
        s = SpeculativeDecoder(verifier, twin, gamma=gamma).generate(prompt_ids(0), 3 * (gamma + 1)).stats
        assert s.verifier_calls == 3 and s.drafted == 3 * gamma
        summary = summarize(s, c_param=0.25)
        assert summary["verifier_tokens_per_call"] == gamma + 1
        assert s.verifier_tokens == s.drafted + s.verifier_calls
        assert summary["drafter_calls_per_verifier_call"] == gamma
        assert summary["mbsu"] == pytest.approx((gamma + 1) / (0.25 * gamma + 1))


def test_mbsu_uses_drafter_calls_actually_made(llama_pair):
    """A short final block and an EOS inside a draft cost fewer drafter steps than gamma; mbsu must use
    drafter_calls / verifier_calls, not gamma."""
    verifier, drafter = llama_pair
    twin = copy.deepcopy(verifier)
    ids = prompt_ids(0)
    free = SpeculativeDecoder(verifier, twin, gamma=4).generate(ids, 30).tokens.tolist()
    for dec_drafter, max_new, eos in ((twin, 7, None), (twin, 30, free[6]), (drafter, 13, None)):
        s = SpeculativeDecoder(verifier, dec_drafter, gamma=4).generate(ids, max_new, eos_token_id=eos).stats
        c = 0.3
        tau = s.new_tokens / s.verifier_calls
        steps = s.drafter_calls / s.verifier_calls
        summary = summarize(s, c_param=c)
        assert summary["mbsu"] == pytest.approx(tau / (c * steps + 1))
        assert summary["verifier_tokens_per_call"] == pytest.approx(
            (s.drafted + s.verifier_calls) / s.verifier_calls
        )
        assert s.verifier_tokens == s.drafted + s.verifier_calls
        if dec_drafter is twin:
            assert steps < 4  # the case under test: fewer drafter steps than gamma
            assert summary["mbsu"] != pytest.approx(tau / (c * 4 + 1))


# ---------------------------------------------------------------- several EOS ids


def test_several_eos_ids_stop_at_either(tiny_pairs):
    """eos_token_id=[a, b]: stop after the first of either (included), like HF generate; with a
    list, a tuple or a tensor, speculative and autoregressive alike. Pairs are chosen both ways round
    (the id met first is the larger one, then the smaller one), so a decoder that honours only one
    id of the set (the first, the smallest, ...) fails one of them."""
    for arch in ("llama", "qwen3"):
        verifier, drafter = tiny_pairs[arch]
        ids = prompt_ids(1)
        free = AutoregressiveDecoder(verifier).generate(ids, 24).tokens.tolist()
        firsts: dict[int, int] = {}
        for i, t in enumerate(free):
            firsts.setdefault(t, i)
        order = [t for t, _ in sorted(firsts.items(), key=lambda kv: kv[1])][1:]  # met after 1 token
        bigger_first = next((x, y) for i, x in enumerate(order) for y in order[i + 1 :] if x > y)
        smaller_first = next((x, y) for i, x in enumerate(order) for y in order[i + 1 :] if x < y)
        for early, late in (bigger_first, smaller_first):
            want = free[: firsts[early] + 1]
            assert hf_greedy(verifier, ids, 24, eos=[late, early]) == want
            for eos in ([early, late], (late, early), torch.tensor([late, early])):
                for dec in (SpeculativeDecoder(verifier, drafter, gamma=3), AutoregressiveDecoder(verifier)):
                    assert dec.generate(ids, 24, eos_token_id=eos).tokens.tolist() == want, (arch, eos)
            # the later id alone: runs until it
            only_late = SpeculativeDecoder(verifier, drafter, gamma=3).generate(ids, 24, eos_token_id=[late])
            assert only_late.tokens.tolist() == free[: firsts[late] + 1]


def test_several_eos_ids_sampled():
    """Sampling with eos [1, 3] on a fake: every output stops at its first EOS of either id and the
    output law is the verifier's (N = 2000, gamma 3)."""
    verifier, drafter = random_table_lm(5, 31), random_table_lm(5, 32)
    prompt, max_new, n = (2, 0), 4, 2000
    target = verifier_joint(table_next(verifier, T1), prompt, max_new, (1, 3))
    runs = run_many(
        SpeculativeDecoder(verifier, drafter, gamma=3), prompt, max_new, T1, n, seed=3, eos=[1, 3]
    )
    for out in runs.counts:
        assert all(t not in (1, 3) for t in out[:-1])
        assert len(out) == max_new or out[-1] in (1, 3)
    assert any(o and o[-1] == 1 for o in runs.counts) and any(o and o[-1] == 3 for o in runs.counts)
    stat, df = chi_square(runs.counts, target, n)
    assert stat < chi2_critical(df)
