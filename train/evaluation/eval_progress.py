"""The evaluation's progress over every generation: a rich bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["EvalProgress", "progress_line"]


class EvalProgress:
    """Progress over every generation: a rich bar on a terminal; on a log file or a pipe (CI, ``nohup``,
    ``| tee``), where a live bar shows nothing until it ends, one plain line per tenth with the elapsed
    time and an estimate of what is left. Silent when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar: Any = None
        self._plain = False
        self._total, self._done, self._next_line = total, 0, 1
        self._description = "eval"
        self._started = time.perf_counter()
        if not enabled:
            return
        from rich.console import Console

        if not Console().is_terminal:
            self._plain = True
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        )
        self._task = self._bar.add_task("eval", total=total)

    def __enter__(self) -> EvalProgress:
        self._started = time.perf_counter()
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()

    def describe(self, text: str) -> None:
        self._description = text
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def advance(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
        elif self._plain and self._done * 10 >= self._next_line * self._total:
            self._next_line = self._done * 10 // self._total + 1
            print(
                progress_line(
                    self._description, self._done, self._total, time.perf_counter() - self._started
                ),
                flush=True,
            )


def progress_line(description: str, done: int, total: int, elapsed: float) -> str:
    """``"eval T=0 seed=1: 40/120 generations, 3 min elapsed, about 6 min left"`` (the rate so far)."""
    left = elapsed * (total - done) / done if done else float("nan")
    return (
        f"eval {description}: {done}/{total} generations, {elapsed / 60:.0f} min elapsed, "
        f"about {left / 60:.0f} min left"
    )
