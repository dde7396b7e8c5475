from __future__ import annotations

import pytest
import torch
from datasets import Dataset, DatasetDict

from train.data.datamodule import LMDataModule, PromptDataModule
from train.data.lm import collate_left_pad, make_prompts, pack_sequences


@pytest.fixture(scope="module")
def small(corpus) -> DatasetDict:
    """Up to 12 modest-sized real stdlib files per split (keeps tokenisation in the tests cheap)."""
    out = {}
    for name in corpus:
        keep = [i for i, text in enumerate(corpus[name]["text"]) if 500 < len(text) < 8000][:12]
        out[name] = corpus[name].select(keep)
    return DatasetDict(out)


def test_pack_sequences(small, tokenizer) -> None:
    packed = pack_sequences(small["train"], tokenizer, seq_len=64)
    assert packed.column_names == ["input_ids"]
    first = packed[0]["input_ids"]
    assert isinstance(first, torch.Tensor) and first.shape == (64,) and first.dtype == torch.long
    stream = []
    for text in small["train"]["text"]:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(packed) == len(stream) // 64
    flat = torch.cat([packed[i]["input_ids"] for i in range(len(packed))]).tolist()
    assert flat == stream[: len(flat)]  # EOS between documents, order preserved
    assert packed[: len(packed)]["input_ids"].shape == (len(packed), 64)


def test_pack_sequences_bos_and_errors(small, tokenizer) -> None:
    packed = pack_sequences(small["validation"], tokenizer, seq_len=32, add_bos=True)
    assert packed[0]["input_ids"][0].item() == tokenizer.bos_token_id
    with pytest.raises(ValueError, match="seq_len"):
        pack_sequences(small["train"], tokenizer, seq_len=1)
    with pytest.raises(ValueError, match="text_column"):
        pack_sequences(small["train"], tokenizer, seq_len=8, text_column="nope")


def test_make_prompts_text(small, tokenizer) -> None:
    prompts = make_prompts(
        small["train"], tokenizer, prompt_len=16, max_prompts=10, seed=3, continuation_len=8
    )
    assert len(prompts) == 10
    assert prompts.column_names == ["input_ids", "continuation_ids", "doc_index"]
    for row in prompts:
        assert row["input_ids"][0] == tokenizer.bos_token_id
        assert len(row["input_ids"]) == 16 and len(row["continuation_ids"]) == 8
        # The prompt and continuation are consecutive tokens of the source document.
        doc = tokenizer(small["train"][row["doc_index"]]["text"], add_special_tokens=False)["input_ids"]
        window = row["input_ids"][1:] + row["continuation_ids"]
        assert any(doc[i : i + len(window)] == window for i in range(len(doc) - len(window) + 1))
    again = make_prompts(small["train"], tokenizer, prompt_len=16, max_prompts=10, seed=3, continuation_len=8)
    assert again.to_dict() == prompts.to_dict()
    other = make_prompts(small["train"], tokenizer, prompt_len=16, max_prompts=10, seed=4, continuation_len=8)
    assert other.to_dict() != prompts.to_dict()


def test_make_prompts_start_mode_and_per_doc(small, tokenizer) -> None:
    start = make_prompts(small["train"], tokenizer, prompt_len=8, seed=0, mode="start", continuation_len=None)
    assert len(start) == len(small["train"])
    for row in start:
        doc = tokenizer(small["train"][row["doc_index"]]["text"], add_special_tokens=False)["input_ids"]
        assert row["input_ids"] == [tokenizer.bos_token_id] + doc[:7]
        assert row["continuation_ids"] == []
    many = make_prompts(small["train"], tokenizer, prompt_len=8, max_prompts=30, prompts_per_doc=3)
    assert len(many) == 30
    with pytest.raises(ValueError, match="mode"):
        make_prompts(small["train"], tokenizer, prompt_len=8, mode="middle")
    with pytest.raises(ValueError, match="prompt_len"):
        make_prompts(small["train"], tokenizer, prompt_len=1)


def test_make_prompts_skips_short_docs(tokenizer) -> None:
    ds = Dataset.from_dict({"text": ["x", "def f():\n    return 1\n" * 20]})
    prompts = make_prompts(ds, tokenizer, prompt_len=8, continuation_len=8)
    assert prompts["doc_index"] == [1]


def test_make_prompts_prompt_response(tokenizer) -> None:
    ds = Dataset.from_dict(
        {
            "text": ["Q: a long question here? A: yes"] * 3,
            "prompt": ["Q: a long question here? A:"] * 3,
            "response": [" yes indeed, the answer"] * 3,
        }
    )
    prompts = make_prompts(ds, tokenizer, prompt_len=4, continuation_len=None)
    assert len(prompts) == 3
    p_ids = tokenizer("Q: a long question here? A:", add_special_tokens=False)["input_ids"]
    r_ids = tokenizer(" yes indeed, the answer", add_special_tokens=False)["input_ids"]
    assert prompts[0]["input_ids"] == [tokenizer.bos_token_id] + p_ids[-3:]  # keeps the end of the prompt
    assert prompts[0]["continuation_ids"] == r_ids
    capped = make_prompts(ds, tokenizer, prompt_len=64, continuation_len=2)
    assert capped[0]["input_ids"] == [tokenizer.bos_token_id] + p_ids
    assert capped[0]["continuation_ids"] == r_ids[:2]


def test_make_prompts_chat_text_keeps_single_bos(tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello there " * 10}], tokenize=False)
    prompts = make_prompts(
        Dataset.from_dict({"text": [text]}), tokenizer, prompt_len=6, mode="start", continuation_len=2
    )
    assert prompts[0]["input_ids"].count(tokenizer.bos_token_id) == 1


def test_collate_left_pad() -> None:
    batch = [
        {"input_ids": [5, 6, 7], "continuation_ids": [1]},
        {"input_ids": torch.tensor([9]), "continuation_ids": [2, 3]},
    ]
    out = collate_left_pad(batch, pad_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7], [0, 0, 9]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert out["continuation_ids"].tolist() == [[1, 0], [2, 3]]
    assert out["continuation_mask"].tolist() == [[1, 0], [1, 1]]
    plain = collate_left_pad([[1, 2], [3]], pad_id=-1)
    assert set(plain) == {"input_ids", "attention_mask"}
    assert plain["input_ids"].tolist() == [[1, 2], [-1, 3]] and plain["input_ids"].dtype == torch.long
    with pytest.raises(ValueError):
        collate_left_pad([], pad_id=0)


def test_lm_datamodule(small, tokenizer) -> None:
    dm = LMDataModule(lambda: small, tokenizer, seq_len=32, batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (4, 32) and batch["input_ids"].dtype == torch.long
    val = next(iter(dm.val_dataloader()))
    assert val["input_ids"].shape[1] == 32
    # Seeded shuffling: same order twice.
    again = next(iter(LMDataModule(small, tokenizer, seq_len=32, batch_size=4).train_dataloader()))
    assert torch.equal(again["input_ids"], batch["input_ids"])


def test_prompt_datamodule(small, tokenizer_dir) -> None:
    dm = PromptDataModule(
        small, str(tokenizer_dir), prompt_len=12, batch_size=3, continuation_len=5, max_prompts=9
    )
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (3, 12) and batch["attention_mask"].shape == (3, 12)
    assert batch["continuation_ids"].shape == (3, 5)
    assert (batch["input_ids"][:, 0] == dm.tokenizer.bos_token_id).all()
    assert len(dm.train_dataset) == 9
    assert next(iter(dm.val_dataloader()))["input_ids"].shape[1] == 12
