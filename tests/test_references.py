"""Every file path and ``train.*`` name that the docs, configs and docstrings cite exists.

Docs that point at missing files mislead a reader more than no docs: this walks README.md, docs/ (not
the changelog, which names what was), conf/, scripts/, research/ and train/ for repository paths
(``train/decoding/loop.py``, ``docs/trees.md``) and dotted names (``train.decoding.rules.chain.verify_chain``)
and resolves each one.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from train.config import RENAMED_TARGETS

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "changelog.md"),  # it names what was
    *sorted((ROOT / "conf").rglob("*.yaml")),
    *sorted((ROOT / "scripts").glob("*.py")),
    *sorted((ROOT / "research").rglob("*.py")),
    *sorted((ROOT / "train").rglob("*.py")),
    ROOT / "pyproject.toml",
]
#: A path into the repository: one of its top folders, then path characters, ending in a file name with an
#: extension (metric keys such as ``train/loss`` are not paths; globs such as ``conf/decoding/bpd*.yaml`` stop
#: at the ``*`` and are left out).
TOP_FOLDERS = "train|research|docs|conf|scripts|tests|\\.ci"
PATH = re.compile(rf"(?<![\w/.-])((?:{TOP_FOLDERS})/[\w./-]*\.[A-Za-z]+)(?![\w*])")
#: A dotted name under the package (not a file name such as train.py / train.log).
DOTTED = re.compile(r"(?<![\w./-])(train(?:\.[A-Za-z_]\w*)+)")
NOT_NAMES = {"py", "log", "json", "yaml", "md", "csv", "txt", "jsonl"}


def _cited(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    found = []
    for source in SOURCES:
        for match in pattern.finditer(source.read_text(encoding="utf-8")):
            found.append((str(source.relative_to(ROOT)), match.group(1).rstrip(".")))
    return found


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[-1] in NOT_NAMES or any(old.startswith(dotted) for old in RENAMED_TARGETS):
        return True  # a file name, or an old name that keeps working on purpose
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_cited_path_exists():
    missing = sorted({f"{src}: {path}" for src, path in _cited(PATH) if not (ROOT / path).exists()})
    assert not missing, "paths cited but missing:\n" + "\n".join(missing)


def test_every_cited_train_name_resolves():
    cited = [
        (src, name) for src, name in _cited(DOTTED) if not name.startswith("train.select")
    ]  # a Dataset split
    missing = sorted({f"{src}: {name}" for src, name in cited if not _resolves(name)})
    assert not missing, "train.* names cited but missing:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", ["ALGORITHMS.md", "ARCHITECTURE.md"])
def test_nothing_cites_files_outside_the_repository(name):
    citing = [str(s.relative_to(ROOT)) for s in SOURCES if name in s.read_text(encoding="utf-8")]
    assert not citing, f"{name} is not in this repository; cited by {citing}"
