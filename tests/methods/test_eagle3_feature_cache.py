"""EAGLE-3's feature cache: the byte budget, copies that outlive the batch, rows keyed by their tokens,
targets recomputed from the verifier's last hidden state equal to those of its logits, a module whose
cached epochs give the online losses without calling the verifier whatever rows a batch groups, and the
saved cache: read back bit for bit by the next run, which then trains without the verifier, and ignored
when another verifier, other layers or another precision computed it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_llama
from tests.methods.test_eagle3_method import PAD, _build, _Losses, _trainer
from train.config import ConfigError
from train.models.eagle3_ttt import head_matches, head_targets, verifier_targets
from train.training.answer_data import collate_answers
from train.training.feature_cache import FeatureCache, fingerprint, padded_rows, row_keys

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
    one, three = (_key(rows[i]) for i in (1, 3))
    kept = module.feature_cache.rows
    kept[one], kept[three] = kept[three], kept[one]
    assert not torch.allclose(module.ttt(again).loss, want.loss, rtol=1e-3)


def _key(row: dict[str, torch.Tensor]) -> str:
    return row_keys(row["input_ids"][None], [len(row["input_ids"])])[0]


def test_a_row_is_keyed_by_its_real_tokens_alone():
    ids = torch.tensor([[5, 6, 7, PAD, PAD], [5, 6, 7, 8, PAD], [5, 6, 7, PAD, 9]])
    first, longer, other_padding = row_keys(ids, [3, 4, 3])
    assert first == other_padding != longer  # padding is no part of a row
    assert row_keys(ids[:1, :3], [3]) == [first]  # nor is the batch's width
    assert row_keys(torch.tensor([[5, 7, 6]]), [3]) != [first]  # order is
    assert len(set(row_keys(torch.arange(64).reshape(8, 8), [8] * 8))) == 8


def test_a_validation_row_with_a_training_row_s_tokens_shares_its_features(monkeypatch):
    module, data = _build(feature_cache_gb=0.01)
    module.ttt(_batch(data.rows["train"][:2]))  # this test's validation answers are its training ones
    monkeypatch.setattr(module, "verifier_pass", lambda *a, **k: pytest.fail("the verifier ran again"))
    module.ttt(_batch(data.rows["validation"][:2]))
    assert (module.feature_cache.hits, len(module.feature_cache)) == (1, 2)


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


# ------------------------------------------------------------------------------------------ on disk


def _stamp(**change):
    stamp = {"weights": "abc", "aux_layers": [0, 1, 1], "precision": "32-true"}
    return {**stamp, **change}


def test_saved_rows_read_back_bit_for_bit_within_the_budget(tmp_path):
    aux, states, argmax = _features(batch=3, length=5)
    cache = FeatureCache(max_bytes=10**6)
    cache.store(["a", "b", "c"], [5, 2, 4], aux, states, argmax)
    assert cache.unsaved == 3
    path = tmp_path / "features" / "features.rank0.pt"
    cache.save(path, _stamp())
    assert cache.unsaved == 0 and [p.name for p in path.parent.iterdir()] == [
        path.name
    ]  # no partial file left
    again = FeatureCache(max_bytes=10**6)
    assert again.load(path, _stamp()) == 3 and again.unsaved == 0 and again.nbytes == cache.nbytes
    for key, row in cache.rows.items():
        got = again.rows[key]
        assert torch.equal(got.aux, row.aux) and torch.equal(got.hidden, row.hidden)
        assert torch.equal(got.argmax, row.argmax) and got.argmax.dtype == torch.long
    assert again.load(path, _stamp()) == 0  # already kept
    one_row = cache.rows["a"].nbytes
    assert FeatureCache(max_bytes=one_row).load(path, _stamp()) == 1  # the budget holds on reading too
    assert FeatureCache(max_bytes=10**6).load(tmp_path / "missing.pt", _stamp()) == 0


def test_a_rank_saves_the_rows_it_computed_and_reads_another_ranks_file_into_memory(tmp_path, monkeypatch):
    """Issue 43, item 5: rank 1 reads rank 0's file (not memory-mapped: rank 0, maybe on another node,
    replaces it at its next save) and uses its rows, but its own file holds only the rows it computed."""
    aux, states, argmax = _features(batch=3, length=5)
    rank0 = FeatureCache(max_bytes=10**6)
    rank0.store(["a", "b"], [5, 2], aux[:2], states[:2], argmax[:2])
    rank0.save(tmp_path / "features.rank0.pt", _stamp())
    mapped = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: mapped.append(k.get("mmap")) or real_load(*a, **k))
    rank1 = FeatureCache(max_bytes=10**6)
    assert rank1.load(tmp_path / "features.rank0.pt", _stamp(), own=False) == 2 and mapped == [False]
    assert rank1.lookup(["a", "b"]) is not None  # served from rank 0's rows
    rank1.store(["c"], [4], aux[2:], states[2:], argmax[2:])
    rank1.save(tmp_path / "features.rank1.pt", _stamp())
    assert FeatureCache(max_bytes=10**6).load(tmp_path / "features.rank1.pt", _stamp()) == 1  # "c" only
    assert mapped[-1] is True  # a rank's own file is memory-mapped
    again = FeatureCache(max_bytes=10**6)
    again.load(tmp_path / "features.rank1.pt", _stamp())
    again.save(tmp_path / "features.rank1.pt", _stamp())  # rows read as its own are saved again
    assert FeatureCache(max_bytes=10**6).load(tmp_path / "features.rank1.pt", _stamp()) == 1


@pytest.mark.parametrize(
    "change", [{"weights": "abd"}, {"aux_layers": [0, 1, 0]}, {"precision": "bf16-mixed"}, {"device": "cuda"}]
)
def test_rows_saved_by_another_verifier_are_ignored(tmp_path, change):
    cache = FeatureCache(max_bytes=10**6)
    cache.store(["a"], [5], *(t[:1] for t in _features()))
    cache.save(tmp_path / "f.pt", _stamp())
    assert FeatureCache(max_bytes=10**6).load(tmp_path / "f.pt", _stamp(**change)) == 0


def test_the_fingerprint_tells_checkpoints_and_layers_apart():
    verifier = tiny_llama(hidden=64, seed=0)
    stamp = fingerprint(verifier, [0, 1, 1], "32-true", "cpu")
    assert stamp == fingerprint(tiny_llama(hidden=64, seed=0), [0, 1, 1], "32-true", "cpu")
    verifier.config._name_or_path = "/elsewhere"  # where it was loaded from is not what it computes
    assert fingerprint(verifier, [0, 1, 1], "32-true", "cpu") == stamp
    assert fingerprint(verifier, [0, 1, 0], "32-true", "cpu") != stamp
    assert fingerprint(verifier, [0, 1, 1], "bf16-mixed", "cpu") != stamp
    assert fingerprint(tiny_llama(hidden=64, seed=1), [0, 1, 1], "32-true", "cpu") != stamp
    with torch.no_grad():
        verifier.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # one weight of one layer
    assert fingerprint(verifier, [0, 1, 1], "32-true", "cpu") != stamp


def _first_losses(module, data, tmp_path, steps: int = 2) -> list[float]:
    record = _Losses()
    _trainer(tmp_path, steps, [record]).fit(module, datamodule=data)
    return record.losses


def test_the_next_run_trains_on_the_saved_features_without_the_verifier(tmp_path, monkeypatch):
    folder = tmp_path / "features"
    first, data = _build(feature_cache_gb=0.01, feature_cache_dir=str(folder))
    start = {k: v.clone() for k, v in first.drafter.state_dict().items()}
    online = _first_losses(first, data, tmp_path)  # one batch per epoch: online, then cached
    (saved,) = folder.iterdir()
    assert saved.name == "features.rank0.pt" and len(first.feature_cache) == 4

    second, data = _build(feature_cache_gb=0.01, feature_cache_dir=str(folder))
    second.drafter.load_state_dict(start)
    monkeypatch.setattr(second, "verifier_pass", lambda *a, **k: pytest.fail("the verifier ran"))
    offline = _first_losses(second, data, tmp_path)
    assert second.feature_cache.misses == 0 and second.feature_cache.hits == 2
    assert offline == pytest.approx(online, rel=1e-6)
    assert (
        saved.stat().st_mtime_ns == (folder / "features.rank0.pt").stat().st_mtime_ns
    )  # nothing new to save

    # another verifier: the saved rows are not its features; it runs, and its own rows replace them
    monkeypatch.undo()
    third, data = _build(feature_cache_gb=0.01, feature_cache_dir=str(folder))
    with torch.no_grad():
        third.verifier.lm_head.weight.mul_(0.5)
    _first_losses(third, data, tmp_path)
    assert third.feature_cache.misses == 1
    fourth, data = _build(feature_cache_gb=0.01, feature_cache_dir=str(folder))
    assert fourth.feature_cache.load(folder / "features.rank0.pt", fourth.feature_stamp()) == 0


def test_a_failed_save_loses_nothing_but_the_cache(tmp_path, caplog):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    module, data = _build(feature_cache_gb=0.01, feature_cache_dir=str(blocker))
    with caplog.at_level("WARNING"):
        _first_losses(module, data, tmp_path)
    assert "could not save the features" in caplog.text and "method.feature_cache_dir" in caplog.text


def test_a_folder_without_a_budget_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="method.feature_cache_dir"):
        _build(feature_cache_dir=str(tmp_path))
