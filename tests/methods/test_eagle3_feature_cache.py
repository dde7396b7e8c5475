"""EAGLE-3's in-memory feature cache: the byte budget, copies that outlive the batch, targets recomputed
from the verifier's last hidden state equal to those of its logits, and a module whose cached epochs give
the online losses without calling the verifier, whatever rows a batch groups."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama
from tests.methods.test_eagle3_method import PAD, _build
from train.config import ConfigError
from train.methods.eagle3.feature_cache import FeatureCache, padded_rows
from train.models.eagle3_ttt import head_matches, head_targets, verifier_targets
from train.training.answer_data import collate_answers

pytestmark = pytest.mark.usefixtures("one_thread")


def _features(batch: int = 2, length: int = 5, width: int = 3, hidden: int = 2):
    aux = torch.arange(batch * length * width, dtype=torch.float32).reshape(batch, length, width)
    states = -torch.arange(batch * length * hidden, dtype=torch.float32).reshape(batch, length, hidden)
    argmax = torch.arange(batch * length).reshape(batch, length)
    return aux, states, argmax


def test_rows_are_kept_unpadded_and_padded_back_with_zeros():
    cache = FeatureCache(max_bytes=10**6)
    aux, states, argmax = _features()
    assert cache.store(["a", "b"], [3, 5], aux, states, argmax) == 2
    rows = cache.lookup(["b", "a"])
    assert rows is not None and [r.argmax.shape[0] for r in rows] == [5, 3]
    got_aux, got_states, got_argmax = padded_rows(rows, width=6)
    assert torch.equal(got_aux[0, :5], aux[1]) and torch.equal(got_aux[1, :3], aux[0, :3])
    assert torch.equal(got_states[1, :3], states[0, :3]) and torch.equal(got_argmax[0, :5], argmax[1])
    assert not got_aux[1, 3:].any() and not got_aux[0, 5:].any() and not got_argmax[1, 3:].any()
    with pytest.raises(ValueError, match="more than the batch's 4"):
        padded_rows(rows, width=4)


def test_a_batch_with_one_missing_row_is_a_miss():
    cache = FeatureCache(max_bytes=10**6)
    cache.store(["a"], [2], *(t[:1] for t in _features()))
    assert cache.lookup(["a", "b"]) is None and cache.lookup(["a"]) is not None
    assert (cache.hits, cache.misses) == (1, 1)


def test_the_budget_is_never_exceeded_and_rows_do_not_share_the_batch():
    aux, states, argmax = _features(batch=4, length=5)
    one_row = 5 * (3 * 4 + 2 * 4 + 8)  # positions x (aux, hidden float32, argmax int64)
    cache = FeatureCache(max_bytes=2 * one_row + one_row // 2)
    assert cache.store([0, 1, 2, 3], [5, 5, 5, 5], aux, states, argmax) == 2
    assert len(cache) == 2 and cache.nbytes == 2 * one_row <= cache.max_bytes
    assert cache.store([0], [5], aux, states, argmax) == 0  # already kept
    kept = cache.rows[0].aux.clone()
    aux.zero_()  # the batch's storage is reused by the next step
    assert torch.equal(cache.rows[0].aux, kept)
    assert (
        cache.rows[0].aux.untyped_storage().nbytes() == kept.numel() * 4
    )  # its own storage, not the batch's
    assert FeatureCache(0).store([0], [5], aux, states, argmax) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        FeatureCache(-1)


@pytest.mark.parametrize("draft", [None, [2, 5, 7, 11, 257]])
def test_targets_from_the_last_hidden_state_are_those_of_the_logits(draft):
    verifier = tiny_llama(hidden=64, seed=0)
    vocab = verifier.config.vocab_size
    draft_ids = torch.arange(vocab) if draft is None else torch.tensor(draft)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = verifier(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    want = verifier_targets(out.logits, draft_ids, t2d)
    got = head_targets(hidden, verifier.get_output_embeddings(), want.argmax, draft_ids, t2d)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    assert torch.equal(got.in_vocab, want.in_vocab)
    assert head_matches(hidden, verifier.get_output_embeddings(), out.logits, draft_ids, atol=1e-4)
    # a soft-capped head (Gemma 2's 30 tanh(x / 30)) is not a linear map of the state: caught
    capped = 30 * torch.tanh(out.logits * 40 / 30)
    assert not head_matches(hidden * 40, verifier.get_output_embeddings(), capped, draft_ids, atol=1e-4)


def _batch(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return collate_answers(rows, PAD)


def test_cached_epochs_give_the_online_losses_without_the_verifier(monkeypatch):
    module, data = _build(feature_cache_gb=0.01)
    online, _ = _build()
    online.drafter.load_state_dict(module.drafter.state_dict())
    rows = data.rows["train"]
    first, again = _batch(rows[:2]), _batch([rows[3], rows[1], rows[2]])  # a regrouped later batch
    module.ttt(first)  # the first pass: online, kept
    module.ttt(_batch(rows[2:4]))
    assert len(module.feature_cache) == 4 and module.feature_cache.misses == 2

    def no_verifier(*args, **kwargs):
        raise AssertionError("the verifier ran for a cached batch")

    monkeypatch.setattr(module, "verifier_pass", no_verifier)
    cached = module.ttt(again)
    assert module.feature_cache.hits == 1
    monkeypatch.undo()
    want = online.ttt(again)
    torch.testing.assert_close(cached.loss, want.loss, rtol=1e-5, atol=1e-6)
    for got_k, want_k in zip(cached.accuracies, want.accuracies, strict=True):
        assert float(got_k) == pytest.approx(float(want_k))
    # keyed by row, not by place in the batch: rows swapped between keys give other losses
    swapped = dict(module.feature_cache.rows)
    module.feature_cache.rows[("train", 1)], module.feature_cache.rows[("train", 3)] = (
        swapped[("train", 3)],
        swapped[("train", 1)],
    )
    assert not torch.allclose(module.ttt(again).loss, want.loss, rtol=1e-3)


def test_validation_rows_have_their_own_keys():
    module, data = _build(feature_cache_gb=0.01)
    batch = _batch(data.rows["train"][:2])
    module.ttt(batch)
    module.ttt(_batch(data.rows["validation"][:2]), split="validation")
    assert {key[0] for key in module.feature_cache.rows} == {"train", "validation"}
    assert module.feature_cache.hits == 0


def test_without_a_budget_nothing_is_kept():
    module, data = _build()
    module.ttt(_batch(data.rows["train"][:2]))
    assert len(module.feature_cache) == 0 and module.feature_cache.misses == 0


def test_a_head_that_does_not_give_the_logits_is_a_config_error(monkeypatch):
    module, data = _build(feature_cache_gb=0.01)
    other = torch.nn.Linear(64, module.verifier.config.vocab_size, bias=False)
    monkeypatch.setattr(module.verifier, "get_output_embeddings", lambda: other)
    with pytest.raises(ConfigError, match="method.feature_cache_gb"):
        module.ttt(_batch(data.rows["train"][:2]))


def test_the_budget_must_not_be_negative():
    with pytest.raises(ConfigError, match="method.feature_cache_gb"):
        _build(feature_cache_gb=-1.0)
