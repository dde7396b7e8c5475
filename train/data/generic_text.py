"""Generic text for pretraining a drafter *without* its verifier: what the Python installation ships.

The real pair's drafter (docs/real_pair.md) is pretrained on this text, as DistillSpec starts from a
small model pretrained on general data with the verifier's tokenizer and only then aligns it to the
verifier. Nothing here is the verifier's output. Three sources, each split so that no evaluation prompt's
module or topic is in the training text:

* **code**: the standard library's sources (:mod:`train.data.corpus`, split by file);
* **docs**: the ``pydoc`` topics (the text behind ``help("TOPIC")``), split as the chat prompt set
  splits topic requests (:func:`train.data.chat.split_of_source` on the topic's source name);
* **requests**: the chat prompt set's user turns, rendered with the verifier's chat template, each
  ending where the assistant's answer would start (:mod:`train.data.chat`; its own split).

:func:`generic_text` returns ``{split: [document, ...]}`` for ``train`` and ``validation``;
:func:`generic_text_fingerprint` names what it read, for the caches built from it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from train.data.chat import chat_records, split_of_source
from train.data.corpus import DEFAULT_CORPUS_DIR, build_corpus

__all__ = ["GENERIC_SPLITS", "generic_text", "generic_text_fingerprint", "pydoc_topics", "rendered_requests"]

GENERIC_SPLITS = ("train", "validation")


def pydoc_topics() -> dict[str, str]:
    """``{source: text}`` of each pydoc topic title, under the source name the chat set gives its
    requests (``pydoc:<first key of the title>``), so both split alike."""
    from pydoc_data.topics import topics

    out: dict[str, str] = {}
    seen: set[str] = set()
    for key in sorted(topics):
        text = topics[key]
        title = text.strip().split("\n", 1)[0].strip()
        if title and title not in seen:
            seen.add(title)
            out[f"pydoc:{key}"] = text
    return out


def rendered_requests(tokenizer: Any, split: str) -> list[str]:
    """The chat set's user turns of ``split``, rendered with the chat template up to the answer's start."""
    return [
        tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        for r in chat_records()[split]
    ]


def generic_text(tokenizer: Any, corpus_dir: str = DEFAULT_CORPUS_DIR) -> dict[str, list[str]]:
    """``{"train": [...], "validation": [...]}``: code, docs and rendered requests of each split."""
    corpus = build_corpus(corpus_dir)
    topics = pydoc_topics()
    out: dict[str, list[str]] = {}
    for split in GENERIC_SPLITS:
        docs = [text for source, text in topics.items() if split_of_source(source) == split]
        out[split] = list(corpus[split]["text"]) + docs + rendered_requests(tokenizer, split)
    return out


def generic_text_fingerprint(texts: dict[str, list[str]]) -> str:
    """A digest of the documents of every split (what a drafter pretrained on them saw)."""
    digest = hashlib.sha256()
    for split in sorted(texts):
        digest.update(split.encode())
        for text in texts[split]:
            digest.update(hashlib.sha256(text.encode("utf-8")).digest())
    return digest.hexdigest()[:16]
