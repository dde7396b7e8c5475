"""Sampled SpeculativeDecoder output against exact, enumerated laws, with a stated statistical power.

The models are table-driven fakes on 4 ids (id 3 is the EOS) whose next-token distribution depends on
the last token and its position. ``spec_reference.ExactSpec`` enumerates every draft, every
accept / reject outcome and every next token of a ``generate`` call, so for each case we know exactly

- the law of the emitted tokens (which must be the verifier's own: ``verifier_joint``; the test also
  checks the enumerator agrees, so the checker is checked), and
- the expectation of every count the decoder reports (accepted, tested, drafted, calls, the per-depth
  lists and ``sum_expected_acceptance``).

Power. The same enumerator, run with a deliberately broken rule, gives the law a broken decoder would
produce; the chi-square's noncentrality lambda = N sum (P_broken - P)^2 / P then gives the probability
that the test fails on the broken decoder (``chi2_power``, alpha = 1e-4, Patnaik's approximation).
Every distribution test asserts its own power against "acceptance x 0.9" and against "residual drawn
from p" (>= 0.999, except the position case below) and reports its power against a 3% bias in the
assertion message. For the "peaked" pair (acceptance ~0.89, so rejections are rare and a 10% cut in
acceptance nearly doubles them):

| case (N runs)              | df | crit  | lambda x0.9 | lambda x0.97 (power) | lambda residual-from-p |
|----------------------------|----|-------|-------------|----------------------|------------------------|
| gamma 1, 3 tokens (3000)   | 24 | 58.9  | 215         | 17 (0.06)            | 274                    |
| gamma 2, 3 tokens (3000)   | 24 | 58.9  | 329         | 28 (0.28)            | 535                    |
| gamma 4, 5 tokens (4000)   | 57 | 105.6 | 972         | 84 (0.96)            | 1311                   |
| gamma 3, T 0.8 top-k 3     | 9  | 34.1  | 1147        | 107 (1.00)           | 529                    |
| slow: gamma 4 (40000)      | 108| 171.5 | 11112       | 905 (1.00)           | 13162                  |

so on "acceptance x 0.9" the gamma-4 statistic moves from ~57 (its df) to ~1030, ten times the
critical value. The count tests see the same mutations directly: on the gamma-4 case "x 0.9" moves the
mean accepted count per run by ~23 standard errors and "x 0.97" by ~6.8 (bound 4.5).

The "position" case (3 ids, a drafter whose proposals depend on the position's parity, gamma 2,
7 tokens, acceptance ~0.52) exists for the count tests: a drafter cache that is not cropped after a
rejection feeds the drafter at the wrong positions and moves its mean accepted count by ~7 se.

The "lookup" cases copy a block's draft from the context where its last 1-2 ids occurred before (prompt
lookup) and let the drafter draft elsewhere; the enumerator copies with its own implementation, so a
copy one token too far, or from the first occurrence instead of the latest, moves the counts. (A drafter
that misses a commit is invisible here, where drafters read only the last token and the position; the
greedy tests of test_lookup.py catch it.)

The "conf" cases end a chain after a draft the drafter gives less than a threshold (adaptive draft
length): the enumerator applies the same stop, so a decoder that drops the unsure draft, or tests
another token's probability, moves the expected draft counts per depth and fails the count tests.

Each default case takes a few seconds (about 1 ms per ``generate``); the ``slow`` variants use 10x
the samples and add a generic (non-peaked) pair.
"""

from __future__ import annotations

import functools
import math

import pytest

from train.decoding import SamplingParams, SpeculativeDecoder, warp

from .decoding_helpers import random_table_lm
from .spec_reference import (
    ExactSpec,
    Runs,
    chi2_critical,
    chi2_power,
    chi_square,
    lenience_fn,
    mean_and_se,
    noncentrality,
    peaked_table_lm,
    per_run,
    pooled_cells,
    run_many,
    table_next,
    verifier_joint,
)

V, EOS = 4, 3
PROMPT = (2, 0)
Z = 4.5  # two-sided bound for the mean tests: false-alarm probability ~7e-6 each
T1 = SamplingParams(temperature=1.0)


def peaked_pair():
    return peaked_table_lm(V, 1, 3.0, 0.0), peaked_table_lm(V, 2, 4.5, 1.5), V, EOS, PROMPT


def random_pair():
    return random_table_lm(V, 11), random_table_lm(V, 12), V, EOS, PROMPT


def position_sensitive_pair():
    """3 ids (2 = EOS); the drafter's proposals depend strongly on the parity of the position, so a
    drafter cache of the wrong length (a missing crop after a rejection) changes its acceptance.
    Acceptance ~0.52 over many short blocks (gamma 2, 7 tokens): many blocks follow a rejection."""
    return (
        peaked_table_lm(3, 1, 3.0, 0.0),
        peaked_table_lm(3, 2, 4.5, 1.5, positions=2, pos_jitter=2.0),
        3,
        2,
        (1, 0),
    )


PAIRS = {"peaked": peaked_pair, "random": random_pair, "position": position_sensitive_pair}

#: name -> (pair, params, gamma, max_new_tokens, N, lenience, eps)
CASES = {
    "peaked g1": ("peaked", T1, 1, 3, 3000, None, 1.0),
    "peaked g2": ("peaked", T1, 2, 3, 3000, None, 1.0),
    "peaked g4": ("peaked", T1, 4, 5, 4000, None, 1.0),
    "peaked g3 T0.8 top_k3": ("peaked", SamplingParams(temperature=0.8, top_k=3), 3, 4, 3000, None, 1.0),
    "position g2": ("position", T1, 2, 7, 3000, None, 1.0),
    "peaked g4 conf0.9": ("peaked", T1, 4, 5, 4000, None, 1.0),
    "position g3 conf0.5": ("position", T1, 3, 7, 3000, None, 1.0),
    "peaked g2 lookup3": ("peaked", T1, 2, 5, 4000, None, 1.0),
    "position g2 lookup3": ("position", T1, 2, 7, 3000, None, 1.0),
    "random g4 slow": ("random", T1, 4, 5, 30000, None, 1.0),
    "peaked g4 slow": ("peaked", T1, 4, 5, 40000, None, 1.0),
}
#: adaptive draft length: the chain ends after a draft the drafter gives less than this probability
#: (the peaked pair at 0.9 stops about one block in two: 3.5 drafts per call against 4.3 without)
THRESHOLD = {"peaked g4 conf0.9": 0.9, "position g3 conf0.5": 0.5}
#: prompt lookup first: (num_tokens, max_ngram, min_ngram); on 3-4 ids most blocks find a 1- or
#: 2-gram to copy, the others are drafted by the drafter (both kinds are counted and checked)
LOOKUP = {"peaked g2 lookup3": (3, 2, 1), "position g2 lookup3": (3, 2, 2)}
#: the distribution tests' required power against acceptance x 0.9 (the position case is built for
#: the count tests: a drafter cache of the wrong length moves its mean accepted count by ~7 se)
MIN_POWER = {"position g2": 0.5, "position g3 conf0.5": 0.5, "position g2 lookup3": 0.5}
DEFAULT = ["peaked g1", "peaked g2", "peaked g4", "peaked g3 T0.8 top_k3", "position g2", *THRESHOLD, *LOOKUP]
SLOW = ["random g4 slow", "peaked g4 slow"]


def exact_law(case: str, mutation: str | None = None) -> ExactSpec:
    pair, params, gamma, max_new, _, lenience, eps = CASES[case]
    verifier, drafter, vocab, eos, prompt = PAIRS[pair]()
    return ExactSpec(
        table_next(verifier, params),
        table_next(drafter, params, vocab),
        prompt,
        max_new,
        gamma,
        (eos,),
        lenience,
        eps,
        mutation,
        THRESHOLD.get(case, 0.0),
        LOOKUP.get(case),
    )


@functools.cache
def setup(case: str):
    """(verifier, drafter, exact law of the correct decoder, eos, prompt)."""
    verifier, drafter, _, eos, prompt = PAIRS[CASES[case][0]]()
    return verifier, drafter, exact_law(case), eos, prompt


def _lookup_kwargs(case: str) -> dict[str, int]:
    if case not in LOOKUP:
        return {}
    num_tokens, max_ngram, min_ngram = LOOKUP[case]
    return {"lookup_tokens": num_tokens, "lookup_max_ngram": max_ngram, "lookup_min_ngram": min_ngram}


@functools.cache
def sampled(case: str, seed: int = 0) -> Runs:
    """N runs of the real decoder (cached: the distribution and the count tests share them)."""
    _, params, gamma, max_new, n, lenience, eps = CASES[case]
    verifier, drafter, _, eos, prompt = setup(case)
    dec = SpeculativeDecoder(
        verifier,
        drafter,
        gamma=gamma,
        lenience=lenience,
        eps=eps,
        confidence_threshold=THRESHOLD.get(case, 0.0),
        **_lookup_kwargs(case),
    )
    return run_many(dec, prompt, max_new, params, n, seed, eos=eos)


def check_distribution(case: str) -> dict:
    min_power = MIN_POWER.get(case, 0.999)
    _, params, _, max_new, n, _, _ = CASES[case]
    verifier, _, exact, eos, prompt = setup(case)
    target = verifier_joint(table_next(verifier, params), prompt, max_new, (eos,))
    law = exact.distribution()
    # the enumerated decoder is lossless (checks the checker)
    assert max(abs(law.get(k, 0.0) - p) for k, p in target.items()) < 1e-6
    assert sum(target.values()) == pytest.approx(1.0, abs=1e-6)
    # EOS is in play: a good share of the outputs end in it, some before max_new_tokens
    assert sum(p for k, p in target.items() if k and k[-1] == eos and len(k) < max_new) > 0.05
    df = len(pooled_cells(target, n)) - 1
    power = {
        m: chi2_power(df, noncentrality(target, exact_law(case, m).distribution(), n))
        for m in ("accept_x0.9", "accept_x0.97", "residual_from_p")
    }
    assert power["accept_x0.9"] >= min_power and power["residual_from_p"] >= min_power, power
    runs = sampled(case)
    stat, df = chi_square(runs.counts, target, n)
    assert stat < chi2_critical(df), (case, stat, df, chi2_critical(df), power)
    return power


@pytest.mark.parametrize("case", DEFAULT)
def test_emitted_distribution_is_the_verifiers(case):
    """Chi-square (alpha 1e-4) of the whole output of N generate calls (gamma up to 4, EOS = 3, q != p)
    against the verifier's exact law; asserts power >= 0.999 against acceptance x 0.9 and against a
    residual drawn from p."""
    check_distribution(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW)
def test_emitted_distribution_is_the_verifiers_slow(case):
    """10x the samples: power against a 3% acceptance bias >= 0.999 for the peaked pair."""
    power = check_distribution(case)
    if case.startswith("peaked"):
        assert power["accept_x0.97"] >= 0.999, power


def check_counts(case: str) -> None:
    _, _, gamma, _, _, _, _ = CASES[case]
    depth = max(gamma, LOOKUP.get(case, (0,))[0])
    exact = setup(case)[2]
    want = exact.expectations()
    runs = sampled(case)
    # 1) expected acceptance is an unbiased, per-test estimate of the empirical acceptance:
    #    sum over tested positions of (accepted - expected) is a martingale with variance
    #    sum a_i (1 - a_i) <= tested * abar (1 - abar).
    accepted = sum(per_run(runs, "accepted"))
    tested = sum(per_run(runs, "tested"))
    expected = sum(per_run(runs, "sum_expected"))
    abar = expected / tested
    assert abs(accepted - expected) <= Z * math.sqrt(tested * abar * (1 - abar)), (accepted, expected, tested)
    # 2) every count's mean over N runs equals its exact expectation (per depth too)
    names = ["accepted", "tested", "drafted", "verifier_calls", "drafter_calls", "new_tokens", "sum_expected"]
    names += ["lookup_blocks"]
    names += [f"pos_{f}_{i}" for f in ("drafted", "tested", "accepted") for i in range(depth)]
    for name in names:
        m, se = mean_and_se(per_run(runs, name))
        exp = want.get(name, 0.0)
        assert abs(m - exp) <= Z * se + 1e-9, (case, name, m, exp, se)
    # 3) per depth, empirical acceptance accepted_i / tested_i against the exact ratio
    if case in LOOKUP:  # both kinds of block are in play
        assert 0.1 < want["lookup_blocks"] / want["verifier_calls"] < 0.9, want
    for i in range(depth):
        t_i = sum(per_run(runs, f"pos_tested_{i}"))
        a_i = sum(per_run(runs, f"pos_accepted_{i}"))
        if not want.get(f"pos_tested_{i}"):  # a depth an adaptive chain never reaches
            assert t_i == 0, (case, i, t_i)
            continue
        ratio = want.get(f"pos_accepted_{i}", 0.0) / want[f"pos_tested_{i}"]
        assert abs(a_i / t_i - ratio) <= Z * math.sqrt(ratio * (1 - ratio) / t_i) + 1e-9, (
            case,
            i,
            a_i / t_i,
            ratio,
        )
    # 4) the mean reported expected acceptance is a conditional probability: never above 1
    assert expected <= tested + 1e-9


@pytest.mark.parametrize("case", DEFAULT)
def test_counts_match_their_exact_expectations(case):
    """sum_expected_acceptance / tested agrees with accepted / tested (martingale CI); every count and
    every per-depth count averages to its exact expectation; per-depth acceptance within its CI."""
    check_counts(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW)
def test_counts_match_their_exact_expectations_slow(case):
    check_counts(case)


# ---------------------------------------------------------------- lossy lenience

LENIENT = [("linear", 0.5), ("squared", 0.7), ("exponential", 0.5)]
N_LENIENT = 4000


def lenient_first_token(verifier, drafter, lenience: str, eps: float) -> list[float]:
    """P(y) = min(q(y), f(p(y))) + (1 - sum_v min(q(v), f(p(v)))) * norm(max(0, p - q))(y)."""
    p = warp(verifier.next_logits(list(PROMPT)), T1).double().tolist()
    q = warp(drafter.next_logits(list(PROMPT)), T1).double().tolist()
    f = lenience_fn(lenience, eps)
    accept = [min(qv, f(pv)) for pv, qv in zip(p, q, strict=True)]
    r = [max(0.0, pv - qv) for pv, qv in zip(p, q, strict=True)]
    rest = 1.0 - sum(accept)
    return [a + rest * rv / sum(r) for a, rv in zip(accept, r, strict=True)]


@pytest.mark.parametrize(("lenience", "eps"), LENIENT)
def test_lenient_first_token_matches_closed_form(lenience, eps):
    """One drafted token (max_new_tokens 2): the first emitted token follows the lenient closed form,
    and each run reports expected acceptance sum_v min(q(v), f(p(v))) for its single tested position.

    Power: the lossless law p differs enough from the lenient one that the chi-square (df 3) has
    power >= 0.999 to tell them apart at N = 4000 (asserted below); the expected acceptance check is
    exact, per run.
    """
    verifier, drafter = random_pair()[:2]
    law = lenient_first_token(verifier, drafter, lenience, eps)
    p = warp(verifier.next_logits(list(PROMPT)), T1).double().tolist()
    target = {(y,): law[y] for y in range(V)}
    lossless = {(y,): p[y] for y in range(V)}
    df = len(pooled_cells(target, N_LENIENT)) - 1
    assert chi2_power(df, noncentrality(target, lossless, N_LENIENT)) >= 0.999
    q = warp(drafter.next_logits(list(PROMPT)), T1).double().tolist()
    f = lenience_fn(lenience, eps)
    lenient_expected = sum(min(qv, f(pv)) for pv, qv in zip(p, q, strict=True))
    lossless_expected = sum(min(qv, pv) for pv, qv in zip(p, q, strict=True))
    assert abs(lenient_expected - lossless_expected) > 0.05  # the two definitions differ here
    dec = SpeculativeDecoder(verifier, drafter, gamma=2, lenience=lenience, eps=eps)
    runs = run_many(dec, PROMPT, 2, T1, N_LENIENT, seed=1)
    first: dict[tuple[int, ...], int] = {}
    for key, c in runs.counts.items():
        first[key[:1]] = first.get(key[:1], 0) + c
    stat, df = chi_square(first, target, N_LENIENT)
    assert stat < chi2_critical(df), (lenience, eps, stat, df)
    for s in runs.stats[:50]:
        assert s.tested == 1
        assert s.sum_expected_acceptance == pytest.approx(lenient_expected, abs=1e-5)


@pytest.mark.parametrize(("lenience", "eps"), LENIENT)
def test_lenient_chain_matches_exact_law(lenience, eps):
    """gamma 3, max_new_tokens 4, EOS in play: the lenient decoder's whole output against the exact
    enumerated lenient law, and its counts (sum_expected_acceptance with the lenient expectation
    sum_v min(q, f(p)) per tested position) against their exact expectations."""
    verifier, drafter = random_pair()[:2]
    gamma, max_new, n = 3, 4, 3000
    exact = ExactSpec(
        table_next(verifier, T1), table_next(drafter, T1, V), PROMPT, max_new, gamma, (EOS,), lenience, eps
    )
    law = exact.distribution()
    dec = SpeculativeDecoder(verifier, drafter, gamma=gamma, lenience=lenience, eps=eps)
    runs = run_many(dec, PROMPT, max_new, T1, n, seed=2, eos=EOS)
    stat, df = chi_square(runs.counts, law, n)
    assert stat < chi2_critical(df), (lenience, eps, stat, df)
    want = exact.expectations()
    for name in ("accepted", "tested", "sum_expected", "new_tokens", "verifier_calls"):
        m, se = mean_and_se(per_run(runs, name))
        assert abs(m - want[name]) <= Z * se + 1e-9, (lenience, name, m, want[name], se)
