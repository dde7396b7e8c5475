"""The shell commands that README.md and docs/*.md show a user, extracted so tests can run them.

A command is a line of a fenced ``bash``/``sh`` block (continuation lines joined, ``&&`` chains split,
trailing ``# comments`` dropped) or an inline code span that starts with a program a user runs
(``python``, ``pytest``, ``srun``, ``torchrun``). Each is parsed into an :class:`DocCommand` naming its
entry point (``train.py``, ``scripts/<name>.py``, ``pytest`` or ``pip``) and its arguments.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO_ROOT

DOC_FILES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
PROGRAMS = ("python", "pytest", "srun", "torchrun", "pip")
_FENCE = re.compile(r"^```(\w*)\s*$")
_INLINE = re.compile(r"`((?:python|pytest|srun|torchrun) [^`]+)`")
_SHELL_BLOCKS = {"bash", "sh", "shell", "console", ""}


@dataclass(frozen=True)
class DocCommand:
    """One documented command: where it is written, its text, and what it runs."""

    source: str
    """``file:line`` of the command in the docs."""
    text: str
    entry: str
    """``train.py``, ``scripts/<name>.py``, ``pytest`` or ``pip``."""
    args: tuple[str, ...]
    launcher: str | None = None
    """``srun`` or ``torchrun`` when a cluster launcher starts the command."""
    flags: tuple[str, ...] = field(default=())
    """Options before the entry point (``-m`` of a Hydra sweep)."""

    @property
    def multirun(self) -> bool:
        return "-m" in self.flags or "--multirun" in self.flags


def _strip_comment(line: str) -> str:
    """The line without a trailing shell comment (a ``#`` outside quotes, after whitespace)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _block_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every line in fenced shell blocks, continuations joined."""
    out: list[tuple[int, str]] = []
    in_block, lang = False, ""
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = _FENCE.match(line.strip())
        if fence:
            in_block, lang = (not in_block, fence.group(1)) if not in_block else (False, "")
            continue
        if not in_block or lang not in _SHELL_BLOCKS:
            continue
        if pending is not None:
            start, head = pending
            line = head + " " + line.strip()
            number = start
            pending = None
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1].rstrip())
            continue
        out.append((number, line.strip()))
    return out


def _inline_lines(text: str) -> list[tuple[int, str]]:
    """(line number, command) of inline code spans that run a program."""
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            continue
        out.extend((number, m.group(1).strip()) for m in _INLINE.finditer(line))
    return out


def parse(source: str, text: str) -> DocCommand | None:
    """A :class:`DocCommand` for one shell command, or None when it runs none of our programs."""
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    if not words or words[0] not in PROGRAMS:
        return None
    launcher = None
    if words[0] in ("srun", "torchrun"):
        launcher, words = words[0], words[1:]
        while words and words[0].startswith("-"):  # the launcher's own options
            words = words[1:]
        if words and words[0] == "python":
            pass
        elif words:
            words = ["python", *words]
    if words[0] == "pip":
        return DocCommand(source, text, "pip", tuple(words[1:]), launcher)
    if words[0] == "pytest":
        return DocCommand(source, text, "pytest", tuple(words[1:]), launcher)
    flags: list[str] = []
    rest = words[1:]
    if rest[:2] == ["-m", "pytest"]:
        return DocCommand(source, text, "pytest", tuple(rest[2:]), launcher)
    if not rest or not rest[0].endswith(".py"):
        return None
    entry, rest = rest[0], rest[1:]
    while rest and rest[0] in ("-m", "--multirun"):
        flags.append(rest.pop(0))
    return DocCommand(source, text, entry, tuple(rest), launcher, tuple(flags))


def documented_commands(files: list[Path] | None = None) -> list[DocCommand]:
    """Every command of README.md and docs/*.md, in document order, each text once."""
    seen: set[str] = set()
    commands: list[DocCommand] = []
    for path in files or DOC_FILES:
        text = path.read_text()
        rel = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path.name
        lines = sorted(_block_lines(text) + _inline_lines(text))
        for number, line in lines:
            for part in _strip_comment(line).split("&&"):
                part = part.strip()
                command = parse(f"{rel}:{number}", part)
                if command is not None and part not in seen:
                    seen.add(part)
                    commands.append(command)
    return commands
