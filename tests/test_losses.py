"""Tests for train/losses.py (docs/distillspec.md, docs/testing.md)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from train.losses import DIVERGENCES, acceptance_from_logits, divergence

NAMES = list(DIVERGENCES)


# ---- the four divergences by name, and one value per position (what the methods compute through divergence)


def forward_kl(s, t, mask=None, temperature=1.0, chunk_size=64):
    return divergence("fkl", s, t, mask, temperature, chunk_size=chunk_size)


def reverse_kl(s, t, mask=None, temperature=1.0, chunk_size=64):
    return divergence("rkl", s, t, mask, temperature, chunk_size=chunk_size)


def jsd(s, t, mask=None, temperature=1.0, beta=0.5, chunk_size=64):
    return divergence("jsd", s, t, mask, temperature, beta, chunk_size)


def tvd(s, t, mask=None, temperature=1.0, chunk_size=64):
    return divergence("tvd", s, t, mask, temperature, chunk_size=chunk_size)


def per_token_divergence(name, s, t, temperature=1.0, beta=0.5):
    """(..., V) -> (...): divergence on a one-position mask at each position."""
    flat_s, flat_t = s.reshape(1, -1, s.shape[-1]), t.reshape(1, -1, t.shape[-1])
    values = []
    for i in range(flat_s.shape[1]):
        mask = torch.zeros(1, flat_s.shape[1], dtype=torch.bool)
        mask[0, i] = True
        values.append(divergence(name, flat_s, flat_t, mask, temperature, beta))
    return torch.stack(values).reshape(s.shape[:-1])


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """The tensors here are tiny; intra-op threads only add overhead (a lot on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _logits(*shape: int, seed: int, scale: float = 2.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


# ---- float64 textbook references (explicit sums over softmax probabilities) -------------------------------


def _ref_per_token(name: str, s: torch.Tensor, t: torch.Tensor, beta: float = 0.5, temperature: float = 1.0):
    lq = torch.log_softmax(s.double() / temperature, -1)
    lp = torch.log_softmax(t.double() / temperature, -1)

    def kl(la, lb):  # sum a log(a / b), with 0 log 0 = 0
        return torch.where(la > -math.inf, la.exp() * (la - lb), torch.zeros_like(la)).sum(-1)

    if name == "fkl" or (name == "jsd" and beta == 0.0):
        return kl(lp, lq)
    if name == "rkl" or (name == "jsd" and beta == 1.0):
        return kl(lq, lp)
    if name == "jsd":
        lm = (beta * lp.exp() + (1 - beta) * lq.exp()).log()
        return beta * kl(lp, lm) + (1 - beta) * kl(lq, lm)
    if name == "tvd":
        return 0.5 * (lp.exp() - lq.exp()).abs().sum(-1)
    raise AssertionError(name)


def _ref(name, s, t, mask=None, **kw):
    per = _ref_per_token(name, s, t, **kw)
    if mask is None:
        return per.mean()
    m = mask.bool()
    return per[m].sum() / m.sum()


# ---- identities --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_self_divergence_is_zero(name):
    x = _logits(3, 5, 11, seed=0)
    xs = x.clone().requires_grad_(True)
    d = divergence(name, xs, x)
    assert abs(d.item()) < 1e-6
    d.backward()
    assert torch.isfinite(xs.grad).all()
    assert xs.grad.abs().max().item() < 1e-6


def test_tvd_bounds_and_acceptance_identity():
    s = _logits(4, 6, 9, seed=1, scale=4.0)
    t = _logits(4, 6, 9, seed=2, scale=4.0)
    per = per_token_divergence("tvd", s, t)
    assert (per >= 0).all() and (per <= 1 + 1e-6).all()
    p, q = torch.softmax(t.double(), -1), torch.softmax(s.double(), -1)
    torch.testing.assert_close(per.double(), 1 - torch.minimum(p, q).sum(-1), atol=1e-6, rtol=0)
    acc = acceptance_from_logits(s, t)
    torch.testing.assert_close(acc.double(), 1 - tvd(s, t).double(), atol=1e-6, rtol=0)
    assert not acc.requires_grad
    # disjoint supports: TVD = 1, acceptance = 0; identical: TVD = 0, acceptance = 1
    a = torch.tensor([[0.0, 0.0, -float("inf"), -float("inf")]])
    b = torch.tensor([[-float("inf"), -float("inf"), 0.0, 0.0]])
    assert tvd(a, b).item() == pytest.approx(1.0)
    assert acceptance_from_logits(a, b).item() == pytest.approx(0.0)
    assert acceptance_from_logits(a, a).item() == pytest.approx(1.0)


def test_kl_against_torch_distributions():
    s = _logits(5, 13, seed=3, dtype=torch.float64)
    t = _logits(5, 13, seed=4, dtype=torch.float64)
    fkl_ref = kl_divergence(Categorical(logits=t), Categorical(logits=s)).mean()
    rkl_ref = kl_divergence(Categorical(logits=s), Categorical(logits=t)).mean()
    torch.testing.assert_close(forward_kl(s, t), fkl_ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(reverse_kl(s, t), rkl_ref, atol=1e-12, rtol=1e-10)
    # float32 path against the float64 reference
    torch.testing.assert_close(forward_kl(s.float(), t.float()).double(), fkl_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reverse_kl(s.float(), t.float()).double(), rkl_ref, atol=1e-5, rtol=1e-5)


NAME_BETA = [("fkl", 0.5), ("rkl", 0.5), ("tvd", 0.5)] + [("jsd", b) for b in (0.0, 0.1, 0.5, 0.9, 1.0)]


@pytest.mark.parametrize(("name", "beta"), NAME_BETA)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_values_match_reference(name, beta, temperature):
    s = _logits(2, 4, 17, seed=5)
    t = _logits(2, 4, 17, seed=6)
    got = divergence(name, s, t, temperature=temperature, beta=beta)
    want = _ref(name, s, t, beta=beta, temperature=temperature)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_jsd_endpoints_are_fkl_and_rkl():
    s = _logits(3, 7, 19, seed=7)
    t = _logits(3, 7, 19, seed=8)
    assert jsd(s, t, beta=0.0).item() == forward_kl(s, t).item()
    assert jsd(s, t, beta=1.0).item() == reverse_kl(s, t).item()


def test_jsd_half_symmetric_and_bounded():
    s = _logits(4, 5, 23, seed=9, scale=6.0)
    t = _logits(4, 5, 23, seed=10, scale=6.0)
    a = per_token_divergence("jsd", s, t, beta=0.5)
    b = per_token_divergence("jsd", t, s, beta=0.5)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert (a <= math.log(2) + 1e-6).all() and (a >= -1e-7).all()
    # disjoint supports attain the bound exactly
    x = torch.tensor([[0.0, -float("inf")]])
    y = torch.tensor([[-float("inf"), 0.0]])
    assert jsd(x, y).item() == pytest.approx(math.log(2), abs=1e-6)


def test_divergences_nonnegative():
    s = _logits(6, 31, seed=11, scale=5.0)
    t = _logits(6, 31, seed=12, scale=5.0)
    for name in NAMES:
        assert (per_token_divergence(name, s, t) >= -1e-6).all(), name


# ---- gradients ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "beta"), [("fkl", 0.5), ("rkl", 0.5), ("tvd", 0.5), ("jsd", 0.0), ("jsd", 0.3), ("jsd", 1.0)]
)
def test_gradient_matches_float64_autograd_reference(name, beta):
    s64 = _logits(2, 3, 29, seed=13, dtype=torch.float64)
    t64 = _logits(2, 3, 29, seed=14, dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    ref_s = s64.clone().requires_grad_(True)
    _ref(name, ref_s, t64, mask, beta=beta, temperature=1.3).backward()
    for dtype, tol in [(torch.float64, 1e-10), (torch.float32, 2e-6)]:
        xs = s64.to(dtype).clone().requires_grad_(True)
        divergence(name, xs, t64.to(dtype), mask, temperature=1.3, beta=beta, chunk_size=2).backward()
        torch.testing.assert_close(xs.grad.double(), ref_s.grad, atol=tol, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_float64(name):
    s = _logits(3, 7, seed=15, dtype=torch.float64).requires_grad_(True)
    t = _logits(3, 7, seed=16, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: divergence(name, x, t, beta=0.3, chunk_size=2), (s,))


def _extreme_pair():
    s = _logits(2, 4, 16, seed=17, scale=3.0)
    t = _logits(2, 4, 16, seed=18, scale=3.0)
    t[..., :5] = -1e4  # probabilities underflow to exact zeros in float32
    t[0, 0, 7] = 1e4  # one-hot verifier row
    s[1, 2, 3] = 80.0  # near one-hot drafter row
    return s, t


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_finite_gradients_with_underflowing_verifier(name, beta):
    s, t = _extreme_pair()
    assert (torch.softmax(t, -1) == 0).any()
    xs = s.requires_grad_(True)
    d = divergence(name, xs, t, beta=beta, chunk_size=3)
    assert torch.isfinite(d)
    d.backward()
    assert torch.isfinite(xs.grad).all()
    torch.testing.assert_close(d.double(), _ref(name, s.detach(), t, beta=beta), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("name", ["fkl", "jsd", "tvd"])
def test_finite_gradients_with_minus_inf_verifier_logits(name):
    s = _logits(3, 10, seed=19)
    t = _logits(3, 10, seed=20)
    t[:, :4] = -float("inf")  # p has exact zeros
    t[1, 6] = torch.finfo(torch.float32).min
    xs = s.requires_grad_(True)
    d = divergence(name, xs, t)
    assert torch.isfinite(d)
    d.backward()
    assert torch.isfinite(xs.grad).all()
    torch.testing.assert_close(d.double(), _ref(name, s.detach(), t), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["rkl", "jsd", "tvd"])
def test_finite_gradients_with_drafter_zeros(name):
    s = _logits(3, 10, seed=21)
    t = _logits(3, 10, seed=22)
    s[:, 7:] = -float("inf")  # q has exact zeros
    xs = s.requires_grad_(True)
    d = divergence(name, xs, t)
    d.backward()
    assert torch.isfinite(d) and torch.isfinite(xs.grad).all()
    torch.testing.assert_close(d.double(), _ref(name, s.detach(), t), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_shared_zeros_give_finite_gradients(name):
    # both p and q have exact zeros on the same ids: every divergence is finite and so is its gradient
    s = _logits(2, 9, seed=23)
    t = _logits(2, 9, seed=24)
    s[:, :3] = -float("inf")
    t[:, :3] = -float("inf")
    xs = s.requires_grad_(True)
    d = divergence(name, xs, t)
    d.backward()
    assert torch.isfinite(d) and torch.isfinite(xs.grad).all()
    assert (xs.grad[:, :3] == 0).all()


def test_verifier_receives_no_gradient():
    s = _logits(2, 5, seed=25).requires_grad_(True)
    t = _logits(2, 5, seed=26).requires_grad_(True)
    forward_kl(s, t).backward()
    assert s.grad is not None and t.grad is None


def test_the_arguments_are_drafter_and_verifier_and_the_old_keywords_name_them():
    """Issue 53: the divergences' arguments are ``drafter_logits`` / ``verifier_logits`` (GKD's student and
    teacher); a call with an old keyword raises a TypeError naming the new one."""
    s, t = _logits(2, 5, seed=29), _logits(2, 5, seed=30)
    by_keyword = divergence("fkl", drafter_logits=s, verifier_logits=t)
    assert float(by_keyword) == pytest.approx(float(divergence("fkl", s, t)))
    assert float(acceptance_from_logits(drafter_logits=s, verifier_logits=t)) == pytest.approx(
        float(acceptance_from_logits(s, t))
    )
    with pytest.raises(TypeError, match="'student_logits', renamed .*: use drafter_logits="):
        divergence("fkl", student_logits=s, verifier_logits=t)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'teacher_logits', renamed .*: use verifier_logits="):
        acceptance_from_logits(s, teacher_logits=t)  # type: ignore[call-arg]


# ---- chunking ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_chunked_equals_unchunked(name):
    s = _logits(3, 7, 37, seed=27)
    t = _logits(3, 7, 37, seed=28)
    mask = torch.rand(3, 7, generator=torch.Generator().manual_seed(0)) > 0.3
    x0 = s.clone().requires_grad_(True)
    base = divergence(name, x0, t, mask, beta=0.4, chunk_size=None)
    base.backward()
    for cs in [1, 2, 3, 5, 8, 1000]:
        x = s.clone().requires_grad_(True)
        d = divergence(name, x, t, mask, beta=0.4, chunk_size=cs)
        torch.testing.assert_close(d, base, atol=1e-6, rtol=1e-6)
        d.backward()
        torch.testing.assert_close(x.grad, x0.grad, atol=1e-7, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(divergence(name, s, t, mask, beta=0.4, chunk_size=2), base.detach())
    torch.testing.assert_close(
        acceptance_from_logits(s, t, mask, chunk_size=2), acceptance_from_logits(s, t, mask)
    )


def test_bf16_inputs_and_combined_losses():
    s = _logits(4, 8, 33, seed=29, dtype=torch.bfloat16)
    t = _logits(4, 8, 33, seed=30, dtype=torch.bfloat16)
    x = s.clone().requires_grad_(True)
    loss = divergence("jsd", x, t, chunk_size=5) + 0.5 * tvd(x, t, chunk_size=7)
    assert loss.dtype == torch.float32
    loss.backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    ref = s.double().requires_grad_(True)
    (_ref("jsd", ref, t) + 0.5 * _ref("tvd", ref, t)).backward()
    torch.testing.assert_close(x.grad.double(), ref.grad, atol=2e-3, rtol=2e-2)


def test_upstream_gradient_scaling_and_retain_graph():
    s = _logits(3, 4, 21, seed=40, dtype=torch.float64)
    t = _logits(3, 4, 21, seed=41, dtype=torch.float64)
    ref = s.clone().requires_grad_(True)
    _ref("rkl", ref, t).backward()
    x = s.clone().requires_grad_(True)
    loss = -2.5 * reverse_kl(x, t, chunk_size=5)
    loss.backward(retain_graph=True)
    torch.testing.assert_close(x.grad, -2.5 * ref.grad)
    loss.backward(retain_graph=True)  # a second pass through the same graph accumulates the same gradient
    torch.testing.assert_close(x.grad, -5.0 * ref.grad)
    d = reverse_kl(x, t, chunk_size=5)
    for go in [3.0, 1.0, 0.5, 0.5, -2.0]:  # the in-place scaling of the saved buffer is undone correctly
        (g,) = torch.autograd.grad(d, x, torch.tensor(go, dtype=torch.float64), retain_graph=True)
        torch.testing.assert_close(g, go * ref.grad)


def test_gradient_through_shared_logits_and_upstream_graph():
    # logits produced by a layer and used by two losses: gradients add up like the float64 reference
    g = torch.Generator().manual_seed(44)
    h = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    w0 = torch.randn(6, 19, generator=g, dtype=torch.float64)
    t = _logits(2, 5, 19, seed=45, dtype=torch.float64)
    mask = torch.rand(2, 5, generator=g) > 0.4

    def run(fn):
        w = w0.clone().requires_grad_(True)
        logits = h @ w
        loss = 0.7 * fn("fkl", logits, t, mask) + fn("tvd", logits, t, None) + logits.square().mean()
        loss.backward()
        return loss.detach(), w.grad

    got = run(lambda n, s_, t_, m: divergence(n, s_, t_, m, chunk_size=3))
    want = run(lambda n, s_, t_, m: _ref(n, s_, t_, m))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("name", NAMES)
def test_backward_keeps_no_full_vocab_intermediates(name):
    # Autograd keeps exactly one drafter-sized gradient buffer, whatever the chunking; a naive
    # implementation keeps several (M, V) float tensors (log-probs, probs, mixture, ...).
    s = _logits(4, 16, 50, seed=42)
    t = _logits(4, 16, 50, seed=43)
    mask = torch.ones(4, 16, dtype=torch.bool)
    mask[:, :3] = False
    saved: list[int] = []

    def pack(x):
        saved.append(x.numel())
        return x

    x = s.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        d = divergence(name, x, t, mask, chunk_size=8)
    assert sum(saved) <= s.numel() + 4 * 16
    d.backward()
    assert x.grad is not None and x.grad.shape == s.shape


# ---- masks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_mask_selects_positions(name):
    s = _logits(2, 6, 15, seed=31)
    t = _logits(2, 6, 15, seed=32)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.int64)
    want = _ref(name, s, t, mask)
    torch.testing.assert_close(divergence(name, s, t, mask).double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(divergence(name, s, t, mask.bool()).double(), want, atol=1e-6, rtol=1e-6)
    # garbage at unmasked positions changes nothing, and receives no gradient
    s2, t2 = s.clone(), t.clone()
    s2[~mask.bool()] = 1e6 * torch.randn_like(s2[~mask.bool()])
    t2[~mask.bool()] = float("nan")
    x = s2.requires_grad_(True)
    d = divergence(name, x, t2, mask)
    torch.testing.assert_close(d.double(), want, atol=1e-6, rtol=1e-6)
    d.backward()
    assert (x.grad[~mask.bool()] == 0).all()
    # flat (N, V) inputs with an (N,) mask agree
    torch.testing.assert_close(
        divergence(name, s.reshape(12, 15), t.reshape(12, 15), mask.reshape(12)), d.detach()
    )


@pytest.mark.parametrize("name", NAMES)
def test_empty_mask(name):
    s = _logits(2, 3, 8, seed=33).requires_grad_(True)
    t = _logits(2, 3, 8, seed=34)
    d = divergence(name, s, t, torch.zeros(2, 3, dtype=torch.bool))
    assert d.item() == 0.0 and d.requires_grad
    d.backward()
    assert s.grad is not None and (s.grad == 0).all()
    assert acceptance_from_logits(s, t, torch.zeros(2, 3)).item() == 0.0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("use_mask", [False, True])
def test_non_contiguous_inputs(name, use_mask):
    # logits[:, :-1] (the usual next-token shift) and a transposed verifier are read in place
    s = _logits(2, 6, 13, seed=46)
    t = _logits(6, 2, 13, seed=47).transpose(0, 1)
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 1, 1]]) if use_mask else None
    x = s.clone().requires_grad_(True)
    d = divergence(name, x[:, :-1], t[:, 1:], mask, chunk_size=3)
    d.backward()
    ref = s.clone().requires_grad_(True)
    _ref(name, ref[:, :-1], t[:, 1:], mask).backward()
    torch.testing.assert_close(d.double(), _ref(name, s[:, :-1], t[:, 1:], mask), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad, ref.grad, atol=1e-6, rtol=1e-5)
    assert (x.grad[:, -1] == 0).all()
    acc = acceptance_from_logits(s[:, :-1], t[:, 1:], mask, chunk_size=4)
    torch.testing.assert_close(acc.double(), 1 - _ref("tvd", s[:, :-1], t[:, 1:], mask), atol=1e-6, rtol=0)


# ---- vocabulary mismatch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_vocab_mismatch_uses_common_prefix(name):
    s = _logits(2, 3, 20, seed=35)
    t = _logits(2, 3, 24, seed=36)
    want = _ref(name, s, t[..., :20])
    torch.testing.assert_close(divergence(name, s, t).double(), want, atol=1e-6, rtol=1e-6)
    # drafter padded beyond the verifier: padding ids are dropped before the softmax and get no gradient
    pad = torch.cat([t[..., :20] * 0 + s, torch.full((2, 3, 4), 50.0)], -1).requires_grad_(True)
    d = divergence(name, pad, t[..., :20])
    torch.testing.assert_close(d.double(), want, atol=1e-6, rtol=1e-6)
    d.backward()
    assert (pad.grad[..., 20:] == 0).all()
    acc = acceptance_from_logits(s, t)
    torch.testing.assert_close(acc.double(), 1 - _ref("tvd", s, t[..., :20]), atol=1e-6, rtol=0)


# ---- validation --------------------------------------------------------------------------------------------


def test_bad_arguments():
    s, t = _logits(2, 5, seed=37), _logits(2, 5, seed=38)
    with pytest.raises(ValueError, match="'fkl', 'rkl', 'jsd', 'tvd'"):
        divergence("kl", s, t)
    for beta in [-0.1, 1.5, float("nan")]:
        with pytest.raises(ValueError, match="beta"):
            divergence("jsd", s, t, beta=beta)
    for temperature in [0.0, -1.0, float("inf"), float("nan")]:
        with pytest.raises(ValueError, match="temperature"):
            divergence("fkl", s, t, temperature=temperature)
        with pytest.raises(ValueError, match="temperature"):
            acceptance_from_logits(s, t, temperature=temperature)
    for cs in [0, -3, 2.5]:
        with pytest.raises(ValueError, match="chunk_size"):
            divergence("tvd", s, t, chunk_size=cs)
    with pytest.raises(ValueError, match="mask"):
        divergence("fkl", s, t, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="leading"):
        divergence("fkl", s, _logits(3, 5, seed=39))
    with pytest.raises(ValueError, match="shape"):
        divergence("fkl", s[0], t[0])
