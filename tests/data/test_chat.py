"""The embedded chat prompt set (``data=chat``): its records, split by source, and rendering."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from datasets import Dataset
from hydra.utils import instantiate
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.conftest import CONF_DIR
from train.data.chat import FUNCTION_TEMPLATES, MAX_CONTENT, build_records, chat_records, split_of_source
from train.data.lm import make_prompts
from train.data.sources import DataSourceConfig, load_text_dataset
from train.evaluation.prompts import build_prompts

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
"""SmolLM2-135M-Instruct's chat template, verbatim."""
ASSISTANT_HEADER = "<|im_start|>assistant\n"
FUNCTION_PREFIXES = tuple(t.split("{")[0] for t in FUNCTION_TEMPLATES)


@pytest.fixture(scope="module")
def chatml() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer shaped like SmolLM2's: BOS is ``<|im_start|>``, EOS ``<|im_end|>``."""
    vocab = {tok: i for i, tok in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|im_start|>", "<|im_end|>", "<|pad|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    out.chat_template = SMOLLM2_TEMPLATE
    return out


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    return chat_records()


def _content(record: dict) -> str:
    return record["messages"][0]["content"]


def test_build_is_deterministic(splits) -> None:
    first, second = build_records(), build_records()  # fresh child interpreters, each its own hash seed
    assert json.dumps(first) == json.dumps(second)
    cached = sorted(json.dumps(r, sort_keys=True) for rows in splits.values() for r in rows)
    assert cached == sorted(json.dumps(r, sort_keys=True) for r in first)


def test_records_are_well_formed(splits) -> None:
    records = [r for rows in splits.values() for r in rows]
    for record in records:
        assert set(record) == {"messages", "source", "kind"}
        (message,) = record["messages"]
        assert message["role"] == "user" and message["content"].strip()
        if record["kind"] == "function":
            assert record["source"] in sys.stdlib_module_names
            assert _content(record).startswith(FUNCTION_PREFIXES)
            assert len(_content(record)) <= MAX_CONTENT
        else:
            assert record["kind"] == "topic" and record["source"].startswith("pydoc:")
            assert len(_content(record)) <= 2 * MAX_CONTENT
        assert " at 0x" not in _content(record)
    contents = [_content(r) for r in records]
    assert len(set(contents)) == len(contents)  # no request twice
    kinds = [r["kind"] for r in records]
    assert kinds.count("function") > 800 and 50 < kinds.count("topic") < 100


def test_splits_are_disjoint_by_source(splits) -> None:
    sources = {name: {r["source"] for r in rows} for name, rows in splits.items()}
    assert not sources["train"] & sources["validation"]
    assert not sources["train"] & sources["test"]
    assert not sources["validation"] & sources["test"]
    for name, rows in splits.items():
        assert all(split_of_source(r["source"]) == name for r in rows)
    assert len(splits["train"]) > 1000
    assert len(splits["validation"]) >= 30 and len(splits["test"]) >= 30
    assert len(sources["validation"]) >= 5 and len(sources["test"]) >= 5


def _doc_of(content: str) -> str:
    """The docstring paragraph a function request quotes (the template's ``{doc}``)."""
    for template in FUNCTION_TEMPLATES:
        pattern = re.escape(template)
        for field in ("name", "signature", "module"):
            pattern = pattern.replace(re.escape("{" + field + "}"), ".*?")
        match = re.fullmatch(pattern.replace(re.escape("{doc}"), "(?P<doc>.*)"), content, re.DOTALL)
        if match:
            return match["doc"]
    raise AssertionError(f"no template matches {content!r}")


def test_no_docstring_in_two_splits(splits) -> None:
    docs = {
        name: {_doc_of(_content(r)) for r in rows if r["kind"] == "function"} for name, rows in splits.items()
    }
    assert not docs["train"] & (docs["validation"] | docs["test"])
    assert not docs["validation"] & docs["test"]


def test_fractions_come_from_the_config(splits) -> None:
    wide = chat_records(validation_fraction=0.2, test_fraction=0.2)
    assert sum(len(v) for v in wide.values()) == sum(len(v) for v in splits.values())
    assert len(wide["test"]) > 2 * len(splits["test"]) and len(wide["train"]) < len(splits["train"])
    test_sources = {r["source"] for r in splits["test"]}
    assert test_sources <= {r["source"] for r in wide["test"]}  # buckets grow, nothing moves out


def test_trailing_user_message_renders_a_generation_prompt(tmp_path: Path, chatml) -> None:
    rows = [
        {"messages": [{"role": "user", "content": f"question {i}"}]}
        if i % 2
        else {
            "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "ok"}]
        }
        for i in range(20)
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dsd = load_text_dataset(
        DataSourceConfig(name="jsonl", data_files=str(path), messages_field="messages"), chatml
    )
    seen = set()
    for row in (r for name in dsd for r in dsd[name]):
        assert row["prompt"].endswith(ASSISTANT_HEADER) and row["text"] == row["prompt"] + row["response"]
        seen.add(row["response"])
        if row["response"] == "":
            user = row["prompt"].split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            msgs = [{"role": "user", "content": user}]
            assert row["prompt"] == chatml.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True
            )
    assert seen == {"", "ok<|im_end|>\n"}


def test_chat_source_renders_with_the_template(splits, chatml) -> None:
    with pytest.raises(ValueError, match="chat template"):
        load_text_dataset(DataSourceConfig(name="chat"))
    dsd = load_text_dataset(DataSourceConfig(name="chat"), chatml)
    assert list(dsd) == ["train", "validation", "test"]
    for name in dsd:
        assert dsd[name].column_names == ["text", "prompt", "response"]
        assert len(dsd[name]) == len(splits[name])
    row, record = dsd["test"][0], splits["test"][0]
    assert row["prompt"] == chatml.apply_chat_template(
        record["messages"], tokenize=False, add_generation_prompt=True
    )
    assert row["prompt"].startswith("<|im_start|>system\n") and row["prompt"].endswith(ASSISTANT_HEADER)
    assert _content(record) in row["prompt"]
    assert (
        set(dsd["validation"]["response"]) == {""}
        and dsd["validation"]["text"] == dsd["validation"]["prompt"]
    )


def test_chat_source_config_rules() -> None:
    assert DataSourceConfig(name="chat").kind == "chat"
    assert DataSourceConfig(name="chat").shape == "messages"
    with pytest.raises(ValueError, match="data_files"):
        DataSourceConfig(name="chat", data_files="x.jsonl")
    with pytest.raises(ValueError, match="own columns"):
        DataSourceConfig(name="chat", messages_field="conversation")


def test_make_prompts_keeps_whole_chat_prompts(chatml) -> None:
    test = load_text_dataset(DataSourceConfig(name="chat"), chatml)["test"]
    bos = chatml.bos_token_id
    header = [bos] + chatml("assistant\n", add_special_tokens=False)["input_ids"]
    full = make_prompts(test, chatml, prompt_len=4096, continuation_len=0)
    assert len(full) == len(test)
    for row in full:
        ids = row["input_ids"]
        assert ids[0] == bos and ids[-len(header) :] == header and row["continuation_ids"] == []
        assert chatml.decode(ids) == test[row["doc_index"]]["prompt"]  # one BOS: <|im_start|> is BOS
    lengths = sorted(len(ids) for ids in full["input_ids"])
    limit = lengths[len(lengths) // 2]
    short = make_prompts(test, chatml, prompt_len=limit, continuation_len=0)
    assert len(short) == sum(n <= limit for n in lengths) < len(test)  # longer ones skipped, not cut
    assert all(chatml.decode(ids).startswith("<|im_start|>system\n") for ids in short["input_ids"])


def test_build_prompts_on_the_chat_source(chatml) -> None:
    prompts = build_prompts(chatml, DataSourceConfig(name="chat"), num_prompts=6, prompt_len=4096)
    header = chatml.encode(ASSISTANT_HEADER, add_special_tokens=False)
    assert len(prompts) == 6
    for prompt in prompts:
        assert prompt.shape[0] == 1 and prompt[0, 0].item() == chatml.bos_token_id
        assert prompt[0, -len(header) :].tolist() == header


def test_conf_data_chat_instantiates() -> None:
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(CONF_DIR / "data" / "chat.yaml")
    cfg.seed = 0
    source = instantiate(cfg)
    assert isinstance(source, DataSourceConfig) and source.kind == "chat"
    assert (source.validation_fraction, source.test_fraction) == (0.05, 0.05)


def test_empty_split_keeps_its_columns() -> None:
    from train.data.chat import load_chat_splits

    splits = load_chat_splits(validation_fraction=0.0, test_fraction=0.0)
    assert len(splits["test"]) == 0 and isinstance(splits["test"], Dataset)
    assert splits["test"].column_names == ["messages", "source", "kind"]


def test_two_interpreters_in_different_places_build_the_same_set(tmp_path: Path, splits) -> None:
    """The same Python run from two virtual environments (different paths: ``sys.executable``, which
    ``platform.architecture`` puts into its signature's default) builds the same records."""
    import subprocess

    built = []
    for where in (tmp_path / "a", tmp_path / "elsewhere" / "deeper" / "b"):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
        built.append(build_records(python=str(where / "bin" / "python")))
    assert built[0] == built[1]
    assert all(str(tmp_path) not in r["messages"][0]["content"] for r in built[0])
    here = [r for split in splits.values() for r in split]
    assert len(built[0]) == len(here)


def test_machine_dependent_requests_are_named() -> None:
    from train.data.chat import machine_dependent

    assert machine_dependent(f"Write `architecture(executable={sys.executable!r}, bits='')`.")
    assert not machine_dependent("Return the square root of the sample variance.")
