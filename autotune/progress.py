"""Live progress of a study on the terminal: trials done, best so far, time left."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text


class LiveProgress:
    """A one-line live display fed by the runner's per-trial callback.

    On a terminal the line is redrawn in place; elsewhere (a log, CI) one line is printed per
    launched configuration, so long real studies still show progress; ``quiet`` prints nothing.
    """

    def __init__(self, enabled: bool, n_trials: int | None, budget_s: float | None, quiet: bool = False):
        self.enabled = enabled
        self.quiet = quiet
        self.n_trials = n_trials
        self.budget_s = budget_s
        self.start = time.monotonic()
        self.console = Console(stderr=True)
        self.live: Live | None = None
        self.counts = {"COMPLETE": 0, "PRUNED": 0, "FAIL": 0}

    def __enter__(self) -> "LiveProgress":
        if self.enabled:
            self.live = Live(Text("starting..."), console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def note(self, text: str) -> None:
        """A line about work between trials (the finish's re-measures)."""
        if self.quiet:
            return
        if self.live is not None:
            self.live.update(Text(text))
        else:
            self.console.print(text, highlight=False, soft_wrap=True, markup=False)

    def update(self, event: Any) -> None:
        self.counts[event.state] = self.counts.get(event.state, 0) + 1
        if self.live is None:
            if not self.quiet and event.answered_from is None and event.state in ("COMPLETE", "FAIL"):
                cfg = event.config
                outcome = f"{event.value:.1f}" if event.value is not None else f"failed: {event.reason}"
                self.console.print(
                    f"trial {event.number}: {cfg.get('backend')} {cfg.get('weights')} ctx {cfg.get('ctx')} "
                    f"x{cfg.get('parallel')} -> {outcome}", highlight=False, soft_wrap=True, markup=False)
            return
        done = f"{event.n_done}" + (f"/{self.n_trials}" if self.n_trials else "")
        elapsed = time.monotonic() - self.start
        left = ""
        if self.budget_s:
            left = f" | time left {max(self.budget_s - elapsed, 0):.0f}s"
        best = "none yet"
        if event.best_value is not None and event.best_config:
            cfg = event.best_config
            best = f"{event.best_value:.1f} ({cfg.get('backend')} {cfg.get('weights')} ctx {cfg.get('ctx')} x{cfg.get('parallel')})"
        text = (
            f"trials {done} (ok {self.counts['COMPLETE']}, pruned {self.counts['PRUNED']}, failed {self.counts['FAIL']})"
            f" | best {best}{left}"
        )
        self.live.update(Text(text))
