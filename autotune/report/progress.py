"""Live progress of a study on the terminal: trials done, best so far, time left."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from autotune.study.admission import budget_of, budget_text
from autotune.toolkit import terminal


FIXED = ("backend", "weights", "ctx", "parallel")


def config_text(cfg: dict[str, Any]) -> str:
    """A configuration in one line, every searched value in it (cache type, flash attention,
    offload, batch sizes...): two different trials never print the same line."""

    def shown(v: Any) -> str:
        return ("on" if v else "off") if isinstance(v, bool) else str(v)

    options = " ".join(f"{k}={shown(v)}" for k, v in cfg.items() if k not in FIXED)
    return f"{cfg.get('backend')} {cfg.get('weights')} ctx {cfg.get('ctx')} x{cfg.get('parallel')}" + (
        f" {options}" if options else ""
    )


def header_text(prepared: Any, study_file: Any, n_trials: int | None = None, budget_s: float | None = None) -> str:
    """The run's first line: which study file, storage, engine(s) and card, its memory budget,
    and what this run may spend (trials, seconds)."""
    engines = []
    for name in prepared.space.entries:
        backend = prepared.backend(name)
        try:
            version = backend.engine_build(prepared.contexts.get(name))
        except Exception as exc:  # noqa: BLE001 - a header never stops a study
            version = f"version unknown ({type(exc).__name__})"
        engines.append(f"{name} ({backend.engine or name} {version})")
    cfg = prepared.cfg
    where = budget_of(prepared.gpu, cfg.vram_budget_bytes, cfg.safety_margin_bytes).describe()
    budget = f"memory budget {budget_text(prepared.vram_budget_bytes)} = {where}"
    plan = [f"{n_trials} trials" if n_trials else "", f"{budget_s:g} s" if budget_s else ""]
    # gpu = "cpu": the device is the host (its name says "CPU: ..."), not a card.
    device = "device" if prepared.gpu.is_cpu else "card"
    hardware = f"{device}: {prepared.gpu.name} ({budget})"
    placement = getattr(prepared, "placement", None)
    if placement is not None:
        # Several cards: each one with its own budget (autotune.hardware.placement).
        hardware = (
            f"{len(placement.cards)} {device}s, memory budget {budget_text(placement.total_budget_bytes)} in "
            f"all: " + "; ".join(placement.lines())
        )
    return f"study {study_file} -> {prepared.shown_storage}; engines: {', '.join(engines) or '-'}; {hardware}" + (
        f"; this run: up to {' or '.join(p for p in plan if p)}" if any(plan) else ""
    )


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
            self.live.update(Text(terminal.shown(text)))
        else:
            self.console.print(terminal.shown(text), highlight=False, soft_wrap=True, markup=False)

    def update(self, event: Any) -> None:
        self.counts[event.state] = self.counts.get(event.state, 0) + 1
        if self.live is None:
            if not self.quiet and event.answered_from is None and event.state in ("COMPLETE", "FAIL"):
                cfg = event.config
                outcome = f"{event.value:.1f}" if event.value is not None else f"failed: {event.reason}"
                if event.value is not None and getattr(event, "broken", ()):
                    # A figure alone read as a candidate: a trial over its target says it is not one.
                    outcome += f" (infeasible: {', '.join(event.broken)})"
                self.console.print(
                    terminal.shown(f"trial {event.number}: {config_text(cfg)} -> {outcome}"),
                    highlight=False,
                    soft_wrap=True,
                    markup=False,
                )
            return
        done = f"{event.n_done}" + (f"/{self.n_trials}" if self.n_trials else "")
        elapsed = time.monotonic() - self.start
        left = ""
        if self.budget_s:
            left = f" | time left {max(self.budget_s - elapsed, 0):.0f}s"
        best = "none yet"
        if event.best_value is not None and event.best_config:
            cfg = event.best_config
            best = f"{event.best_value:.1f} ({config_text(cfg)})"
        text = (
            f"trials {done} (ok {self.counts['COMPLETE']}, pruned {self.counts['PRUNED']}, failed {self.counts['FAIL']})"
            f" | best {best}{left}"
        )
        self.live.update(Text(terminal.shown(text)))
