"""Verification rules as pure functions: exact output distributions, driven by millions of uniforms.

The rules take their uniforms as arguments, so each test runs the rule on N = 400 000 independent
draws at once and compares the emitted token's distribution with the target. Power: with N draws a
token of probability 0.1 has a standard error of sqrt(0.1 * 0.9 / N) ~ 4.7e-4, so a 3% relative bias
(3e-3) is ~6 standard errors; the tests use a chi-square at alpha = 1e-4 over all tokens and are
checked to fail on an acceptance scaled by 0.97 (see ``test_chain_rule_detects_a_three_percent_bias``).
"""

from __future__ import annotations

import math

import pytest
import torch

from train.decoding.rules.chain import accepted_length, chain_rejection, greedy_chain
from train.decoding.rules.recursive import recursive_rejection, sibling_proposal
from train.decoding.sampling import LENIENCES, apply_lenience, residual, sample_with_uniform

N = 400_000
V = 6


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) (Wilson-Hilferty), z = 3.719 <=> alpha = 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value) of observed token counts against ``probs`` (zero cells must be empty)."""
    counts = torch.bincount(samples.reshape(-1), minlength=probs.numel()).double()
    n = counts.sum()
    expected = probs.double() * n
    assert float(counts[expected == 0].sum()) == 0, "a zero-probability token was emitted"
    live = expected > 0
    stat = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    return stat, chi2_critical(int(live.sum()) - 1)


def dist(seed: int, vocab: int = V, sharp: float = 1.5, zeros: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(vocab, generator=g, dtype=torch.float64) * sharp).softmax(-1)
    if zeros:
        p[:zeros] = 0.0
        p = p / p.sum()
    return p


def draw(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return sample_with_uniform(probs.expand(n, -1), torch.rand(n, generator=g, dtype=torch.float64))


def uniforms(shape, seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------- helpers


def test_accepted_length():
    acc = torch.tensor([[True, True, False, True], [False, True, True, True], [True] * 4])
    assert accepted_length(acc).tolist() == [2, 0, 4]
    assert accepted_length(torch.zeros(3, 0, dtype=torch.bool)).tolist() == [0, 0, 0]


def test_sample_with_uniform_matches_probabilities_and_skips_zeros():
    p = dist(0, zeros=2)
    x = draw(p, N, 1)
    stat, crit = chi_square(x, p)
    assert stat < crit
    # u -> 1 never lands on a trailing zero-probability token
    q = torch.tensor([0.5, 0.5, 0.0, 0.0])
    assert int(sample_with_uniform(q, torch.tensor(1.0 - 1e-17, dtype=torch.float64))) == 1


def test_greedy_chain():
    draft = [4, 2, 7]
    assert greedy_chain(draft, [4, 2, 7, 9]) == (3, 9)
    assert greedy_chain(draft, [4, 5, 7, 9]) == (1, 5)
    assert greedy_chain(draft, [1, 2, 7, 9]) == (0, 1)
    assert greedy_chain([], [3]) == (0, 3)


# ---------------------------------------------------------------- chain rejection


def run_chain(p_rows, q_rows, seed, n=N, scale=1.0, lenience=None, eps=1.0):
    """N independent chains: drafts x_i ~ q_i (the chain's q does not depend on the draft here, which
    is enough to test the rule: each position is a separate rejection step)."""
    k = len(q_rows)
    p = torch.stack(p_rows).expand(n, -1, -1)
    q = torch.stack(q_rows).expand(n, -1, -1)
    drafts = torch.stack([draw(q_rows[i], n, seed + 10 + i) for i in range(k)], dim=-1)
    u_acc = uniforms((n, k), seed + 1) / scale  # scale < 1 biases acceptance down
    u_next = uniforms(n, seed + 2)
    accepted, nxt = chain_rejection(p, q, drafts, u_acc, u_next, lenience, eps)
    return drafts, accepted, nxt


@pytest.mark.parametrize("k", [1, 2, 4])
def test_chain_first_token_is_distributed_as_p(k):
    """The first emitted token (draft 1 if accepted, else the correction) is exactly p_1, for q != p."""
    p_rows = [dist(100 + i) for i in range(k + 1)]
    q_rows = [dist(200 + i, zeros=1) for i in range(k)]
    drafts, accepted, nxt = run_chain(p_rows, q_rows, seed=k)
    first = torch.where(accepted >= 1, drafts[:, 0], nxt)
    stat, crit = chi_square(first, p_rows[0])
    assert stat < crit
    # acceptance at position 1 equals sum min(p, q)
    rate = float((accepted >= 1).double().mean())
    assert rate == pytest.approx(float(torch.minimum(p_rows[0], q_rows[0]).sum()), abs=4e-3)


def test_chain_every_emitted_position_is_distributed_as_p():
    """Here p_j and q_j do not depend on earlier tokens, so the token emitted at position j (the draft
    if j drafts passed, else the correction), over the draws that reach position j, must follow p_j;
    the bonus token after k accepted drafts must follow p_{k+1}."""
    k = 3
    p_rows = [dist(300 + i) for i in range(k + 1)]
    q_rows = [dist(400 + i) for i in range(k)]
    drafts, accepted, nxt = run_chain(p_rows, q_rows, seed=7)
    for j in range(1, k + 1):
        at_j = accepted >= j - 1  # position j is emitted iff the first j - 1 drafts passed
        tok = torch.where(accepted >= j, drafts[:, j - 1], nxt)
        stat, crit = chi_square(tok[at_j], p_rows[j - 1])
        assert stat < crit, f"position {j}"
    bonus = nxt[accepted == k]
    stat, crit = chi_square(bonus, p_rows[k])
    assert stat < crit


@pytest.mark.parametrize(("lenience", "eps"), [(None, 1.0), ("linear", 0.6), ("exponential", 0.5)])
@pytest.mark.parametrize("point_masses", [False, True], ids=["drawn", "point-masses"])
def test_the_walked_chain_decides_as_the_batched_rule(lenience, eps, point_masses):
    """``verify_chain`` (what the loop runs: a walk on Python floats) against ``chain_rejection`` (what
    the exact-law tests drive in batches) on the same logits, drafts and uniforms: the same accepted
    count and next token in every one of 600 blocks, so the law the batched tests prove is the loop's."""
    from train.decoding.draft import Draft
    from train.decoding.rules.chain import verify_chain
    from train.decoding.sampling import SamplingParams, uniforms, warp

    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=1.0)
    outcomes = set()
    for block in range(600):
        k, vocab = 1 + block % 4, 6
        logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
        q = warp(torch.randn(k, vocab, generator=gen) * 1.5, params)
        tokens = [int(t) for t in torch.multinomial(q, 1, generator=gen).squeeze(-1)]
        if point_masses:
            q = torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()
        draft = Draft.chain(tokens, None if point_masses else q)
        walked = verify_chain(logits, draft, params, torch.Generator().manual_seed(block), lenience, eps)
        u = uniforms(k + 1, torch.Generator().manual_seed(block))
        n, nxt = chain_rejection(warp(logits, params), q, torch.tensor(tokens), u[:k], u[k], lenience, eps)
        assert (walked.accepted, walked.next) == (int(n), int(nxt)), block
        outcomes.add(int(n))
    assert {0, 1, 2, 3} <= outcomes  # rejections at every depth met, and full acceptances


def test_chain_q_equals_p_accepts_everything_and_disjoint_support_nothing():
    p = dist(1)
    _, accepted, nxt = run_chain([p, p, p], [p, p], seed=3, n=20_000)
    assert bool((accepted == 2).all())
    left = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    right = torch.tensor([0.0, 0.0, 0.3, 0.7], dtype=torch.float64)
    drafts, accepted, nxt = run_chain([right, right], [left], seed=4, n=50_000)
    assert int(accepted.sum()) == 0
    stat, crit = chi_square(nxt, right)
    assert stat < crit


def test_chain_rule_detects_a_three_percent_bias():
    """The power claim: acceptance scaled by 0.97 moves the statistic far past the critical value."""
    p_rows, q_rows = [dist(500), dist(501)], [dist(600)]
    drafts, accepted, nxt = run_chain(p_rows, q_rows, seed=9, scale=0.97)
    # the biased rule with the *correct* residual no longer emits p
    first = torch.where(accepted >= 1, drafts[:, 0], nxt)
    stat, crit = chi_square(first, p_rows[0])
    assert stat > 3 * crit


def test_residual_from_p_instead_of_p_minus_q_is_detected():
    p, q = dist(700), dist(701)
    drafts = draw(q, N, 1)
    u = uniforms(N, 2)
    acc = u * q[drafts] < p[drafts]
    wrong = torch.where(acc, drafts, draw(p, N, 3))  # residual drawn from p
    right = torch.where(acc, drafts, sample_with_uniform(residual(p, q).expand(N, -1), uniforms(N, 4)))
    assert chi_square(right, p)[0] < chi_square(right, p)[1]
    stat, crit = chi_square(wrong, p)
    assert stat > crit


@pytest.mark.parametrize("lenience", sorted(LENIENCES))
def test_lenient_rule_matches_its_closed_form(lenience):
    """P(y) = min(q(y), f(p(y))) + (1 - sum_v min(q(v), f(p(v)))) * norm(max(0, p - q))(y)."""
    eps = 0.5
    p, q = dist(800), dist(801)
    drafts, accepted, nxt = run_chain([p, dist(802)], [q], seed=11, lenience=lenience, eps=eps)
    first = torch.where(accepted >= 1, drafts[:, 0], nxt)
    f = apply_lenience(p, lenience, eps)
    accept_mass = torch.minimum(q, f)
    closed = accept_mass + (1 - accept_mass.sum()) * residual(p, q)
    stat, crit = chi_square(first, closed)
    assert stat < crit
    assert float((accepted >= 1).double().mean()) == pytest.approx(float(accept_mass.sum()), abs=4e-3)


# ---------------------------------------------------------------- recursive rejection (trees)


def gumbel_top_k(q: torch.Tensor, m: int, n: int, seed: int) -> torch.Tensor:
    """n draws of m distinct tokens without replacement from q (Gumbel-top-k), in draw order."""
    g = torch.Generator().manual_seed(seed)
    gumbel = -torch.log(-torch.log(torch.rand(n, q.numel(), generator=g, dtype=torch.float64)))
    return (q.log() + gumbel).topk(m, dim=-1).indices


@pytest.mark.parametrize("kind", ["iid", "without_replacement", "deterministic"])
@pytest.mark.parametrize("m", [1, 3])
def test_recursive_rule_emits_p(kind, m):
    p, q = dist(900), dist(901, sharp=1.0)
    if kind == "iid":
        cands = torch.stack([draw(q, N, 20 + j) for j in range(m)], dim=-1)
    elif kind == "without_replacement":
        cands = gumbel_top_k(q, m, N, 21)
    else:  # a fixed top-m of q, the same for every draw (Medusa's candidates)
        cands = q.topk(m).indices.expand(N, -1)
    choice, token = recursive_rejection(
        p.expand(N, -1), cands, q.expand(N, -1), kind, uniforms((N, m), 5), uniforms(N, 6)
    )
    stat, crit = chi_square(token, p)
    assert stat < crit, (kind, m, stat, crit)
    hit = choice >= 0
    assert bool((token[hit] == cands[hit, choice[hit]]).all())


def test_without_replacement_rule_accepts_more_than_iid_siblings():
    """RSD's point: with the same q, siblings without replacement are accepted at least as often."""
    p, q = dist(910), dist(911, sharp=2.0)
    m = 3
    iid = torch.stack([draw(q, N, 30 + j) for j in range(m)], dim=-1)
    wor = gumbel_top_k(q, m, N, 31)
    u, un = uniforms((N, m), 7), uniforms(N, 8)
    rate_iid = float(
        (recursive_rejection(p.expand(N, -1), iid, q.expand(N, -1), "iid", u, un)[0] >= 0).double().mean()
    )
    rate_wor = float(
        (recursive_rejection(p.expand(N, -1), wor, q.expand(N, -1), "without_replacement", u, un)[0] >= 0)
        .double()
        .mean()
    )
    assert rate_wor > rate_iid + 0.01


def test_recursive_rule_detects_a_wrong_sibling_proposal():
    """Verifying without-replacement siblings as if they were i.i.d. biases the output."""
    p, q = dist(920), dist(921, sharp=1.0)
    cands = gumbel_top_k(q, 3, N, 40)
    _, token = recursive_rejection(
        p.expand(N, -1), cands, q.expand(N, -1), "iid", uniforms((N, 3), 9), uniforms(N, 10)
    )
    stat, crit = chi_square(token, p)
    assert stat > crit


def test_sibling_proposal_removes_earlier_siblings():
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    out = sibling_proposal(q, torch.tensor([3, 1]), "without_replacement")
    torch.testing.assert_close(out, torch.tensor([0.25, 0.0, 0.75, 0.0], dtype=torch.float64))
    assert sibling_proposal(q, torch.tensor([3]), "iid") is q
    with pytest.raises(ValueError, match="kind"):
        sibling_proposal(q, torch.tensor([3]), "deterministic")
    with pytest.raises(ValueError, match="needs the proposal"):
        recursive_rejection(q, torch.tensor([1]), None, "iid", torch.rand(1), torch.rand(()))
