"""The twins' simulated thermal throttling: a clock of simulated load shared by a process's trials."""

from __future__ import annotations

from typing import ClassVar


class SimulatedClock:
    """Seconds of simulated load, shared by every trial of a process, for thermal throttling."""

    _elapsed: ClassVar[dict[int, float]] = {}

    def __init__(self, after_s: float | None, factor: float):
        self.after_s = after_s
        self.factor = factor
        self.throttled = False

    def advance(self, seconds: float) -> float:
        if self.after_s is None:
            return 1.0
        key = id(type(self))
        elapsed = self._elapsed.get(key, 0.0) + seconds
        self._elapsed[key] = elapsed
        self.throttled = elapsed > self.after_s
        return self.factor if self.throttled else 1.0
