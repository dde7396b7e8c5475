"""The verifier's answers as training batches (train/training/answer_data.py): the loss mask of a row
(exactly the rows that predict an answer token, kept aligned by the left cut), right padding, the cached
answers folder, the eos ids, and the data module's batch-size check and loaders."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import make_tokenizer
from train.config import ConfigError
from train.models.answers import Answer, save_answers
from train.training.answer_data import (
    SPLITS,
    AnswerDataModule,
    answer_eos_ids,
    answer_row,
    cached_answers,
    collate_answers,
)
from train.training.answer_sources import run_answers, sampled_answers

PAD = 258


def _answer(prompt: list[int], answer: list[int]) -> Answer:
    k = 2
    return Answer(
        prompt=list(prompt),
        answer=list(answer),
        top_ids=torch.arange(len(answer) * k, dtype=torch.int32).reshape(len(answer), k),
        top_logprobs=torch.full((len(answer), k), -0.5, dtype=torch.float16),
    )


def _predicted(row: dict[str, torch.Tensor]) -> list[int]:
    """The tokens the masked rows predict: row j predicts token j + 1."""
    ids, mask = row["input_ids"], row["loss_mask"]
    assert not bool(mask[-1])  # the last row predicts nothing inside the sequence
    return ids[1:][mask[:-1]].tolist()


# ------------------------------------------------------------------------------------------ answer_row


def test_answer_row_masks_exactly_the_rows_that_predict_the_answer():
    row = answer_row(_answer([10, 11, 12], [20, 21, 257]), max_len=16)
    assert row is not None
    assert row["input_ids"].tolist() == [10, 11, 12, 20, 21, 257]
    assert row["input_ids"].dtype == torch.long and row["loss_mask"].dtype == torch.bool
    # rows len(prompt) - 1 .. len(ids) - 2
    assert row["loss_mask"].tolist() == [False, False, True, True, True, False]
    assert _predicted(row) == [20, 21, 257]


@pytest.mark.parametrize(("prompt_len", "answer_len"), [(1, 1), (1, 5), (7, 1), (4, 4), (9, 3)])
def test_answer_row_mask_predicts_the_answer_for_any_lengths(prompt_len, answer_len):
    prompt, answer = list(range(1, prompt_len + 1)), list(range(100, 100 + answer_len))
    row = answer_row(_answer(prompt, answer), max_len=64)
    assert row is not None and len(row["input_ids"]) == prompt_len + answer_len
    assert int(row["loss_mask"].sum()) == answer_len
    assert row["loss_mask"].nonzero().flatten().tolist() == list(
        range(prompt_len - 1, prompt_len + answer_len - 1)
    )
    assert _predicted(row) == answer


def test_a_long_row_loses_prompt_tokens_from_the_left_with_the_mask_aligned():
    prompt, answer = [1, 2, 3, 4, 5, 6], [20, 21, 22]
    row = answer_row(_answer(prompt, answer), max_len=5)
    assert row is not None
    assert row["input_ids"].tolist() == [5, 6, 20, 21, 22]  # the answer whole, the prompt's end
    assert row["loss_mask"].tolist() == [False, True, True, True, False]
    assert _predicted(row) == answer
    # the longest answer that fits keeps exactly one prompt token: the row predicting its first token
    row = answer_row(_answer(prompt, [30, 31, 32, 33]), max_len=5)
    assert row is not None
    assert row["input_ids"].tolist() == [6, 30, 31, 32, 33]
    assert row["loss_mask"].tolist() == [True, True, True, True, False]


@pytest.mark.parametrize(("answer", "max_len"), [([], 8), ([5] * 8, 8), ([5] * 9, 8)])
def test_answer_row_is_none_for_empty_or_too_long_answers(answer, max_len):
    assert answer_row(_answer([1, 2], answer), max_len) is None


def test_answer_row_keeps_an_answer_one_shorter_than_max_len():
    assert answer_row(_answer([1, 2], [5] * 7), max_len=8) is not None


# ------------------------------------------------------------------------------------------ collate


def test_collate_right_pads_ids_attention_and_loss_masks():
    rows = [
        answer_row(_answer([10, 11], [20, 21, 22]), 16),
        answer_row(_answer([12], [23]), 16),
    ]
    batch = collate_answers(rows, PAD)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert batch["input_ids"].tolist() == [[10, 11, 20, 21, 22], [12, 23, PAD, PAD, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["attention_mask"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.bool
    assert batch["loss_mask"].tolist() == [
        [False, True, True, True, False],
        [True, False, False, False, False],
    ]


# ------------------------------------------------------------------------------------------ cached answers


def test_cached_answers_name_the_key_when_a_split_is_missing(tmp_path):
    with pytest.raises(ConfigError, match=r"method\.answers.*train\.pt, validation\.pt"):
        cached_answers(tmp_path)
    save_answers([_answer([1], [2])], str(tmp_path / "train.pt"))
    with pytest.raises(ConfigError, match=r"method\.answers") as err:
        cached_answers(tmp_path)
    assert "validation.pt" in str(err.value) and "train.pt" not in str(err.value)
    with pytest.raises(ConfigError, match=re.escape("other.key")):
        cached_answers(tmp_path / "nowhere", key="other.key")


def test_cached_answers_load_what_save_answers_wrote(tmp_path):
    written = {
        "train": [_answer([1, 2, 3], [4, 5]), _answer([6], [7, 8, 257])],
        "validation": [_answer([9, 9], [10])],
    }
    for split, answers in written.items():
        save_answers(answers, str(tmp_path / f"{split}.pt"))
    loaded = cached_answers(str(tmp_path))
    assert set(loaded) == {"train", "validation"}
    for split, answers in written.items():
        assert len(loaded[split]) == len(answers)
        for got, want in zip(loaded[split], answers, strict=True):
            assert isinstance(got, Answer)
            assert (got.prompt, got.answer) == (want.prompt, want.answer)
            assert torch.equal(got.top_ids, want.top_ids) and got.top_ids.dtype == torch.int32
            assert torch.equal(got.top_logprobs, want.top_logprobs)


# ------------------------------------------------------------------------------------------ eos ids


def _verifier(eos) -> SimpleNamespace:
    return SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))


def test_answer_eos_ids_are_the_tokenizers_then_the_generation_configs():
    """The project's eos rule (train.models.loading.eos_token_ids), and an error when nothing names one."""
    tok = make_tokenizer()
    assert tok.eos_token_id == 257
    assert answer_eos_ids(_verifier([3, 7]), tok) == [257, 3, 7]
    assert answer_eos_ids(_verifier(5), tok) == [257, 5]
    assert answer_eos_ids(_verifier(None), tok) == [257]
    assert answer_eos_ids(SimpleNamespace(), tok) == [257]  # no generation config at all
    assert answer_eos_ids(_verifier(None), SimpleNamespace(eos_token_id=9)) == [9]
    with pytest.raises(ValueError, match="eos"):
        answer_eos_ids(_verifier(None), SimpleNamespace(eos_token_id=None))


# ------------------------------------------------------------------------------------------ data module


def _answers(n_train: int, n_val: int = 3) -> dict[str, list[Answer]]:
    return {
        "train": [_answer([1 + i, 2], [30 + i] * (1 + i % 4)) for i in range(n_train)],
        "validation": [_answer([5], [40 + i, 41]) for i in range(n_val)],
    }


def test_data_module_needs_as_many_usable_rows_as_the_batch_size():
    with pytest.raises(ConfigError, match=re.escape("method.batch_size")):
        AnswerDataModule(_answers(3), PAD, batch_size=4, max_len=16)
    # four answers, one empty and one longer than max_len: two usable rows only
    answers = _answers(2)
    answers["train"] += [_answer([1], []), _answer([1], [5] * 20)]
    with pytest.raises(ConfigError, match=r"method\.batch_size: 3 is more than the 2 usable"):
        AnswerDataModule(answers, PAD, batch_size=3, max_len=16)
    assert len(AnswerDataModule(answers, PAD, batch_size=2, max_len=16).rows["train"]) == 2


def test_train_loader_yields_full_batches_and_validation_every_row():
    data = AnswerDataModule(_answers(10, 5), PAD, batch_size=4, max_len=16, seed=3)
    batches = list(data.train_dataloader())
    assert len(batches) == 2  # 10 rows, the incomplete last batch dropped
    for batch in batches:
        assert batch["input_ids"].shape[0] == 4
        assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["loss_mask"].shape
        assert int(batch["loss_mask"].sum()) > 0
        # a masked row is a real (attended) row whose next token is attended too
        assert not (batch["loss_mask"] & (batch["attention_mask"] == 0)).any()
        assert not (batch["loss_mask"][:, :-1] & (batch["attention_mask"][:, 1:] == 0)).any()
    seen = [int(t) for b in batches for t in b["input_ids"][:, 0]]
    assert len(set(seen)) == 8  # 8 distinct rows of the 10
    again = list(AnswerDataModule(_answers(10, 5), PAD, batch_size=4, max_len=16, seed=3).train_dataloader())
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again, strict=True))
    val = list(data.val_dataloader())
    assert [b["input_ids"].shape[0] for b in val] == [4, 1]  # not dropped, in order
    assert val[0]["input_ids"][:, 1].tolist() == [40, 41, 42, 43]


def test_batches_carry_each_rows_index_in_its_split():
    data = AnswerDataModule(_answers(10, 5), PAD, batch_size=4, max_len=16, seed=3)
    for split, loader in (("train", data.train_dataloader()), ("validation", data.val_dataloader())):
        for batch in loader:
            for i, index in enumerate(batch["index"].tolist()):
                row = data.rows[split][index]["input_ids"]
                assert torch.equal(batch["input_ids"][i, : len(row)], row)


def _lengthy_answers(n: int) -> dict[str, list[Answer]]:
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 40, (n,), generator=gen).tolist()
    return {"train": [_answer([1, 2], [7 + i % 9] * size) for i, size in enumerate(sizes)], "validation": []}


def test_grouping_by_length_cuts_the_padding_and_still_sees_every_row():
    answers = _lengthy_answers(256)

    def loaded(group: bool, seed: int = 0) -> list[dict[str, torch.Tensor]]:
        data = AnswerDataModule(answers, PAD, batch_size=4, max_len=64, seed=seed, group_by_length=group)
        return list(data.train_dataloader())

    def padded_share(batches: list[dict[str, torch.Tensor]]) -> float:
        return sum(b["input_ids"].numel() for b in batches) / sum(
            int(b["attention_mask"].sum()) for b in batches
        )

    grouped, shuffled = loaded(True), loaded(False)
    assert len(grouped) == len(shuffled) == 64
    assert sorted(int(i) for b in grouped for i in b["index"]) == list(range(256))  # each row once
    assert padded_share(grouped) < 1.1 < 1.3 < padded_share(shuffled)
    again, other = loaded(True), loaded(True, seed=1)
    assert all(torch.equal(a["index"], b["index"]) for a, b in zip(grouped, again, strict=True))
    assert any(not torch.equal(a["index"], b["index"]) for a, b in zip(grouped, other, strict=True))
    # a new epoch (Lightning's set_epoch) draws new groups; the same epoch again, the same ones
    data = AnswerDataModule(answers, PAD, batch_size=4, max_len=64, seed=0, group_by_length=True)
    loader = data.train_dataloader()
    first, again_first = [b["index"] for b in loader], [b["index"] for b in loader]
    loader.sampler.set_epoch(1)
    second = [b["index"] for b in loader]
    assert all(torch.equal(a, b) for a, b in zip(first, again_first, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_run_answers_reads_a_folder_the_pairs_cache_or_generates(tmp_path, monkeypatch):
    """``method.answers``: a folder is read; ``pair`` is the real pair's (:func:`pair_answers`) and, on a
    pair without one, greedy answers generated from the run's data, as with None."""
    import train.training.answer_sources as answer_data

    calls = []

    def fake_cut(split, tokenizer, prompt_len, count, seed, continuation_len):
        return {"input_ids": [[split, prompt_len, count, seed]]}

    def fake_greedy(verifier, eos, rows, answer_tokens, batch, engine, cache_dir, device, label):
        calls.append((rows, answer_tokens, batch, device.type))
        assert cache_dir == str(tmp_path / "ckpt" / "answers")
        return []

    own = {
        s: [Answer([1, 2], [3, 4], torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1))] for s in SPLITS
    }
    # the generated answers' prompts are cut from the run's data with its seed, then answered greedily
    monkeypatch.setattr(answer_data, "load_text_dataset", lambda data, _: {s: f"{data}/{s}" for s in SPLITS})
    monkeypatch.setattr(answer_data, "make_prompts", fake_cut)
    monkeypatch.setattr(answer_data, "answer_eos_ids", lambda verifier, tokenizer: [0])
    monkeypatch.setattr(answer_data, "greedy_answers", fake_greedy)
    monkeypatch.setattr(answer_data, "pair_answers", lambda model, v, t, **_: own if model.smollm2 else None)
    folder = tmp_path / "answers"
    folder.mkdir(parents=True)
    for split in SPLITS:
        save_answers(own[split], str(folder / f"{split}.pt"))
    pair = SimpleNamespace(verifier=None, tokenizer=None)
    where = {
        "trainer": SimpleNamespace(accelerator="cpu"),
        "paths": SimpleNamespace(checkpoints_dir=str(tmp_path / "ckpt")),
    }
    real = SimpleNamespace(
        model=SimpleNamespace(smollm2=SimpleNamespace(out_dir="x")), data="d", seed=3, **where
    )
    tiny = SimpleNamespace(model=SimpleNamespace(smollm2=None), data="d", seed=3, **where)
    counts = {"train": 5, "validation": 2}
    assert run_answers("pair", pair, real, counts, 16, 8, 4)["train"][0].answer == [3, 4]
    assert run_answers(str(folder), pair, tiny, counts, 16, 8, 4)["validation"][0].prompt == [1, 2]
    assert not calls
    run_answers("pair", pair, tiny, counts, 16, 8, 4)
    run_answers(None, pair, real, counts, 16, 8, 4)
    generated = [([["d/train", 16, 5, 3]], 8, 4, "cpu"), ([["d/validation", 16, 2, 3]], 8, 4, "cpu")]
    assert calls == generated * 2
    with pytest.raises(ConfigError, match="method.answers"):
        run_answers(str(tmp_path / "nothing"), pair, tiny, counts, 16, 8, 4)


def test_pair_answers_are_generated_when_first_needed_and_only_the_new_prompts_later(tmp_path, monkeypatch):
    """The real pair's answers: none before a run needs them; a first run generates and caches them; a
    run asking for more prompts generates only the new ones; another recipe starts afresh."""
    import train.training.pair_answers as answer_data
    from tests.decoding.decoding_helpers import build, tiny_config

    verifier = build(tiny_config("llama", 32, vocab=40), 3)
    prompts = {"train": [[1, i, i + 1] for i in range(2, 12)], "validation": [[1, 30, 31], [1, 32]]}
    monkeypatch.setattr(answer_data, "chat_set_fingerprint", lambda: "set-a")
    monkeypatch.setattr(answer_data, "chat_prompt_ids", lambda tok, split, n, plen, seed: prompts[split][:n])
    monkeypatch.setattr(answer_data, "eos_token_ids", lambda t, v: [0])
    generated: list[int] = []
    real = answer_data.answer_prompts
    monkeypatch.setattr(
        answer_data,
        "answer_prompts",
        lambda e, v, p, *a, **k: generated.append(len(p)) or real(e, v, p, *a, **k),
    )
    build_cfg = SimpleNamespace(
        out_dir=str(tmp_path),
        train_prompts=4,
        val_prompts=2,
        answer_tokens=3,
        answer_batch=8,
        top_logprobs=2,
        prompt_len=16,
        seed=0,
    )
    model = SimpleNamespace(smollm2=build_cfg)
    first = answer_data.pair_answers(model, verifier, None)
    assert generated == [2, 4] and [a.prompt for a in first["train"]] == prompts["train"][:4]
    again = answer_data.pair_answers(model, verifier, None)
    assert generated == [2, 4]  # all cached
    assert [a.answer for a in again["train"]] == [a.answer for a in first["train"]]
    more = answer_data.pair_answers(model, verifier, None, train_prompts=7)
    assert generated == [2, 4, 3] and [a.prompt for a in more["train"]] == prompts["train"][:7]
    fewer = answer_data.pair_answers(model, verifier, None, train_prompts=4)["train"]
    assert [a.answer for a in fewer] == [a.answer for a in more["train"][:4]] and generated == [2, 4, 3]
    # a cache written before issue 53 names top_logprobs top_k: the same recipe, rewritten under the new name
    meta_path = tmp_path / "answers" / "answers.json"
    meta = json.loads(meta_path.read_text())
    meta["recipe"] = {("top_k" if k == "top_logprobs" else k): v for k, v in meta["recipe"].items()}
    meta_path.write_text(json.dumps(meta))
    answer_data.pair_answers(model, verifier, None, train_prompts=4)
    assert generated == [2, 4, 3]
    assert json.loads(meta_path.read_text())["recipe"]["top_logprobs"] == 2
    assert "top_k" not in json.loads(meta_path.read_text())["recipe"]
    build_cfg.top_logprobs = 3  # another recipe: every answer again
    answer_data.pair_answers(model, verifier, None)
    assert generated == [2, 4, 3, 2, 4]
    assert answer_data.pair_answers(SimpleNamespace(smollm2=None), verifier, None) is None


# ------------------------------------------------------------------ sampled answers


@pytest.fixture(scope="module")
def sampling_verifier():
    from tests.decoding.decoding_helpers import build, tiny_config

    verifier = build(tiny_config("llama", 32, vocab=40), 3)
    with torch.no_grad():
        verifier.lm_head.weight.mul_(30)  # a peaked next-token law, so the temperature shows
    return verifier


def test_sampled_answers_follow_the_verifiers_law_at_the_temperature(sampling_verifier):
    """The first sampled token of 3,000 answers to one prompt against softmax(logits / T) of the verifier
    (chi-square, pooled cells); the greedy token's law (T -> 0) would fail it."""
    from tests.decoding.spec_reference import chi2_critical, chi_square

    prompt, n, temperature = [1, 7, 3, 9], 3000, 0.7
    out = sampled_answers(sampling_verifier, [0], [prompt], n, temperature, 1, 500, seed=4)
    assert len(out) == n and all(a.prompt == prompt and len(a.answer) == 1 for a in out)
    with torch.no_grad():
        logits = sampling_verifier(torch.tensor([prompt])).logits[0, -1].double()
    probs = dict(enumerate(torch.softmax(logits / temperature, -1).tolist()))
    counts: dict[int, int] = {}
    for a in out:
        counts[a.answer[0]] = counts.get(a.answer[0], 0) + 1
    stat, df = chi_square(counts, probs, n)
    assert stat < chi2_critical(df), (stat, df)
    assert len(counts) > 5  # sampled, not the argmax
    hotter = dict(enumerate(torch.softmax(logits / 1.0, -1).tolist()))
    stat, df = chi_square(counts, hotter, n)
    assert stat > chi2_critical(df)  # the test sees the wrong temperature


def test_sampled_answers_are_cached_per_recipe(sampling_verifier, tmp_path, monkeypatch):
    import train.training.answer_sources as answer_data

    prompts = [[1, 2, 3], [4, 5], [6]]
    calls: list[int] = []
    generate = answer_data.answer_prompts

    def counted(engine, verifier, rows, *args, **kwargs):
        calls.append(len(rows))
        return generate(engine, verifier, rows, *args, **kwargs)

    monkeypatch.setattr(answer_data, "answer_prompts", counted)
    assert sampled_answers(sampling_verifier, [0], prompts, 0, 1.0, 6, 4, 0, tmp_path) == []
    first = sampled_answers(sampling_verifier, [0], prompts, 2, 1.0, 6, 4, 0, tmp_path)
    assert [a.prompt for a in first] == [p for p in prompts for _ in range(2)]  # each prompt, twice
    again = sampled_answers(sampling_verifier, [0], prompts, 2, 1.0, 6, 4, 0, tmp_path)
    assert [a.answer for a in again] == [a.answer for a in first] and calls == [6]  # read, not regenerated
    sampled_answers(sampling_verifier, [0], prompts, 2, 0.5, 6, 4, 0, tmp_path)  # a new recipe
    sampled_answers(sampling_verifier, [0], prompts[:2], 2, 0.5, 6, 4, 0, tmp_path)  # other prompts
    assert calls == [6, 6, 4]
    (tmp_path / "answers.pt").unlink()  # a cache cut short is regenerated
    sampled_answers(sampling_verifier, [0], prompts[:2], 2, 0.5, 6, 4, 0, tmp_path)
    assert calls == [6, 6, 4, 4]
    # more top tokens than cached: regenerated; fewer (EAGLE-3 reading the real pair's top-16 answers): read
    wide = sampled_answers(sampling_verifier, [0], prompts[:2], 2, 0.5, 6, 4, 0, tmp_path, top_logprobs=3)
    assert calls == [6, 6, 4, 4, 4] and all(a.top_ids.shape[1] == 3 for a in wide)
    narrow = sampled_answers(sampling_verifier, [0], prompts[:2], 2, 0.5, 6, 4, 0, tmp_path, top_logprobs=1)
    assert calls == [6, 6, 4, 4, 4] and [a.answer for a in narrow] == [a.answer for a in wide]
    # a manifest written before issue 53 (top_logprobs named top_k) serves the same recipe
    manifest = tmp_path / "sampled.json"
    meta = json.loads(manifest.read_text())
    meta["recipe"]["top_k"] = meta["recipe"].pop("top_logprobs")
    manifest.write_text(json.dumps(meta))
    old = sampled_answers(sampling_verifier, [0], prompts[:2], 2, 0.5, 6, 4, 0, tmp_path, top_logprobs=3)
    assert calls == [6, 6, 4, 4, 4] and [a.answer for a in old] == [a.answer for a in wide]
    with pytest.raises(TypeError, match="use top_logprobs="):
        sampled_answers(sampling_verifier, [0], prompts[:2], 2, 0.5, 6, 4, 0, tmp_path, top_k=3)  # type: ignore[call-arg]
    # other stop tokens: regenerated; a manifest from before the stop tokens were recorded serves
    sampled_answers(sampling_verifier, [0, 7], prompts[:2], 2, 0.5, 6, 4, 0, tmp_path, top_logprobs=3)
    assert calls == [6, 6, 4, 4, 4, 4]
    meta = json.loads(manifest.read_text())
    del meta["recipe"]["eos"]
    manifest.write_text(json.dumps(meta))
    sampled_answers(sampling_verifier, [0], prompts[:2], 2, 0.5, 6, 4, 0, tmp_path, top_logprobs=3)
    assert calls == [6, 6, 4, 4, 4, 4]


def test_eagle3_config_checks_the_sampled_answers_keys():
    from functools import partial

    from train.methods.eagle3.config import Eagle3Config

    adam = partial(torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ConfigError, match="method.sampled_answers"):
        Eagle3Config(optimizer=adam, sampled_answers=-1)
    with pytest.raises(ConfigError, match="method.sampled_temperature"):
        Eagle3Config(optimizer=adam, sampled_answers=1, sampled_temperature=0.0)
