"""When a request must be over, whatever the engine does: the one total deadline of a measurement.

An HTTP client's timeout bounds each read, not the request: an engine that answers ``/health``
and then sends an SSE comment (``: keepalive``) every two seconds never lets a read time out, and
kept a trial (and the study) running forever. So every streamed request computes one total
deadline when it is sent (:func:`request_deadline`: its own ``request_timeout_s``, narrowed by
whatever outer deadline is in force) and checks it as bytes arrive (:func:`check`).

Outer deadlines are set with :func:`within` by whoever owns them (the study runner: its
``--budget``), without every backend passing them down: a context variable carries them into
the backend's calls, and :func:`autotune.measure.run_streams_threaded` carries it into its
threads. The innermost, earliest deadline wins, with its reason.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from autotune.errors import MeasurementError

__all__ = ["Deadline", "DeadlineExceeded", "current", "passed", "request_deadline", "within"]


class DeadlineExceeded(MeasurementError):
    """A request was still open at its total deadline (the message says whose deadline)."""


@dataclass(frozen=True)
class Deadline:
    """A moment on ``time.monotonic()``'s clock and what the user is told when it passes.

    Attributes:
        at_s: When it passes.
        reason: Why the request is ended then, e.g. "request exceeded 600 s total
            (request_timeout_s)".
    """

    at_s: float
    reason: str

    def left_s(self) -> float:
        """Seconds until it passes (<= 0 once it has)."""
        return self.at_s - time.monotonic()

    def check(self) -> None:
        """Raise :class:`DeadlineExceeded` once it has passed."""
        if time.monotonic() >= self.at_s:
            raise DeadlineExceeded(f"{self.reason}; the engine kept the stream open without finishing")


_OUTER: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("autotune_deadline", default=None)


def current() -> Deadline | None:
    """The earliest outer deadline in force here, or None."""
    return _OUTER.get()


def passed() -> Deadline | None:
    """The outer deadline in force here once it has passed, else None: a failure then is that
    deadline's doing (the study's budget ran out), not the engine's."""
    outer = _OUTER.get()
    return outer if outer is not None and outer.left_s() <= 0 else None


@contextmanager
def within(at_s: float | None, reason: str) -> Iterator[None]:
    """Every request made inside (in this thread, and in the stream threads it starts) ends by
    ``at_s`` (``time.monotonic()``), or earlier if an enclosing deadline says so; None: no bound."""
    outer = _OUTER.get()
    if at_s is None or (outer is not None and outer.at_s <= at_s):
        yield
        return
    token = _OUTER.set(Deadline(at_s, reason))
    try:
        yield
    finally:
        _OUTER.reset(token)


def request_deadline(timeout_s: float, setting: str = "request_timeout_s") -> Deadline:
    """The total deadline of a request sent now: ``timeout_s`` from now, or the outer deadline
    in force when that comes first."""
    own = Deadline(time.monotonic() + timeout_s, f"request exceeded {timeout_s:g} s total ({setting})")
    outer = _OUTER.get()
    return outer if outer is not None and outer.at_s < own.at_s else own
