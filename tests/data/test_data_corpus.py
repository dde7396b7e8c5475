from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from train.data.corpus import (
    SPLITS,
    build_corpus,
    collect_stdlib_files,
    corpus_fingerprint,
    load_corpus,
    read_manifest,
    split_of,
)


def _fake_stdlib(root: Path, n: int = 40) -> Path:
    for i in range(n):
        sub = root / ("pkg" if i % 3 == 0 else "") / f"mod_{i:02d}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(f'"""Module {i}."""\n\n\ndef f_{i}(x):\n    # comment {i}\n    return x + {i}\n')
    for excluded in ("site-packages/pkg", "test", "idlelib", "__pycache__", "encodings"):
        d = root / excluded
        d.mkdir(parents=True, exist_ok=True)
        (d / "skip_me.py").write_text("x = 1\n")
    (root / "notes.txt").write_text("not python\n")
    (root / "big.py").write_text("x = 1\n" * 2000)
    (root / "latin1.py").write_bytes(b"s = '\xe9'\n")
    (root / "empty.py").write_text("\n")
    return root


def _all_paths(dsd) -> list[str]:
    return [p for name in SPLITS for p in dsd[name]["path"]]


def test_collect_excludes_and_sorts(tmp_path: Path) -> None:
    root = _fake_stdlib(tmp_path / "lib")
    pairs = collect_stdlib_files(root, max_file_bytes=4096)
    paths = [p for p, _ in pairs]
    assert paths == sorted(paths)
    assert len(paths) == 40
    assert not any(
        part in {"site-packages", "test", "idlelib", "__pycache__", "encodings"}
        for p in paths
        for part in p.split("/")
    )
    assert "big.py" not in paths and "latin1.py" not in paths and "empty.py" not in paths
    assert "pkg/mod_00.py" in paths


def test_build_fake_corpus_manifest_and_splits(tmp_path: Path) -> None:
    root = _fake_stdlib(tmp_path / "lib")
    out = tmp_path / "corpus"
    dsd = build_corpus(out, root=root, max_file_bytes=4096)
    assert set(dsd) == set(SPLITS)
    for name in SPLITS:
        assert dsd[name].column_names == ["text", "path"]
        assert len(dsd[name]) > 0
        assert list(dsd[name]["path"]) == sorted(dsd[name]["path"])
    paths = _all_paths(dsd)
    assert len(paths) == len(set(paths)) == 40  # disjoint and complete
    for name in SPLITS:
        for p in dsd[name]["path"]:
            assert p in {q for q in paths}
    manifest = read_manifest(out)
    assert manifest is not None
    assert manifest["num_files"] == 40
    pairs = collect_stdlib_files(root, max_file_bytes=4096)
    assert manifest["content_sha256"] == corpus_fingerprint(pairs)
    assert sum(s["files"] for s in manifest["splits"].values()) == 40
    assert sum(s["chars"] for s in manifest["splits"].values()) == sum(len(t) for _, t in pairs)
    assert manifest["python_version"].count(".") == 2
    for name in SPLITS:
        assert manifest["files"][name] == list(dsd[name]["path"])
    # Content round-trips.
    row = dsd["train"][0]
    assert (root / row["path"]).read_text() == row["text"]


def test_build_is_deterministic(tmp_path: Path) -> None:
    root = _fake_stdlib(tmp_path / "lib")
    a = build_corpus(tmp_path / "a", root=root, max_file_bytes=4096)
    b = build_corpus(tmp_path / "b", root=root, max_file_bytes=4096)
    ma, mb = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert ma == mb
    for name in SPLITS:
        assert a[name].to_dict() == b[name].to_dict()


def test_cache_reuse_and_rebuild(tmp_path: Path) -> None:
    root = _fake_stdlib(tmp_path / "lib")
    out = tmp_path / "corpus"
    build_corpus(out, root=root, max_file_bytes=4096)
    manifest_path = out / "manifest.json"
    stamp = manifest_path.stat().st_mtime_ns
    build_corpus(out, root=root, max_file_bytes=4096)
    assert manifest_path.stat().st_mtime_ns == stamp  # reused
    first = read_manifest(out)

    (root / "mod_01.py").write_text("y = 2\n")  # content change -> new fingerprint -> rebuild
    dsd = build_corpus(out, root=root, max_file_bytes=4096)
    second = read_manifest(out)
    assert first is not None and second is not None
    assert second["fingerprint"] != first["fingerprint"]
    assert "y = 2\n" in [t for name in SPLITS for t in dsd[name]["text"]]

    stamp = manifest_path.stat().st_mtime_ns
    time.sleep(0.01)
    build_corpus(out, force=True, root=root, max_file_bytes=4096)
    assert manifest_path.stat().st_mtime_ns != stamp
    assert read_manifest(out)["fingerprint"] == second["fingerprint"]  # type: ignore[index]

    # A different build setting is a different fingerprint too.
    build_corpus(out, root=root, max_file_bytes=1 << 20)
    assert read_manifest(out)["fingerprint"] != second["fingerprint"]  # type: ignore[index]


def test_split_of_is_stable_and_roughly_90_5_5() -> None:
    paths = [f"pkg{i // 50}/mod{i}.py" for i in range(4000)]
    counts = {name: 0 for name in SPLITS}
    for p in paths:
        assert split_of(p) == split_of(p)
        counts[split_of(p)] += 1
    assert 0.87 < counts["train"] / 4000 < 0.93
    assert 0.03 < counts["validation"] / 4000 < 0.07
    assert 0.03 < counts["test"] / 4000 < 0.07


def test_tiny_corpus_has_nonempty_splits(tmp_path: Path) -> None:
    root = tmp_path / "lib"
    root.mkdir()
    for i in range(3):
        (root / f"m{i}.py").write_text(f"x = {i}\n")
    dsd = build_corpus(tmp_path / "c", root=root)
    assert all(len(dsd[name]) == 1 for name in SPLITS)


def test_refuses_to_replace_foreign_directory(tmp_path: Path) -> None:
    root = _fake_stdlib(tmp_path / "lib", n=5)
    out = tmp_path / "precious"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_corpus(out, root=root)
    assert (out / "keep.txt").read_text() == "mine"


def test_load_corpus_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_corpus(tmp_path / "nothing")


def test_real_stdlib_corpus(corpus_dir: Path, corpus) -> None:
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    assert 5_000_000 <= manifest["num_chars"] <= 15_000_000
    assert manifest["num_files"] == sum(len(corpus[name]) for name in SPLITS)
    assert all(len(corpus[name]) > 0 for name in SPLITS)
    paths = _all_paths(corpus)
    assert len(paths) == len(set(paths))
    assert not any(p.startswith(("site-packages/", "test/", "idlelib/")) for p in paths)
    assert "os.py" in paths
    for name in SPLITS:
        assert all(split_of(p) == name for p in corpus[name]["path"])
    t0 = time.perf_counter()
    assert load_corpus(corpus_dir)["train"].num_rows == corpus["train"].num_rows
    assert time.perf_counter() - t0 < 10
