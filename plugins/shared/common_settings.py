"""The ``[backends.NAME]`` settings that several engines declare alike, and the checks they share:
one declaration each, so a key means the same and is refused in the same words whichever engine
the study runs (``autotune plugins`` lists them per backend)."""

from __future__ import annotations

from typing import Any

from autotune.api import Setting
from autotune._builtin import SERVING_UNITS

__all__ = ["REQUEST_TIMEOUT_S", "STABILITY_METRIC", "at_least_one", "not_negative", "positive", "tcp_port"]


def positive(value: Any) -> str | None:
    """A setting's check: a timeout, size or count that must be > 0."""
    return None if value > 0 else "must be > 0"


def not_negative(value: Any) -> str | None:
    """A setting's check: an amount where 0 is a real answer (no noise, no overhead, no delay)."""
    return None if value >= 0 else "must be >= 0"


def at_least_one(value: Any) -> str | None:
    """A setting's check: a count of tokens or items, where 0 would mean none at all."""
    return None if value >= 1 else "must be >= 1"


def tcp_port(value: Any) -> str | None:
    """A setting's check: the port a deploy command names."""
    return None if 1 <= value <= 65535 else "must be a TCP port, 1 to 65535"


# Every backend repeats a run until this quantity's spread is small (autotune.measure.loop).
STABILITY_METRIC = Setting(
    "stability_metric",
    str,
    "aggregate_tok_s",
    "the quantity whose spread decides when to stop repeating",
    choices=tuple(SERVING_UNITS),
)

# An engine served over HTTP: the bound is per request, whole (autotune.measure.deadline), since a
# per-read timeout lets a server that streams without finishing hold the trial for ever.
REQUEST_TIMEOUT_S = Setting(
    "request_timeout_s",
    float,
    600.0,
    "bound on each request, from sending it to its "
    "last byte, seconds (not per read: a stream kept open without finishing fails the trial then)",
    check=positive,
)
