from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset

from train.data.sources import DataSourceConfig, load_text_dataset

ROWS = [{"body": f"document number {i}\n", "q": f"Q{i}: ", "a": f"answer {i}"} for i in range(40)]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _splits_ok(dsd, columns: list[str]) -> None:
    assert list(dsd) == ["train", "validation", "test"]
    for name in dsd:
        assert dsd[name].column_names == columns


def test_jsonl_text_field_with_carved_splits(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = DataSourceConfig(name="jsonl", data_files=str(path), text_field="body", validation_fraction=0.1)
    dsd = load_text_dataset(cfg)
    _splits_ok(dsd, ["text"])
    assert (len(dsd["train"]), len(dsd["validation"]), len(dsd["test"])) == (34, 4, 2)
    texts = [t for name in dsd for t in dsd[name]["text"]]
    assert sorted(texts) == sorted(r["body"] for r in ROWS)  # disjoint, complete
    again = load_text_dataset(cfg)
    assert again["validation"]["text"] == dsd["validation"]["text"]  # deterministic
    other = load_text_dataset(DataSourceConfig(name="jsonl", data_files=str(path), text_field="body", seed=1))
    assert other["validation"]["text"] != dsd["validation"]["text"]


def test_json_prompt_response_with_split_files(tmp_path: Path) -> None:
    train = tmp_path / "train.json"
    train.write_text(json.dumps(ROWS[:30]))
    test = tmp_path / "test.json"
    test.write_text(json.dumps(ROWS[30:]))
    cfg = DataSourceConfig(
        name="json",
        data_files={"train": str(train), "test": [str(test)]},
        prompt_field="q",
        response_field="a",
        validation_fraction=0.2,
    )
    dsd = load_text_dataset(cfg)
    _splits_ok(dsd, ["text", "prompt", "response"])
    assert len(dsd["test"]) == 10 and len(dsd["validation"]) == 6 and len(dsd["train"]) == 24
    row = dsd["test"][0]
    assert row["text"] == row["prompt"] + row["response"]
    assert row["prompt"].startswith("Q30") and row["response"] == "answer 30"


def test_parquet_with_explicit_split_mapping(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    Dataset.from_list([{"text": r["body"]} for r in ROWS]).to_parquet(str(path))
    cfg = DataSourceConfig(
        name="parquet",
        data_files=str(path),
        split={"train": "train[:30]", "validation": "train[30:35]", "test": "train[35:]"},
    )
    dsd = load_text_dataset(cfg)
    _splits_ok(dsd, ["text"])
    assert [len(dsd[s]) for s in dsd] == [30, 5, 5]
    assert dsd["validation"][0]["text"] == "document number 30\n"


def test_text_files_and_max_samples(tmp_path: Path) -> None:
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"line {i}\n" for i in range(100)))
    dsd = load_text_dataset(DataSourceConfig(name="text", data_files=[str(path)], max_samples=20))
    _splits_ok(dsd, ["text"])
    assert len(dsd["train"]) == 20 and len(dsd["validation"]) == 5 and len(dsd["test"]) == 5


def test_chat_messages(tmp_path: Path, tokenizer) -> None:
    rows = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yo {i}"}]}
        for i in range(20)
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = DataSourceConfig(name="jsonl", data_files=str(path), messages_field="messages")
    with pytest.raises(ValueError, match="tokenizer"):
        load_text_dataset(cfg)
    dsd = load_text_dataset(cfg, tokenizer)
    _splits_ok(dsd, ["text", "prompt", "response"])
    row = dsd["train"][0]
    assert row["text"] == row["prompt"] + row["response"]
    assert row["prompt"].startswith(tokenizer.bos_token) and row["prompt"].endswith("### assistant\n")
    assert row["response"].startswith("yo ") and row["response"].endswith(tokenizer.eos_token + "\n")


def test_stdlib_source(corpus_dir: Path, corpus) -> None:
    dsd = load_text_dataset(DataSourceConfig(corpus_dir=str(corpus_dir)))
    _splits_ok(dsd, ["text"])
    assert len(dsd["validation"]) == len(corpus["validation"])


def test_missing_column_is_named(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match="text_field='text'"):
        load_text_dataset(DataSourceConfig(name="jsonl", data_files=str(path)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": ""}, "name"),
        ({"name": "json"}, "data_files"),
        ({"name": "stdlib", "data_files": "x.json"}, "data_files"),
        ({"name": "json", "data_files": ["a.json", 3]}, "data_files"),
        ({"split": {"train": "train", "dev": "validation"}}, "allowed keys"),
        ({"split": {"validation": "validation"}}, "train"),
        ({"split": {"train": ""}}, "split"),
        ({"prompt_field": "q"}, "response_field"),
        ({"prompt_field": "q", "response_field": "a", "messages_field": "m"}, "messages_field"),
        ({"text_field": ""}, "text_field"),
        ({"validation_fraction": 1.5}, "validation_fraction"),
        ({"test_fraction": -0.1}, "test_fraction"),
        ({"validation_fraction": 0.6, "test_fraction": 0.5}, "< 1"),
        ({"max_samples": 0}, "max_samples"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_bad_configs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DataSourceConfig(**kwargs)


def test_config_is_frozen_and_normalised() -> None:
    cfg = DataSourceConfig(name="json", data_files=["a.json", "b.json"], split={"train": "train"})
    assert cfg.data_files == ("a.json", "b.json")
    assert cfg.kind == "local" and cfg.shape == "text"
    assert DataSourceConfig(name="org/some-dataset").kind == "hub"
    with pytest.raises(AttributeError):
        cfg.name = "x"  # type: ignore[misc]


def test_num_workers_and_pin_memory_reach_the_loaders_of_text_and_prompts() -> None:
    """``data.num_workers`` / ``data.pin_memory`` (conf/data/*.yaml) set the loaders the methods build from
    a data config: packed text (pretraining, Medusa) and prompts (DistillSpec, SD^2)."""
    from types import SimpleNamespace

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tests.conftest import CONF_DIR, make_tokenizer
    from train.config import ConfigError, instantiate_group
    from train.data.datamodule import packed_corpus
    from train.training.prompt_data import prompt_data

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data.num_workers=2", "data.pin_memory=true"])
        bad = compose(config_name="train", overrides=["data.num_workers=-1"])
    source = instantiate_group(cfg, "data")
    tok = make_tokenizer()
    rows = Dataset.from_dict({"input_ids": [[1] * 8] * 4})
    loader = packed_corpus(source, tok, seq_len=8, batch_size=2, seed=0)._loader(rows, train=True)
    assert loader.num_workers == 2 and loader.pin_memory
    settings = SimpleNamespace(prompt_len=8, batch_size=2, max_new_tokens=4, num_prompts=4, num_val_prompts=4)
    loader = prompt_data(settings, tok, source, seed=0)._loader(rows, train=False)
    assert loader.num_workers == 2 and loader.pin_memory
    with pytest.raises(ConfigError, match="num_workers must be an integer >= 0"):
        instantiate_group(bad, "data")
