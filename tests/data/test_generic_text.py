"""The generic text the real pair's drafter is pretrained on, without the verifier
(train/data/generic_text.py)."""

from __future__ import annotations

from types import SimpleNamespace

from train.data.chat import chat_records, split_of_source
from train.data.generic_text import generic_text_fingerprint, pydoc_topics, rendered_requests


def test_pydoc_topics_split_as_the_chat_sets_topic_requests() -> None:
    """Every topic request of the chat set's test split has its topic's text outside the training text."""
    topics = pydoc_topics()
    requests = {
        r["source"]: split for split, rows in chat_records().items() for r in rows if r["kind"] == "topic"
    }
    assert set(requests) <= set(topics)
    for source, split in requests.items():
        assert split_of_source(source) == split


def test_rendered_requests_are_the_splits_user_turns_up_to_the_answer() -> None:
    seen = []

    def render(messages, tokenize, add_generation_prompt):
        seen.append(add_generation_prompt)
        return "<user>" + messages[0]["content"] + "<assistant>"

    texts = rendered_requests(SimpleNamespace(apply_chat_template=render), "validation")
    assert len(texts) == len(chat_records()["validation"]) and all(seen)
    train = {r["messages"][0]["content"] for r in chat_records()["train"]}
    assert not any(t.removeprefix("<user>").removesuffix("<assistant>") in train for t in texts)


def test_the_fingerprint_names_every_document() -> None:
    texts = {"train": ["a", "b"], "validation": ["c"]}
    first = generic_text_fingerprint(texts)
    assert first == generic_text_fingerprint({"validation": ["c"], "train": ["a", "b"]})
    assert first != generic_text_fingerprint({"train": ["a", "b!"], "validation": ["c"]})
    assert first != generic_text_fingerprint({"train": ["a"], "validation": ["b", "c"]})
