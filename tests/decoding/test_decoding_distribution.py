"""Sampling losslessness: the emitted distribution equals the warped verifier distribution.

The models are table-driven fakes on a 4-token vocabulary (next-token logits depend on the last token
and its position), so the exact joint distribution of the first three emitted tokens can be enumerated
and compared with a chi-square test over several seeds.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from train.decoding import SamplingParams, SpeculativeDecoder, acceptance_rate, expected_acceptance, warp

from .decoding_helpers import TableLM, random_table_lm

V = 4
N_SAMPLES = 1000
PROMPT = [2, 0]


def exact_joint(verifier: TableLM, params: SamplingParams, n: int) -> dict[tuple[int, ...], float]:
    """P(x_1..x_n) under the warped verifier, by enumeration."""
    out = {}
    for seq in itertools.product(range(V), repeat=n):
        prefix, prob = list(PROMPT), 1.0
        for x in seq:
            prob *= float(warp(verifier.next_logits(prefix), params)[x])
            prefix.append(x)
        out[seq] = prob
    return out


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) (Wilson-Hilferty), z = 3.719 <=> alpha = 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(
    counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float], n: int
) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom; cells with expected count < 5 are pooled."""
    assert all(probs.get(k, 0.0) > 0 for k in counts), "a zero-probability sequence was emitted"
    stat, df, pooled_o, pooled_e = 0.0, -1, 0, 0.0
    for key, p in probs.items():
        e, o = n * p, counts.get(key, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
        else:
            stat += (o - e) ** 2 / e
            df += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        df += 1
    return stat, max(df, 1)


def run_sampling(verifier, drafter, params, gamma, seed, n_tokens=3, n=N_SAMPLES, **kw):
    dec = SpeculativeDecoder(verifier, drafter, gamma=gamma, **kw)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT])
    counts: dict[tuple[int, ...], int] = {}
    stats = None
    for _ in range(n):
        res = dec.generate(ids, n_tokens, params, generator=gen)
        key = tuple(res.tokens.tolist())
        counts[key] = counts.get(key, 0) + 1
        stats = res.stats if stats is None else stats.merge(res.stats)
    return counts, stats


def disjoint_pair() -> tuple[TableLM, TableLM]:
    g = torch.Generator().manual_seed(7)
    tv, td = torch.randn(V, V, generator=g), torch.randn(V, V, generator=g)
    tv[:, :2] = -1e4  # verifier only emits {2, 3}
    td[:, 2:] = -1e4  # drafter only proposes {0, 1}
    return TableLM(tv), TableLM(td)


CASES = {
    "q!=p T=1": (SamplingParams(temperature=1.0), False),
    "q!=p T=0.7 top_k=3": (SamplingParams(temperature=0.7, top_k=3), False),
    "q!=p T=1.3 top_p=0.8": (SamplingParams(temperature=1.3, top_p=0.8), False),
    "q!=p T=1 top_k=2 top_p=0.9": (SamplingParams(temperature=1.0, top_k=2, top_p=0.9), False),
    "q==p T=1": (SamplingParams(temperature=1.0), True),
}


RUNS = [  # (case, gamma, seeds): several seeds overall, kept small so the suite stays fast
    ("q!=p T=1", 1, (0, 1)),
    ("q!=p T=1", 2, (2, 3)),
    ("q!=p T=0.7 top_k=3", 2, (4,)),
    ("q!=p T=1.3 top_p=0.8", 2, (5,)),
    ("q!=p T=1 top_k=2 top_p=0.9", 1, (6,)),
    ("q==p T=1", 2, (7,)),
]


@pytest.mark.parametrize(("case", "gamma", "seeds"), RUNS)
def test_emitted_distribution_matches_verifier(case, gamma, seeds):
    params, same = CASES[case]
    verifier = random_table_lm(V, seed=11)
    drafter = verifier if same else random_table_lm(V, seed=12)
    probs = exact_joint(verifier, params, 3)
    for seed in seeds:
        counts, stats = run_sampling(verifier, drafter, params, gamma, seed)
        stat, df = chi_square(counts, probs, N_SAMPLES)
        assert stat < chi2_critical(df), (case, gamma, seed, stat, df)
        if same:
            assert stats.accepted == stats.drafted
        else:  # (with top_k=2 this pair's warped supports happen to be disjoint: nothing accepted)
            assert stats.accepted < stats.drafted


def test_disjoint_support_never_accepts_and_stays_exact():
    verifier, drafter = disjoint_pair()
    params = SamplingParams(temperature=1.0)
    probs = exact_joint(verifier, params, 3)
    for seed in (0, 1):
        counts, stats = run_sampling(verifier, drafter, params, 2, seed)
        assert stats.accepted == 0 and stats.drafted > 0
        assert acceptance_rate(stats) == 0.0 and expected_acceptance(stats) == 0.0
        assert stats.verifier_calls == stats.new_tokens  # only corrections: tau = 1
        stat, df = chi_square(counts, probs, N_SAMPLES)
        assert stat < chi2_critical(df)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_q_equals_p_gives_tau_gamma_plus_one(gamma):
    model = random_table_lm(V, seed=3)
    dec = SpeculativeDecoder(model, model, gamma=gamma)
    gen = torch.Generator().manual_seed(0)
    res = dec.generate(
        torch.tensor([PROMPT]), 4 * (gamma + 1), SamplingParams(temperature=0.8, top_k=3), generator=gen
    )
    s = res.stats
    assert s.new_tokens / s.verifier_calls == gamma + 1
    assert s.accepted == s.drafted == 4 * gamma
    assert expected_acceptance(s) == pytest.approx(1.0)
    assert s.position_accepted == [4] * gamma


def test_lossy_eps_one_identical_to_lossless():
    verifier, drafter = random_table_lm(V, 11), random_table_lm(V, 12)
    params = SamplingParams(temperature=1.0)
    ids = torch.tensor([PROMPT])
    base = SpeculativeDecoder(verifier, drafter, gamma=3)
    for name in ("linear", "squared", "exponential"):
        lossy = SpeculativeDecoder(verifier, drafter, gamma=3, lenience=name, eps=1.0)
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        for _ in range(20):
            a = base.generate(ids, 12, params, generator=g1)
            b = lossy.generate(ids, 12, params, generator=g2)
            assert torch.equal(a.tokens, b.tokens)
            assert (a.stats.accepted, a.stats.drafted) == (b.stats.accepted, b.stats.drafted)


@pytest.mark.parametrize("name", ["linear", "squared", "exponential"])
def test_lenience_increases_acceptance(name):
    verifier, drafter = random_table_lm(V, 11), random_table_lm(V, 12)
    params = SamplingParams(temperature=1.0)
    ids = torch.tensor([PROMPT])
    rates = []
    for eps in (1.0, 0.5, 0.1):
        dec = SpeculativeDecoder(verifier, drafter, gamma=3, lenience=name, eps=eps)
        gen = torch.Generator().manual_seed(0)
        total = None
        for _ in range(60):
            s = dec.generate(ids, 16, params, generator=gen).stats
            total = s if total is None else total.merge(s)
        rates.append(acceptance_rate(total))
    assert rates[0] < rates[1] < rates[2], rates
