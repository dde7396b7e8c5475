"""The house rules a newcomer relies on (docs/architecture.md): small files, one name per module, no
import cycles, a file map that names every module."""

from __future__ import annotations

import ast
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


MAX_PARAMETERS, MAX_FUNCTION_LINES = 8, 80


def _comments_beside(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The comment lines right above a function (above or among its decorators) and its ``def`` line."""
    first = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    above = [line for line in lines[first : node.lineno - 1] if line.strip().startswith("#")]
    i = first - 1
    while i >= 0 and lines[i].strip().startswith("#"):
        above.append(lines[i])
        i -= 1
    return " ".join([*above, lines[node.lineno - 1]])


def long_functions_without_a_reason(root: Path, relative_to: Path = ROOT) -> list[str]:
    """Functions under ``root`` with more than MAX_PARAMETERS parameters (self and cls aside) or more than
    MAX_FUNCTION_LINES lines whose comment beside them does not say why ("more than 8 parameters: ...",
    "more than 80 lines: ...")."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = node.args
            names = [
                a.arg
                for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
                if a.arg not in ("self", "cls")
            ]
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            comments = _comments_beside(lines, node)
            where = f"{path.relative_to(relative_to)}:{node.lineno} {node.name}"
            if len(names) > MAX_PARAMETERS and f"more than {MAX_PARAMETERS} parameters:" not in comments:
                found.append(f"{where} ({len(names)} parameters)")
            if length > MAX_FUNCTION_LINES and f"more than {MAX_FUNCTION_LINES} lines:" not in comments:
                found.append(f"{where} ({length} lines)")
    return found


def test_no_long_function_in_train_without_a_reason_beside_it():
    """docs/architecture.md: a function over 80 lines or 8 parameters says why beside its ``def``."""
    assert not long_functions_without_a_reason(ROOT / "train"), long_functions_without_a_reason(
        ROOT / "train"
    )


def test_the_long_function_check_sees_one(tmp_path):
    nine = "(a, b, c, d, e, f, g, h, i):\n    pass\n\n\n"
    long = "(self):\n" + "    pass\n" * 80 + "\n\n"
    (tmp_path / "m.py").write_text(
        f"def many{nine}"
        f"# more than 8 parameters: a test\ndef excused{nine}"
        f"# more than 8 parameters: a test\n@staticmethod\n@staticmethod\ndef above_decorators{nine}"
        f"@staticmethod\n# more than 8 parameters: a test\ndef among_decorators{nine}"
        f"@staticmethod\ndef decorated{nine}"
        f"def longer{long}"
        f"# more than 80 lines: a test\ndef long_excused{long}"
        f"# more than 80 lines: a test\ndef wrong_reason{nine}"
    )
    found = long_functions_without_a_reason(tmp_path, tmp_path)
    assert found[0] == "m.py:1 many (9 parameters)"  # where, which, and why it is found
    assert [f.split(" ", 1)[1] for f in found] == [
        "many (9 parameters)",
        "decorated (9 parameters)",
        "longer (81 lines)",
        "wrong_reason (9 parameters)",
    ]
