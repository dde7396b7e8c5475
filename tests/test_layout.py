"""The house rules a newcomer relies on (docs/architecture.md): small files, one name per module, no
import cycles, a file map that names every module."""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
#: Every method folder (train/methods/<name>/) has the same parts under the same names, on purpose.
METHOD_PARTS = {"config.py", "module.py", "finish.py", "build.py"}


def _sources() -> list[Path]:
    packages = (*(ROOT / "train").rglob("*.py"), *(ROOT / "research").rglob("*.py"))
    return sorted([*packages, *(ROOT / "scripts").glob("*.py"), ROOT / "train.py"])


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


def import_cycles(package: str = "train") -> list[list[str]]:
    """Every set of ``package``'s modules that import each other in a circle (strongly connected
    components of the import graph, grimp's: function-local and type-checking imports count)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(package, include_external_packages=False)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                cycles.append(sorted(component))

    for module in edges:
        if module not in index:
            visit(module)
    return cycles


def test_no_module_of_train_imports_itself_back():
    assert import_cycles() == [], "import cycles in train/ (make the arrows run one way)"


def test_the_cycle_check_sees_function_local_imports(tmp_path, monkeypatch):
    """The check would have caught the method folders' old loop (config.build importing its module inside
    the function, the module importing the config at the top)."""
    pkg = tmp_path / "loop"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text(
        "def build():\n    from loop.module import Module  # noqa\n    return Module\n"
    )
    (pkg / "module.py").write_text("from loop.config import build\n\n\nclass Module:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("loop") == [["loop.config", "loop.module"]]


def _file_map_names() -> set[str]:
    """The names docs/architecture.md's file map gives in backticks (the floors and the engine tables)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tables = text.split("## The house on one screen")[1].split("## Flow of one run")[0]  # and research/
    names = set(re.findall(r"`([\w/.]+)`", tables))
    leaves = {n.rstrip("/").rsplit("/", 1)[-1] for n in names}
    return names | leaves | {leaf.removesuffix(".py") for leaf in leaves}


def test_the_file_map_names_every_module_and_folder_of_train():
    names = _file_map_names()
    unnamed = []
    for path in sorted((ROOT / "train").rglob("*.py")):
        if path.name == "__init__.py" or path.parent == ROOT / "train":
            continue  # top-level modules are named with their .py in floor 1-2 rows
        if path.stem not in names and f"{path.stem}.py" not in names:
            unnamed.append(str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "train").glob("*.py")):
        if path.name != "__init__.py" and not ({path.name, path.stem, f"train/{path.name}"} & names):
            unnamed.append(str(path.relative_to(ROOT)))
    assert not unnamed, f"docs/architecture.md's file map does not name: {unnamed}"
    stale = [name for name in names if name.startswith("train/") and not (ROOT / name.rstrip("/")).exists()]
    assert not stale, f"docs/architecture.md names paths that do not exist: {stale}"


def test_the_file_map_names_every_module_outside_the_package():
    names = _file_map_names()
    outside = [*(ROOT / "research").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]
    unnamed = [
        str(path.relative_to(ROOT))
        for path in sorted(outside)
        if path.name != "__init__.py" and not ({path.name, path.stem} & names)
    ]
    assert not unnamed, f"docs/architecture.md's file map does not name: {unnamed}"
