"""The streamed product for linear layers over 1-16 rows on CPU float32 (train/models/streamed_linear.py).

Its values are F.linear's up to the order of the sums (one row padded to two); many rows, gradients and
other dtypes take F.linear itself, bit for bit, and so does one row until it is chosen to stream; and a
k-token check through it gives the argmax of k one-token steps
(greedy equality's premise), with the decoders' greedy output equal to Hugging Face ``generate``.
Broken on purpose (tried): a product of the weight with the rows untransposed fails the shape and value
tests; a padded row left in the output fails the 3-row cases; F.linear's transposed, non-contiguous
result returned as is fails ``test_rows_come_back_contiguous``. The tests of the product itself run with
``DRAFTSMITH_CPU_LINEAR=stream`` (every count of 1-16 rows streams); the default, ``auto``, streams the
counts the cost probe measured faster (the last tests here).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from train.decoding import SpeculativeDecoder, TimedModel, crop_cache
from train.models import streamed_linear as sl

from .decoding_helpers import build, hf_greedy, tiny_config


@pytest.fixture(autouse=True)
def streamed(monkeypatch, request):
    """Every count of 1-16 rows streams, except in the tests of the default's measured choice."""
    if "auto" not in request.node.name:
        monkeypatch.setenv("DRAFTSMITH_CPU_LINEAR", "stream")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_values_are_f_linears(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 24, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    x = torch.randn(1, rows, 24, generator=gen)
    out = sl.streamed_linear(x, weight, b)
    assert out.shape == (1, rows, 48)
    torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def test_rows_come_back_contiguous():
    """Attention takes its fused kernel only on contiguous projections: a transposed view here made a
    2-token check cost 1.4x a one-token step instead of 1.03x (docs/decoding.md)."""
    for rows in (1, 2, 3, 4):
        assert sl.streamed_linear(torch.randn(rows, 8), torch.randn(16, 8), None).is_contiguous()


def _layer() -> torch.nn.Linear:
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40)
    sl.stream_small_linears(layer)
    return layer


def test_many_rows_gradients_and_other_dtypes_run_f_linear_bit_for_bit():
    layer = _layer()
    with torch.inference_mode():
        for rows in (17, 64):
            x = torch.randn(rows, 24)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        one = torch.randn(1, 24)  # one row streams too (padded to two), to F.linear's values
        torch.testing.assert_close(layer(one), F.linear(one, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        sl.set_stream_rows(layer, [2])  # one row not chosen: F.linear itself
        assert torch.equal(layer(one), F.linear(one, layer.weight, layer.bias))
        x64 = torch.randn(4, 24, dtype=torch.float64)
        layer64 = torch.nn.Linear(24, 40).double()
        sl.stream_small_linears(layer64)
        assert torch.equal(layer64(x64), F.linear(x64, layer64.weight, layer64.bias))
    x = torch.randn(4, 24)  # grad mode with a trainable weight: the library's product (and its backward)
    out = layer(x)
    assert out.requires_grad and torch.equal(out, F.linear(x, layer.weight, layer.bias))


def test_patching_is_idempotent_reversible_and_switchable(monkeypatch):
    model = build(tiny_config("llama", 32), 0)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert sl.stream_small_linears(model) == linears
    assert sl.stream_small_linears(model) == 0  # already patched
    assert sl.unstream_linears(model) == linears
    assert all("forward" not in vars(m) for m in model.modules())
    monkeypatch.setenv("DRAFTSMITH_CPU_LINEAR", "library")
    assert sl.stream_small_linears(model) == 0
    monkeypatch.setenv("DRAFTSMITH_CPU_LINEAR", "fast")  # a typo is an error, not a silent default
    with pytest.raises(ValueError, match="DRAFTSMITH_CPU_LINEAR"):
        sl.stream_small_linears(model)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_a_k_token_check_gives_the_argmax_of_k_one_token_steps(arch):
    """The decoders' models (TimedModel patches them) in float32: one forward over k tokens after a
    cached prefix against k one-token forwards, for k = 2 .. 9; logits within a few 1e-6 (a bitwise match
    is not to be had: neither F.linear's GEMM path nor the streamed product sums as the one-row kernel
    does), the argmax the same."""
    model = build(tiny_config(arch, 64, layers=3), 3)
    timed = TimedModel(model)
    assert any(getattr(m, "_draftsmith_streamed", False) for m in model.modules())
    gen = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        for k in range(2, 10):
            ids = torch.randint(2, 128, (40 + k,), generator=gen).tolist()
            cache = timed(ids[:40], None).cache
            block = timed(ids[40:], cache, logits_to_keep=k).logits
            crop_cache(cache, 40)
            steps = []
            for t in ids[40:]:
                out = timed([t], cache)
                cache = out.cache
                steps.append(out.logits[-1])
            stepped = torch.stack(steps)
            torch.testing.assert_close(block, stepped, atol=2e-5, rtol=1e-4)
            assert torch.equal(block.argmax(-1), stepped.argmax(-1)), (arch, k)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chain_sd_through_the_streamed_product_is_hf_greedy(tiny_pairs, arch):
    verifier, drafter = tiny_pairs[arch]
    gen = torch.Generator().manual_seed(11)
    for gamma in (1, 3, 7):
        dec = SpeculativeDecoder(verifier, drafter, gamma=gamma)
        for _ in range(3):
            ids = torch.randint(2, 128, (1, 12), generator=gen)
            assert dec.generate(ids, 30).tokens.tolist() == hf_greedy(verifier, ids, 30), (arch, gamma)


def test_under_auto_a_row_count_streams_only_once_chosen(monkeypatch):
    """The default: layers are patched but run F.linear until the probe names the row counts whose
    streamed product measured faster; then exactly those stream."""
    monkeypatch.delenv("DRAFTSMITH_CPU_LINEAR", raising=False)
    calls: list[int] = []
    real = sl.streamed_linear
    monkeypatch.setattr(sl, "streamed_linear", lambda x, w, b: calls.append(x.shape[-2]) or real(x, w, b))
    layer = torch.nn.Linear(24, 40)
    assert sl.stream_small_linears(layer) == 1 and sl.stream_rows(layer) == frozenset()
    with torch.inference_mode():
        for rows in (2, 3, 4):
            layer(torch.randn(rows, 24))
        assert calls == []
        assert sl.set_stream_rows(layer, [0, 3, 4, 40])  # out of 1-16: ignored
        assert sl.stream_rows(layer) == {3, 4}
        for rows in (2, 3, 4):
            layer(torch.randn(rows, 24))
    assert calls == [3, 4]
    assert not sl.set_stream_rows(torch.nn.Linear(2, 2), [2])  # not patched: nothing to set


def test_the_faster_product_is_chosen_per_row_count_auto():
    from train.decoding.cost_probe import faster_rows

    counts = [1, 2, 3, 4, 5]
    assert faster_rows(counts, [1.0, 1.7, 1.8, 1.8, 1.9], [1.0, 1.0, 1.0, 1.0, 1.4]) == set(range(2, 17))
    assert faster_rows(counts, [1.0, 1.05, 1.1, 1.6, 1.6], [1.0, 2.0, 2.0, 1.2, 1.9]) == {4}
    # one row padded to two streamed faster (the EPYC's matrix-vector kernel): plain steps stream too
    assert faster_rows(counts, [1.0, 1.7, 1.8, 1.8, 1.9], [0.6, 0.6, 0.7, 0.7, 1.4]) == set(range(1, 17))


def test_the_probe_measures_both_products_and_caches_its_choice_auto(monkeypatch, tmp_path):
    """Under auto the probe times each count both ways, leaves the verifier streaming the counts it
    found faster and caches that choice with the costs; a later process applies it without measuring."""
    from train.decoding import cost_probe

    monkeypatch.delenv("DRAFTSMITH_CPU_LINEAR", raising=False)
    monkeypatch.setenv("DRAFTSMITH_COST_CACHE", str(tmp_path / "costs.json"))
    monkeypatch.setattr(cost_probe, "_MEMO", {})
    verifier = TimedModel(build(tiny_config("llama", 64, layers=2), 3))
    assert cost_probe.chooses_kernel(verifier)
    timed: list[tuple[int, frozenset[int] | None]] = []
    real = cost_probe.time_forwards
    monkeypatch.setattr(
        cost_probe,
        "time_forwards",
        lambda model, counts, repeats, **kw: (
            timed.append((len(counts), kw.get("kernels"))) or real(model, counts, repeats, **kw)
        ),
    )
    costs = cost_probe.step_costs(verifier, None, 4)
    assert timed[0][1] == (frozenset(), sl.ALL_ROWS)  # both products, interleaved
    chosen = sl.stream_rows(verifier.model)
    assert chosen is not None and chosen <= sl.ALL_ROWS
    sl.set_stream_rows(verifier.model, [])
    monkeypatch.setattr(cost_probe, "_MEMO", {})
    timed.clear()
    assert cost_probe.step_costs(verifier, None, 4) == costs
    assert timed == [] and sl.stream_rows(verifier.model) == chosen  # from the disk cache


def test_a_deep_copy_of_a_patched_model_computes_with_its_own_weights():
    """The decoders' tests sharpen a deep copy of a drafter the fixtures already patched: a patched
    forward that closed over the original layer kept computing with the original weights."""
    import copy

    layer = _layer()
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.mul_(3.0)
    with torch.inference_mode():
        for rows in (1, 2, 4):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(twin(x), F.linear(x, twin.weight, twin.bias), atol=1e-5, rtol=1e-5)
    sl.set_stream_rows(twin, [])
    assert sl.stream_rows(layer) == sl.ALL_ROWS  # the copy's rows are its own
