"""The embedded chat prompt set: instructions built only from what the Python installation ships.

No download: every instruction comes from the running interpreter's standard library.

* **function** requests: for each documented public function of a standard-library module (packages
  walked into their submodules), a request to write it from its signature and the first prose
  paragraph of its docstring, in one of :data:`FUNCTION_TEMPLATES` chosen by a stable hash of
  ``module.name``. Kept when the paragraph has :data:`MIN_DOC` to :data:`MAX_DOC` characters, the
  signature is known (``inspect.signature``, else a leading ``name(...)`` docstring line) and
  deterministic (no ``<object at 0x...>`` or set reprs), and the request is at most
  :data:`MAX_CONTENT` characters. A docstring paragraph already used by another source is dropped
  (``ntpath``/``posixpath``, ``profile``/``cProfile`` share theirs), so no request is repeated
  across splits.
* **topic** requests: for each topic of ``pydoc_data.topics`` (the text behind ``help("TOPIC")``;
  topics sharing a title, such as ``if``/``else``, count once), a request to explain it by its title,
  in one of :data:`TOPIC_TEMPLATES`; one of them quotes the topic's first prose paragraph.

Each record is one user turn ``{"messages": [{"role": "user", "content": ...}], "source": ...,
"kind": "function" | "topic"}``; ``source`` is the top-level module or package (``email`` for
``email.utils``) or ``pydoc:<topic>``. Rendered with the verifier's chat template
(``add_generation_prompt``) a record becomes a prompt that ends where the assistant's answer starts
(:mod:`train.data.sources`).

The split is by **source**, from a sha256 of its name (:func:`split_of_source`): every request about
one package lands in the same split, so no evaluation prompt shares a module with a training one.
Within a split, records are in the order of a sha256 of ``source`` and content (sources interleaved,
fixed).

Nothing that depends on the machine reaches a record: a request whose text holds the interpreter's path
(``platform.architecture``'s default ``executable``), an installation prefix, the home, working or
temporary directory, or the quoted user or host name is dropped (:func:`machine_dependent`), so two
interpreters of the same Python in different places build the same set.

The records are collected in a child interpreter (``python -I -S``: no site-packages, no
environment, no working directory on ``sys.path``), so the ~350 imports and whatever they do on
import stay out of the training process, and the set depends only on the Python installation.
That takes about a second, so the set is built in memory, once per process, rather than cached on
disk like the stdlib corpus (:mod:`train.data.corpus`): no stale cache to invalidate, and the same
Python gives the same set, byte for byte.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import hashlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import socket
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "FUNCTION_TEMPLATES",
    "SKIPPED_MODULES",
    "TOPIC_TEMPLATES",
    "build_records",
    "chat_records",
    "collect_records",
    "machine_dependent",
    "load_chat_splits",
    "split_of_source",
    "stable_fraction",
]

SKIPPED_MODULES = frozenset(
    {
        *("antigravity", "this", "__main__", "readline", "rlcompleter"),  # act on import
        *("tkinter", "turtle", "turtledemo", "idlelib", "curses"),  # GUI / terminal
        *("pdb", "code", "codeop", "site", "sitecustomize", "usercustomize"),  # interpreter hooks
        *("test", "tests", "lib2to3", "distutils", "ensurepip", "venv"),  # tests, tools, setuptools'
        *("pydoc_data", "encodings"),  # data, not functions
        *("msilib", "msvcrt", "nt", "winreg", "winsound"),  # Windows only
    }
)
"""Never imported (nor their submodules): side effects on import (a browser, printing, a GUI, the
readline completer, a REPL), test suites, tools rather than library, shadowed by setuptools
(``distutils``), codec tables (``encodings``), or Windows only."""

MIN_DOC, MAX_DOC = 30, 300
"""Docstring paragraphs kept (characters): shorter say too little, longer make prompts long."""
MAX_SIGNATURE = 100
MAX_CONTENT = 400
"""The longest function request (characters of user content)."""
MAX_EXCERPT = 240
"""The longest documentation excerpt quoted in a topic request (characters)."""

FUNCTION_TEMPLATES = (
    "Write a Python function `{name}{signature}` that does the following: {doc}",
    "Implement `{name}{signature}` in Python. {doc}",
    "Write `{name}{signature}` from scratch, without importing `{module}`. Its documentation: {doc}",
    "Here is the documentation of a function:\n\n{name}{signature}\n    {doc}\n\nWrite it in Python.",
)
TOPIC_TEMPLATES = (
    "Python topic: {title}.\n\nExplain this topic briefly, with a short code example.",
    "Give a short explanation of the following Python topic, with an example: {title}.",
    "The Python documentation on the topic below begins like this.\n\nTopic: {title}\n{excerpt}\n\n"
    "Explain it in plain words, with a short example.",
)

SPLITS = ("train", "validation", "test")
_UNSTABLE_REPR = re.compile(r"<|\{| at 0x")  # object reprs (addresses), set reprs (hash order)


def stable_fraction(text: str) -> float:
    """A number in [0, 1) fixed by ``text`` (sha256; Python's ``hash`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64


def split_of_source(source: str, validation_fraction: float = 0.05, test_fraction: float = 0.05) -> str:
    """``"train"``, ``"validation"`` or ``"test"`` for every record of ``source``."""
    x = stable_fraction("chat-split:" + source)
    if x < test_fraction:
        return "test"
    return "validation" if x < test_fraction + validation_fraction else "train"


def _pick(options: tuple[str, ...], key: str) -> str:
    return options[int(stable_fraction(key) * len(options))]


# --- collecting (runs in the child interpreter) ---------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        yield


def _import(name: str) -> Any:
    try:
        with _quiet():
            return importlib.import_module(name)
    except BaseException:  # a module that does not import here is skipped, whatever it raises
        return None


def stdlib_modules() -> list[tuple[str, Any]]:
    """``(name, module)`` of every importable public standard-library module, packages walked, sorted."""
    out: list[tuple[str, Any]] = []

    def visit(name: str) -> None:
        if any(part.startswith("_") or part in SKIPPED_MODULES for part in name.split(".")):
            return
        module = _import(name)
        if module is None:
            return
        out.append((name, module))
        for info in sorted(pkgutil.iter_modules(getattr(module, "__path__", None) or []), key=str):
            visit(f"{name}.{info.name}")

    for name in sorted(sys.stdlib_module_names):
        visit(name)
    return out


def doc_paragraph(name: str, doc: str) -> str:
    """The docstring's first prose paragraph on one line (a leading ``name(...)`` line is skipped)."""
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        text = " ".join(paragraph.split())
        if text and not text.startswith(f"{name}("):
            return text
    return ""


def signature_of(name: str, obj: Any) -> str | None:
    """``"(a, b=1)"`` from ``inspect.signature``, else from a leading ``name(...)`` docstring line."""
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        first = (obj.__doc__ or "").lstrip().split("\n", 1)[0]
        match = re.match(rf"{re.escape(name)}(\(.*\))", first)
        if match is None:
            return None
        signature = match.group(1)
    if len(signature) > MAX_SIGNATURE or _UNSTABLE_REPR.search(signature):
        return None
    return signature


def module_functions(module_name: str, module: Any) -> list[tuple[str, str, str]]:
    """``(name, signature, doc paragraph)`` of each documented public function defined in the module.

    Defined here means ``__module__`` is the module (or its C accelerator ``_name``); re-exports and
    aliases are left to the module that defines them.
    """
    owners = {module_name, "_" + module_name}
    out = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not inspect.isroutine(obj):
            continue
        if getattr(obj, "__module__", None) not in owners or getattr(obj, "__name__", None) != name:
            continue
        doc = doc_paragraph(name, obj.__doc__ or "")
        if not MIN_DOC <= len(doc) <= MAX_DOC:
            continue
        signature = signature_of(name, obj)
        if signature is not None:
            out.append((name, signature, doc))
    return out


def function_records() -> list[dict[str, Any]]:
    """One request per kept function, by module; a docstring already used by another source is dropped."""
    records = []
    owner: dict[str, str] = {}
    for module_name, module in stdlib_modules():
        source = module_name.split(".")[0]
        for name, signature, doc in module_functions(module_name, module):
            if owner.setdefault(doc, source) != source:
                continue
            template = _pick(FUNCTION_TEMPLATES, f"{module_name}.{name}")
            content = template.format(name=name, signature=signature, doc=doc, module=module_name)
            if len(content) <= MAX_CONTENT:
                records.append(_record(content, source, "function"))
    return records


def topic_excerpt(text: str) -> str:
    """The first prose paragraph of a pydoc topic (no heading, grammar, code or version note), shortened."""
    for paragraph in text.split("\n\n")[1:]:
        lines = paragraph.strip("\n").split("\n")
        if (
            not paragraph.strip()
            or paragraph.startswith((" ", "*", "New in version", "Changed in version"))
            or "::=" in paragraph
            or set(lines[-1]) <= set("=-*")
            or len(lines) == 1
        ):
            continue
        flat = " ".join(paragraph.split())
        if len(flat) <= MAX_EXCERPT:
            return flat
        return flat[: flat.rfind(" ", 0, MAX_EXCERPT - 3)] + "..."
    return ""


def topic_records() -> list[dict[str, Any]]:
    """One request per pydoc topic title (the first topic key, sorted, names the source)."""
    module = _import("pydoc_data.topics")
    topics: dict[str, str] = getattr(module, "topics", {})
    records = []
    seen: set[str] = set()
    for key in sorted(topics):
        text = topics[key]
        title = text.strip().split("\n", 1)[0].strip()
        if not title or title in seen:
            continue
        seen.add(title)
        excerpt = topic_excerpt(text)
        options = TOPIC_TEMPLATES if excerpt else tuple(t for t in TOPIC_TEMPLATES if "{excerpt}" not in t)
        content = _pick(options, f"pydoc:{key}").format(title=title, excerpt=excerpt)
        records.append(_record(content, f"pydoc:{key}", "topic"))
    return records


def _record(content: str, source: str, kind: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "source": source, "kind": kind}


def _machine_values() -> tuple[set[str], set[str]]:
    """(paths, names) that differ between machines or installations of the same Python."""
    paths = {sys.executable, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
    paths |= {os.path.expanduser("~"), os.getcwd(), tempfile.gettempdir()}
    names = set()
    for read in (getpass.getuser, socket.gethostname):
        with contextlib.suppress(Exception):
            names.add(read())
    return {p for p in paths if p and len(p) > 1}, {n for n in names if n}


def machine_dependent(text: str) -> bool:
    """Whether ``text`` holds a path of this machine's Python or directories, or its quoted user or host
    name (a request holding one would differ between two places the same Python is installed)."""
    paths, names = _machine_values()
    return any(p in text for p in paths) or any(f"'{n}'" in text or f'"{n}"' in text for n in names)


def collect_records() -> list[dict[str, Any]]:
    """Every record, in a fixed order, collected in *this* interpreter (imports ~350 modules); requests
    that depend on the machine (:func:`machine_dependent`) are left out.

    :func:`build_records` runs this in a clean child interpreter; call it directly only there.
    """
    records = [
        r for r in function_records() + topic_records() if not machine_dependent(r["messages"][0]["content"])
    ]
    return sorted(records, key=lambda r: (_order_key(r), r["source"], r["messages"][0]["content"]))


def _order_key(record: dict[str, Any]) -> float:
    return stable_fraction(f"chat-order:{record['source']}\n{record['messages'][0]['content']}")


# --- building (the calling process) ---------------------------------------------------------------

_CHILD = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


def build_records(timeout: float = 300.0, python: str | None = None) -> list[dict[str, Any]]:
    """Collect the records in a child ``python -I -S`` (isolated from this process and site-packages);
    ``python``: the interpreter to run (default: this one's)."""
    with tempfile.TemporaryDirectory(prefix="chat-set-") as tmp:
        out = Path(tmp) / "records.json"
        done = subprocess.run(
            [python or sys.executable, "-I", "-S", "-c", _CHILD, os.path.abspath(__file__), str(out)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=tmp,
        )
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(
                f"building the chat prompt set failed (exit {done.returncode}): {done.stderr[-2000:]}"
            )
        records: list[dict[str, Any]] = json.loads(out.read_text(encoding="utf-8"))
    return records


@functools.lru_cache(maxsize=1)
def _cached_records() -> str:
    return json.dumps(build_records(), ensure_ascii=False)


def chat_set_fingerprint() -> str:
    """A digest of the whole set as built here (its records and their sources, hence their splits): a
    cache of anything derived from the prompts (the SmolLM2 pair's answers) is stale when it changes."""
    return hashlib.sha256(_cached_records().encode("utf-8")).hexdigest()[:16]


def chat_records(
    validation_fraction: float = 0.05, test_fraction: float = 0.05
) -> dict[str, list[dict[str, Any]]]:
    """Every record by split (:func:`split_of_source`); built once per process."""
    out: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    for record in json.loads(_cached_records()):
        out[split_of_source(record["source"], validation_fraction, test_fraction)].append(record)
    return out


def load_chat_splits(validation_fraction: float = 0.05, test_fraction: float = 0.05) -> dict[str, Any]:
    """The set as ``datasets.Dataset`` splits with columns ``messages``, ``source``, ``kind``."""
    from datasets import Dataset, Features, Value

    features = Features(
        {
            "messages": [{"role": Value("string"), "content": Value("string")}],
            "source": Value("string"),
            "kind": Value("string"),
        }
    )
    return {
        split: Dataset.from_dict({k: [r[k] for r in rows] for k in features}, features=features)
        for split, rows in chat_records(validation_fraction, test_fraction).items()
    }


if __name__ == "__main__":  # the child of build_records: python -I -S ... chat.py OUT.json
    Path(sys.argv[-1]).write_text(json.dumps(collect_records(), ensure_ascii=False), encoding="utf-8")
