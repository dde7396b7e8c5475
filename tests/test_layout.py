"""The house rules a newcomer relies on (docs/architecture.md): small files, one name per module."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
#: Every method folder (train/methods/<name>/) has the same three parts under the same names, on purpose.
METHOD_PARTS = {"config.py", "module.py", "finish.py"}


def _sources() -> list[Path]:
    return sorted([*(ROOT / "train").rglob("*.py"), *(ROOT / "scripts").glob("*.py"), ROOT / "train.py"])


def test_no_source_file_is_over_the_limit():
    long = {
        str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by job): {long}"


def test_no_two_modules_in_train_share_a_name():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in (ROOT / "train").rglob("*.py"):
        rel = path.relative_to(ROOT)
        method_part = (
            rel.parts[:2] == ("train", "methods") and len(rel.parts) == 4 and path.name in METHOD_PARTS
        )
        if path.name != "__init__.py" and not method_part:
            by_name[path.stem].append(str(rel))
    packages = {p.name for p in (ROOT / "train").rglob("*") if p.is_dir() and (p / "__init__.py").exists()}
    for name in packages & set(by_name):
        by_name[name].append(f"the package {name}/")
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"module names used twice in train/: {shared}"
