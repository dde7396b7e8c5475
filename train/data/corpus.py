"""The embedded default corpus: the running Python's standard library sources.

Every Python installation carries its standard library as ``.py`` files (code, comments and
docstrings), so the default experiments need no download. This module turns those files into a
``datasets.DatasetDict`` with columns ``text`` (the file content) and ``path`` (relative to the
stdlib root), split *by file* into train / validation / test, and writes it with a
``manifest.json`` that names exactly what was used (Python version, file count, a sha256 over the
sorted ``(relative path, content)`` pairs, split sizes).

What is included (the choice keeps the corpus at roughly 9 MB / ~530 files on CPython 3.11):

* every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, walked in sorted order;
* except directories named in :data:`EXCLUDED_DIRS`: third-party packages (``site-packages``,
  ``dist-packages``), the regression test suites (``test``/``tests``, ~17 MB of mostly repetitive
  test code), ``idlelib`` and ``turtledemo`` (applications rather than library), ``encodings``
  (codec tables of hex literals that would skew a tokenizer) and ``pydoc_data`` (one generated
  757 KB file of help text), plus ``__pycache__``;
* and files larger than :data:`MAX_FILE_BYTES` (a guard against generated tables; none of the
  3.11 files kept is that big) or not valid UTF-8.

The split is a pure function of each file's relative path (sha256 bucket out of 100:
90 train / 5 validation / 5 test), so a file never moves between splits when other files
appear or disappear. Should a tiny corpus leave a split empty, a file is moved into it from the
largest split so that every split is non-empty when there are >= 3 files.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict, load_from_disk

__all__ = [
    "CORPUS_FORMAT_VERSION",
    "DEFAULT_CORPUS_DIR",
    "EXCLUDED_DIRS",
    "MAX_FILE_BYTES",
    "SPLIT_PERCENT",
    "build_corpus",
    "collect_stdlib_files",
    "corpus_fingerprint",
    "load_corpus",
    "read_manifest",
    "split_of",
    "stdlib_root",
]

CORPUS_FORMAT_VERSION = 1
DEFAULT_CORPUS_DIR = "data/stdlib_corpus"
EXCLUDED_DIRS: frozenset[str] = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idlelib",
        "turtledemo",
        "encodings",
        "pydoc_data",
    }
)
MAX_FILE_BYTES = 256 * 1024
# Percent buckets per split, in order: [0, 90) train, [90, 95) validation, [95, 100) test.
SPLIT_PERCENT: tuple[tuple[str, int], ...] = (("train", 90), ("validation", 5), ("test", 5))
SPLITS: tuple[str, ...] = tuple(name for name, _ in SPLIT_PERCENT)

_MANIFEST = "manifest.json"
_DATASET_SUBDIR = "dataset"


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def collect_stdlib_files(
    root: str | os.PathLike[str] | None = None,
    *,
    excluded_dirs: Iterable[str] = EXCLUDED_DIRS,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> list[tuple[str, str]]:
    """Return the sorted ``(relative posix path, content)`` pairs that make up the corpus."""
    base = Path(root) if root is not None else stdlib_root()
    excluded = frozenset(excluded_dirs)
    rels: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in excluded)
        for fname in filenames:
            if fname.endswith(".py"):
                rels.append(Path(dirpath, fname).relative_to(base).as_posix())
    pairs: list[tuple[str, str]] = []
    for rel in sorted(rels):
        path = base / rel
        try:
            if path.stat().st_size > max_file_bytes:
                continue
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            pairs.append((rel, text))
    return pairs


def _bucket(rel_path: str) -> int:
    return int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big") % 100


def split_of(rel_path: str) -> str:
    """The split a file belongs to: a pure function of its relative path."""
    bucket = _bucket(rel_path)
    edge = 0
    for name, pct in SPLIT_PERCENT:
        edge += pct
        if bucket < edge:
            return name
    return SPLITS[-1]


def _assign_splits(paths: list[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {name: [] for name in SPLITS}
    for rel in paths:
        groups[split_of(rel)].append(rel)
    # Tiny corpora: make every split non-empty when possible, deterministically (the largest
    # split, train on ties, gives up its highest-bucket file).
    for name in SPLITS:
        if groups[name]:
            continue
        donor_split = max(SPLITS, key=lambda s: (len(groups[s]), s == "train"))
        if len(groups[donor_split]) > 1:
            donor = max(groups[donor_split], key=lambda p: (_bucket(p), p))
            groups[donor_split].remove(donor)
            groups[name].append(donor)
    return {name: sorted(files) for name, files in groups.items()}


def corpus_fingerprint(pairs: Iterable[tuple[str, str]]) -> str:
    """sha256 over the sorted ``(relative path, content)`` pairs (length-prefixed, unambiguous)."""
    digest = hashlib.sha256()
    for rel, text in sorted(pairs):
        for part in (rel.encode("utf-8"), text.encode("utf-8")):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
    return digest.hexdigest()


def _build_config(excluded_dirs: Iterable[str], max_file_bytes: int) -> dict[str, Any]:
    return {
        "format_version": CORPUS_FORMAT_VERSION,
        "excluded_dirs": sorted(excluded_dirs),
        "max_file_bytes": max_file_bytes,
        "split_percent": [list(item) for item in SPLIT_PERCENT],
    }


def read_manifest(out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of a built corpus, or ``None`` if there is none (or it is unreadable)."""
    path = Path(out_dir) / _MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def load_corpus(out_dir: str | os.PathLike[str] = DEFAULT_CORPUS_DIR) -> DatasetDict:
    """Load a corpus written by :func:`build_corpus` (no fingerprint check)."""
    path = Path(out_dir) / _DATASET_SUBDIR
    if read_manifest(out_dir) is None or not path.is_dir():
        raise FileNotFoundError(f"no corpus built under {out_dir!s}; call build_corpus() first")
    loaded = load_from_disk(str(path))
    if not isinstance(loaded, DatasetDict):
        raise ValueError(f"{path} does not hold a DatasetDict")
    return loaded


def build_corpus(
    out_dir: str | os.PathLike[str] = DEFAULT_CORPUS_DIR,
    force: bool = False,
    *,
    root: str | os.PathLike[str] | None = None,
    excluded_dirs: Iterable[str] = EXCLUDED_DIRS,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> DatasetDict:
    """Build (or reuse) the stdlib corpus under ``out_dir`` and return it.

    The cached copy is reused only when its manifest's fingerprint (content hash plus build
    settings) equals the current one; otherwise, or with ``force=True``, it is rebuilt.
    Layout: ``out_dir/manifest.json`` and ``out_dir/dataset/`` (``DatasetDict.save_to_disk``).
    ``root`` overrides the stdlib directory (used by tests).
    """
    out = Path(out_dir)
    excluded = sorted(excluded_dirs)
    pairs = collect_stdlib_files(root, excluded_dirs=excluded, max_file_bytes=max_file_bytes)
    if not pairs:
        raise RuntimeError(f"no Python sources found under {root or stdlib_root()}")
    config = _build_config(excluded, max_file_bytes)
    content_sha = corpus_fingerprint(pairs)
    fingerprint = hashlib.sha256(
        json.dumps({"content_sha256": content_sha, "config": config}, sort_keys=True).encode()
    ).hexdigest()

    if not force:
        manifest = read_manifest(out)
        if manifest is not None and manifest.get("fingerprint") == fingerprint:
            try:
                return load_corpus(out)
            except (FileNotFoundError, ValueError, OSError):
                pass  # damaged cache: rebuild below

    texts = dict(pairs)
    groups = _assign_splits([rel for rel, _ in pairs])
    dsd = DatasetDict(
        {
            name: Dataset.from_dict({"text": [texts[p] for p in files], "path": list(files)})
            for name, files in groups.items()
        }
    )
    manifest = {
        "fingerprint": fingerprint,
        "content_sha256": content_sha,
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "python": sys.version,
        "stdlib_root": str(Path(root) if root is not None else stdlib_root()),
        "num_files": len(pairs),
        "num_chars": sum(len(t) for _, t in pairs),
        "config": config,
        "splits": {
            name: {"files": len(files), "chars": sum(len(texts[p]) for p in files)}
            for name, files in groups.items()
        },
        "files": {name: files for name, files in groups.items()},
    }
    _write_atomically(out, dsd, manifest)
    return load_corpus(out)


def _write_atomically(out: Path, dsd: DatasetDict, manifest: dict[str, Any]) -> None:
    """Write dataset + manifest into a temporary sibling directory, then swap it in."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        dsd.save_to_disk(str(tmp / _DATASET_SUBDIR))
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            # Only ever remove what this module wrote (a manifest marks our directories).
            if read_manifest(out) is None and any(out.iterdir()):
                raise FileExistsError(f"{out} exists and is not a corpus directory; refusing to replace it")
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
