"""Pure-function tests for train.decoding.sampling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from train.decoding import SamplingParams, residual, sample, warp
from train.decoding.sampling import (
    LENIENCES,
    apply_lenience,
    expected_acceptance_per_position,
    greedy_ids,
    sample_with_uniform,
    uniforms,
)


def test_params_defaults_and_frozen():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p) == (0.0, 0, 1.0)
    assert p.greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
    ],
)
def test_params_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_warp_greedy_is_one_hot():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    probs = warp(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_warp_temperature():
    logits = torch.randn(3, 7)
    probs = warp(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, -1))
    torch.testing.assert_close(warp(logits, SamplingParams(temperature=1.0)), torch.softmax(logits, -1))


def test_warp_top_k():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0])
    probs = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.zeros(5)
    expected[[1, 2]] = torch.softmax(torch.tensor([4.0, 3.0]), -1)
    torch.testing.assert_close(probs, expected)
    # top_k >= V is a no-op
    torch.testing.assert_close(warp(logits, SamplingParams(1.0, top_k=5)), torch.softmax(logits, -1))


def test_warp_top_p():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log()
    # mass before each token: 0, .5, .8, .95 -> top_p=0.8 keeps the first two (reaches 0.8)
    out = warp(logits, SamplingParams(1.0, top_p=0.8))
    torch.testing.assert_close(out, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    out = warp(logits, SamplingParams(1.0, top_p=0.81))
    torch.testing.assert_close(out, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # the top token is always kept
    out = warp(logits, SamplingParams(1.0, top_p=0.01))
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_warp_top_p_ties_do_not_depend_on_vocabulary_order():
    """Tokens tied in probability are kept or dropped together, so permuting the vocabulary permutes
    the warped distribution (the old sort-based cut kept whichever tied token sorted first)."""
    probs_in = torch.tensor([0.3, 0.2, 0.2, 0.2, 0.1])
    params = SamplingParams(1.0, top_p=0.4)  # 0.3 alone is short of 0.4; the three 0.2s tie at the cut
    out = warp(probs_in.log(), params)
    torch.testing.assert_close(out, torch.tensor([0.3, 0.2, 0.2, 0.2, 0.0]) / 0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        perm = torch.randperm(5, generator=gen)
        torch.testing.assert_close(warp(probs_in.log()[perm], params), out[perm])


def test_sample_depends_on_the_generator_only():
    """Draws come from uniforms made on the generator's device, then an inverse-CDF lookup on the
    probabilities' device: the same generator state gives the same tokens wherever probs live."""
    probs = torch.softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(1)), -1)
    a = sample(probs, torch.Generator().manual_seed(5))
    u = uniforms((3,), torch.Generator().manual_seed(5))
    assert u.dtype == torch.float64
    assert torch.equal(a, sample_with_uniform(probs, u))
    assert torch.equal(sample_with_uniform(probs.double(), u), a)  # dtype of probs does not matter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_ids_is_the_argmax_of_the_logits_as_given(dtype):
    """Picked in float32 for speed, the argmax is the one of the logits' own dtype: the same index,
    the first one on ties (rows with planted ties, rows of -inf outside a draft vocabulary)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen).to(dtype)
    logits[1, [7, 40, 299]] = logits[1].max() + 1  # a three-way tie: the first index wins
    logits[2, :] = 0.5  # all tied
    logits[3, 100:] = float("-inf")
    logits[4, [5, 9]] = torch.tensor(1e4, dtype=dtype)  # equal after rounding to dtype
    ids = greedy_ids(logits)
    assert ids.dtype == torch.long and ids.shape == (6,)
    assert ids.tolist() == logits.argmax(dim=-1).tolist()
    assert ids[1] == 7 and ids[2] == 0 and ids[4] == 5
    assert int(greedy_ids(logits[0])) == int(logits[0].argmax())


def test_sample_with_uniform_lands_on_positive_mass_at_u_one():
    """u at (or rounding to) 1 clamps to the last token with positive mass, whatever zeros sit between
    or after, row by row."""
    probs = torch.tensor([[0.25, 0.0, 0.75, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    one = torch.ones(3, dtype=torch.float64)
    assert sample_with_uniform(probs, one).tolist() == [2, 3, 0]
    assert sample_with_uniform(probs, torch.zeros(3, dtype=torch.float64)).tolist() == [0, 1, 0]
    # one row at a time (the decoders' path, with Python scalars): the same tokens
    for u, want in ((1.0, [2, 3, 0]), (0.0, [0, 1, 0]), (0.3, [2, 1, 0]), (0.25, [2, 1, 0])):
        got = [int(sample_with_uniform(row, torch.tensor(u, dtype=torch.float64))) for row in probs]
        assert got == want == sample_with_uniform(probs, torch.full((3,), u, dtype=torch.float64)).tolist()


def test_warp_combined_rows_sum_to_one():
    logits = torch.randn(4, 3, 50)
    out = warp(logits, SamplingParams(0.7, top_k=10, top_p=0.9))
    assert out.shape == logits.shape
    torch.testing.assert_close(out.sum(-1), torch.ones(4, 3))
    assert ((out > 0).sum(-1) <= 10).all()


def test_sample_shapes_and_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3])
    draws = torch.stack([sample(probs, g) for _ in range(4000)])
    assert draws.shape == (4000,)
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert freq[2] == 0
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    batch = sample(torch.softmax(torch.randn(2, 3, 5), -1), g)
    assert batch.shape == (2, 3) and batch.dtype == torch.long


def test_sample_reproducible_with_generator():
    probs = torch.softmax(torch.randn(10), -1)
    a = [int(sample(probs, torch.Generator().manual_seed(3))) for _ in range(3)]
    assert len(set(a)) == 1


def test_residual():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.2, 0.1])
    torch.testing.assert_close(residual(p, q), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    # falls back to p when the residual is zero (p == q, or p <= q everywhere)
    torch.testing.assert_close(residual(p, p), p)
    pq = torch.stack([p, p]), torch.stack([q, p])
    torch.testing.assert_close(residual(*pq), torch.stack([torch.tensor([1.0, 0, 0, 0]), p]))


def test_residual_recovers_p():
    """q(x) min(1, p/q) + P(reject) * residual = p for any p, q (the losslessness identity)."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(5, 6, generator=g), -1)
    q = torch.softmax(torch.randn(5, 6, generator=g), -1)
    accept_mass = torch.minimum(p, q)
    reject = 1 - accept_mass.sum(-1, keepdim=True)
    torch.testing.assert_close(accept_mass + reject * residual(p, q), p)


@pytest.mark.parametrize("name", sorted(LENIENCES))
def test_lenience_eps_one_is_identity(name):
    p = torch.rand(10)
    assert torch.equal(apply_lenience(p, name, 1.0), p)
    assert torch.equal(LENIENCES[name](p, 1.0), p)


def test_lenience_values():
    p = torch.tensor([0.25, 0.5])
    torch.testing.assert_close(apply_lenience(p, "linear", 0.5), p / 0.5)
    torch.testing.assert_close(apply_lenience(p, "squared", 0.5), p / 0.25)
    torch.testing.assert_close(apply_lenience(p, "exponential", 0.5), p.sqrt())
    assert torch.equal(apply_lenience(p, None, 0.5), p)
    with pytest.raises(ValueError, match="lenience"):
        apply_lenience(p, "cubic", 0.5)


def test_chain_acceptance_threshold_is_min_one_p_over_q():
    """Each drafted token passes while u * q(x) < f(p(x)): three positions, one vocabulary id each."""
    from train.decoding.rules.chain import chain_rejection

    # position i drafts token i; p(x_i) = (0.2, 0.5, 0.1), q(x_i) = (0.4, 0.5, 0.05)
    p = torch.tensor([[0.2, 0.3, 0.5], [0.25, 0.5, 0.25], [0.45, 0.45, 0.1], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.4, 0.3, 0.3], [0.25, 0.5, 0.25], [0.5, 0.45, 0.05]])
    draft = torch.tensor([0, 1, 2])
    u_next = torch.tensor(0.5)
    n, _ = chain_rejection(p, q, draft, torch.tensor([0.49, 0.99, 0.0]), u_next)
    assert int(n) == 3  # 0.49 < 0.5, 0.99 < 1, 0 < 1
    n, _ = chain_rejection(p, q, draft, torch.tensor([0.51, 0.2, 0.3]), u_next)
    assert int(n) == 0  # 0.51 > p/q = 0.5: the first token is rejected
    n, _ = chain_rejection(p, q, draft, torch.tensor([0.2, 0.2, 0.3]), u_next)
    assert int(n) == 3
    n, _ = chain_rejection(p, q, draft, torch.tensor([0.51, 0.2, 0.3]), u_next, "linear", 0.5)
    assert int(n) == 3  # lenient: f(p) = p / 0.5 makes the first ratio 1


def test_expected_acceptance_per_position():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.0, 1.0, 0.0]])
    torch.testing.assert_close(expected_acceptance_per_position(p, q), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(expected_acceptance_per_position(p, p), torch.ones(2))


def test_lenient_expected_acceptance_never_exceeds_one():
    """With f(p) >= q everywhere the sum is sum_v q, which float32 rounds above 1 for some q; the
    evaluator's summary (simulated block efficiency) refuses an acceptance above 1."""
    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(256, 4096, generator=gen), dim=-1)
    p = torch.softmax(torch.randn(256, 4096, generator=gen), dim=-1)
    assert float(q.sum(-1).max()) > 1.0  # the rounding this guards against happens for these rows
    for lenience in ("linear", "exponential"):
        a = expected_acceptance_per_position(p, q, lenience, 0.01)
        assert float(a.max()) <= 1.0 and float(a.min()) > 0.9
