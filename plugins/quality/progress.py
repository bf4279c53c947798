"""Progress of one ``autotune quality`` run on stderr: done / total, elapsed, time left.

A benchmark on a CPU takes minutes, so silence looks like a hang. On a terminal a bar is redrawn
in place; in a log or a pipe (no terminal) a plain line is printed every few seconds and when
the run ends, so ``autotune quality ... 2> log`` still shows how far it got.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

__all__ = ["QualityProgress", "format_seconds"]


def format_seconds(s: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``: short enough for one status line."""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class QualityProgress:
    """Reports a measurement's progress; use as a context manager, feed :meth:`update`.

    Args:
        label: What is measured, e.g. ``mmlu model.gguf``.
        unit: What is counted (``items``, ``windows``).
        stream: Where to write (default: stderr).
        every_s: Seconds between plain lines when the stream is not a terminal.
        tty: Override the terminal check (tests).
        clock: Monotonic clock (tests).
    """

    def __init__(
        self,
        label: str,
        unit: str,
        *,
        stream: TextIO | None = None,
        every_s: float = 5.0,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label = label
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self.started = clock()
        self.done = 0
        self.total: int | None = None
        self._last_line = -float("inf")
        self._printed: tuple[int, int | None] | None = None
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> "QualityProgress":
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            # The console is bound to the stream now: lm-eval's own output is silenced later by
            # redirecting sys.stderr, which must not swallow this bar.
            self._bar = Progress(
                TextColumn(self.label),
                BarColumn(),
                TextColumn(f"{{task.completed}}/{{task.total}} {self.unit}"),
                TimeElapsedColumn(),
                TextColumn("left"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=True,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=None)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
            self._bar = None
        elif exc[0] is None and self.total:
            self._line(force=True)

    def note(self, message: str) -> None:
        """A one-off line (what is being prepared before the first item)."""
        if self._bar is not None:
            self._bar.console.print(f"{self.label}: {message}", highlight=False)
        else:
            print(f"{self.label}: {message}", file=self.stream, flush=True)

    def update(self, done: int, total: int) -> None:
        """``done`` of ``total`` units are finished."""
        self.done, self.total = done, total
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)
        else:
            self._line()

    def status(self) -> str:
        """``mmlu model.gguf: 120/285 items, 42s elapsed, about 58s left``."""
        elapsed = self.clock() - self.started
        text = f"{self.label}: {self.done}/{self.total} {self.unit}, {format_seconds(elapsed)} elapsed"
        if self.total and 0 < self.done < self.total:
            text += f", about {format_seconds(elapsed * (self.total - self.done) / self.done)} left"
        return text

    def _line(self, force: bool = False) -> None:
        now = self.clock()
        if (force and self._printed != (self.done, self.total)) or now - self._last_line >= self.every_s:
            self._last_line = now
            self._printed = (self.done, self.total)
            print(self.status(), file=self.stream, flush=True)
