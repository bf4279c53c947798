"""How one configuration is measured: the protocol, its statistics, and repetition.

* :class:`Protocol` says how many warm-ups and runs, and when the runs are stable enough to
  stop.
* :func:`repeat_until_stable_many` applies it to a sample function that yields several
  quantities per run and returns immutable :class:`Stat` objects that keep warm-ups apart
  from values and carry their median and spread together, with a warning (and a remedy)
  when the spread is too high to trust the median.

Relative spread is defined once for the whole tool as ``MAD / |median|`` (median absolute
deviation, unscaled). MAD rather than the standard deviation because one slow run (a page
fault, a log flush) should not force extra runs nor hide an otherwise tight distribution;
rather than ``(p90 - p10) / median`` because with the 3 to 10 runs we can afford, p10 and
p90 are just the extreme values, which is the outlier sensitivity we want to avoid. Read it
as "half of the runs lie within ``rel_spread`` of the median".
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from autotune.errors import ConfigError, MeasurementError

__all__ = ["PROBE_STOP", "Protocol", "Stat", "relative_spread", "repeat_until_stable_many"]

# The stop reason of a measurement its probe ended after the first run (multi-fidelity).
PROBE_STOP = "probe"


def _is_int(value: Any) -> bool:
    # bool is an int subclass; `min_runs = true` in a study file is a typo, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Protocol:
    """How one configuration is measured.

    Attributes:
        warmup_runs: Runs done first and kept apart (caches, JIT, clocks
            ramping up); they never enter the median.
        min_runs: Measured runs always taken, whatever the time budget: the count is the
            same on a quiet machine and a loaded one (where runs are slower), never a
            one-run median with no spread to judge it by.
        max_runs: Measured runs never exceeded, stable or not.
        rel_spread_tol: Largest accepted relative spread, ``MAD / |median|``
            (see the module docstring); 0.05 means half of the runs lie
            within 5% of the median.
        max_seconds: Time budget for the runs beyond ``min_runs`` (the whole
            measurement, warm-ups included, is timed), or None for no budget.
            When spent after ``min_runs`` runs, repetition stops and what was
            measured is kept; a run is never cut short, so the budget can be
            overrun by the warm-ups, the ``min_runs`` runs, or one run more.
            What bounds a run is its requests' own total deadline (a backend's
            ``request_timeout_s``, :mod:`autotune.measure.deadline`).
    """

    warmup_runs: int = 1
    min_runs: int = 3
    max_runs: int = 10
    rel_spread_tol: float = 0.05
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.warmup_runs) or self.warmup_runs < 0:
            raise ConfigError(f"measure.warmup_runs = {self.warmup_runs!r}: must be an integer >= 0")
        if not _is_int(self.min_runs) or self.min_runs < 1:
            raise ConfigError(f"measure.min_runs = {self.min_runs!r}: must be an integer >= 1")
        if not _is_int(self.max_runs) or self.max_runs < self.min_runs:
            raise ConfigError(
                f"measure.max_runs = {self.max_runs!r}: must be an integer >= measure.min_runs ({self.min_runs})"
            )
        if not _is_real(self.rel_spread_tol) or self.rel_spread_tol < 0:
            raise ConfigError(
                f"measure.rel_spread_tol = {self.rel_spread_tol!r}: must be a finite "
                f"number >= 0 (a fraction of the median, e.g. 0.05 for 5%)"
            )
        if self.max_seconds is not None and (not _is_real(self.max_seconds) or self.max_seconds <= 0):
            raise ConfigError(
                f"measure.max_seconds = {self.max_seconds!r}: must be a finite number "
                f"of seconds > 0, or null for no time budget"
            )


# ---------------------------------------------------------------------------
# Stat
# ---------------------------------------------------------------------------


def relative_spread(values: Sequence[float]) -> float:
    """Returns ``MAD / |median|`` of ``values``, the tool's one spread measure.

    Args:
        values: At least one finite number.

    Returns:
        0.0 for identical values; ``inf`` when the median is 0 but the values
        differ (no relative scale exists then, and it must never look stable).

    Raises:
        MeasurementError: ``values`` is empty.
    """
    if not values:
        raise MeasurementError("relative spread of no values: measure at least one run")
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    if mad == 0:
        return 0.0
    if med == 0:
        return math.inf
    return mad / abs(med)


def _json_float(value: float) -> float | None:
    # JSON has no inf/nan; None says "not defined" without breaking parsers.
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Stat:
    """An immutable set of measured runs of one quantity.

    Attributes:
        values: Measured runs in the order taken; never empty.
        warmups: Warm-up runs, kept for inspection, excluded from every
            statistic.
        unit: Unit of the values, e.g. ``"tok/s"`` or ``"ms"``.
        rel_spread_tol: Tolerance that ``stable`` is judged against (the
            protocol's, copied so the Stat explains itself).
        min_runs: Runs the protocol wanted at least; fewer (a probe's one run,
            a Stat built by hand) makes the Stat unstable.
        stop_reason: Why repetition stopped: ``"stable"``, ``"max_runs"``,
            ``"max_seconds"``, :data:`PROBE_STOP`, or None for a Stat built by hand.
    """

    values: tuple[float, ...]
    warmups: tuple[float, ...] = ()
    unit: str = ""
    rel_spread_tol: float = 0.05
    min_runs: int = 1
    stop_reason: str | None = None

    def __post_init__(self) -> None:
        try:
            values = tuple(float(v) for v in self.values)
            warmups = tuple(float(v) for v in self.warmups)
        except (TypeError, ValueError) as exc:
            raise MeasurementError(
                f"measured values for {self.unit or 'a quantity'} are not all numbers: {exc}"
            ) from exc
        if not values:
            raise MeasurementError(
                f"no measured values for {self.unit or 'a quantity'}: at least one "
                f"run is needed (warm-ups do not count)"
            )
        bad = [v for v in values + warmups if not math.isfinite(v)]
        if bad:
            raise MeasurementError(
                f"non-finite measurement {bad[0]!r} ({self.unit}): the engine or the sample function returned nonsense"
            )
        if not _is_real(self.rel_spread_tol) or self.rel_spread_tol < 0:
            raise ConfigError(f"Stat.rel_spread_tol = {self.rel_spread_tol!r}: must be a finite number >= 0")
        if not _is_int(self.min_runs) or self.min_runs < 1:
            raise ConfigError(f"Stat.min_runs = {self.min_runs!r}: must be an integer >= 1")
        # Lists would make the "immutable run" mutable through the back door.
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "warmups", warmups)

    @property
    def n(self) -> int:
        """Number of measured runs."""
        return len(self.values)

    @cached_property
    def median(self) -> float:
        """Median of the measured runs: the number trials are ranked by."""
        return statistics.median(self.values)

    @cached_property
    def mean(self) -> float:
        """Arithmetic mean of the measured runs."""
        return statistics.fmean(self.values)

    @cached_property
    def stdev(self) -> float:
        """Sample standard deviation; 0.0 for a single run."""
        return statistics.stdev(self.values) if self.n > 1 else 0.0

    @cached_property
    def mad(self) -> float:
        """Median absolute deviation from the median (unscaled)."""
        med = self.median
        return statistics.median(abs(v - med) for v in self.values)

    @cached_property
    def rel_spread(self) -> float:
        """``MAD / |median|``; see :func:`relative_spread`."""
        return relative_spread(self.values)

    @property
    def min(self) -> float:
        """Smallest measured run."""
        return min(self.values)

    @property
    def max(self) -> float:
        """Largest measured run."""
        return max(self.values)

    @property
    def stable(self) -> bool:
        """Whether enough runs were taken and their spread is within tolerance."""
        return self.n >= self.min_runs and self.rel_spread <= self.rel_spread_tol

    @property
    def warning(self) -> str | None:
        """A sentence saying why the median is not to be trusted and what to do, or None."""
        if self.stop_reason == PROBE_STOP:
            return "one run only: the probe found it below the leaders (study.probe_margin)"
        if self.n < self.min_runs:
            return f"only {self.n} of the {self.min_runs} runs wanted were measured"
        if self.rel_spread > self.rel_spread_tol:
            spread = "undefined (median 0)" if math.isinf(self.rel_spread) else f"{self.rel_spread:.0%} of median"
            more = "measure.max_seconds" if self.stop_reason == "max_seconds" else "measure.max_runs"
            return (
                f"spread {spread} over {self.n} runs (tolerance "
                f"{self.rel_spread_tol:.0%}): raise {more}, let the GPU "
                f"cool, or close other GPU work"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict; ``spread`` is the relative spread (None if undefined)."""
        return {
            "median": self.median,
            "spread": _json_float(self.rel_spread),
            "mad": self.mad,
            "mean": self.mean,
            "stdev": self.stdev,
            "min": self.min,
            "max": self.max,
            "n": self.n,
            "values": list(self.values),
            "warmups": list(self.warmups),
            "unit": self.unit,
            "stable": self.stable,
            "rel_spread_tol": self.rel_spread_tol,
            "stop_reason": self.stop_reason,
            "warning": self.warning,
        }


# ---------------------------------------------------------------------------
# Repetition
# ---------------------------------------------------------------------------


def _check_number(value: Any, what: str) -> float:
    if not _is_real(value):
        raise MeasurementError(f"{what} returned {value!r}: expected a finite number")
    return float(value)


def _check_run(result: Any, units: Mapping[str, str], what: str) -> dict[str, float]:
    if not isinstance(result, Mapping):
        raise MeasurementError(
            f"{what} returned {type(result).__name__}: expected a mapping of {sorted(units)} to numbers"
        )
    missing = [k for k in units if k not in result]
    if missing:
        raise MeasurementError(f"{what} lacks {missing}: every run must report {sorted(units)}")
    extra = [k for k in result if k not in units]
    if extra:
        # Dropping them silently would lose data nobody knows was there.
        raise MeasurementError(f"{what} reported {extra}, which have no unit: add them to units")
    return {k: _check_number(result[k], f"{what} key {k!r}") for k in units}


def _repeat(
    sample: Callable[[], dict[str, float]],
    protocol: Protocol,
    key: str,
    clock: Callable[[], float],
    probe: Callable[[Mapping[str, float]], bool] | None = None,
) -> tuple[list[dict[str, float]], list[dict[str, float]], str]:
    """Runs the protocol on checked samples; returns (warm-ups, runs, stop reason)."""
    start_s = clock()
    warmups = [sample() for _ in range(protocol.warmup_runs)]
    runs: list[dict[str, float]] = []
    while True:
        runs.append(sample())
        n = len(runs)
        if n == 1 and probe is not None and not probe(runs[0]):
            return warmups, runs, PROBE_STOP
        if n >= protocol.min_runs and relative_spread([r[key] for r in runs]) <= protocol.rel_spread_tol:
            return warmups, runs, "stable"
        if n >= protocol.max_runs:
            return warmups, runs, "max_runs"
        if protocol.max_seconds is not None and n >= protocol.min_runs and clock() - start_s >= protocol.max_seconds:
            return warmups, runs, "max_seconds"


def repeat_until_stable_many(
    sample: Callable[[], Mapping[str, float]],
    protocol: Protocol,
    units: Mapping[str, str],
    key: str,
    clock: Callable[[], float] = time.monotonic,
    probe: Callable[[Mapping[str, float]], bool] | None = None,
) -> dict[str, Stat]:
    """Measures several quantities that one run yields together.

    Stability is judged on ``key`` only (e.g. ``"aggregate_tok_s"``); every
    other quantity is collected from the same runs, so all the Stats have the
    same ``n`` and the same stop reason, and each still reports its own spread.

    Args:
        sample: Does one run and returns a value for every key of ``units``
            (no more, no fewer). Its exceptions propagate unchanged.
        protocol: How many runs and when to stop.
        units: Unit of each quantity, e.g. ``CONCURRENT_UNITS``.
        key: The quantity that decides stability; must be in ``units``.
        clock: Seconds, monotonic; injectable so tests need not sleep.
        probe: Hears the first run's values and says whether to go on (the study's
            multi-fidelity, ``StudyContext.probe``); False stops after that run, with stop
            reason :data:`PROBE_STOP`.

    Returns:
        A Stat per key of ``units``.

    Raises:
        ConfigError: ``key`` is not in ``units``.
        MeasurementError: A run lacked a key, had an unknown one, or a value
            was not a finite number.
    """
    if key not in units:
        raise ConfigError(f"stability key {key!r} is not among the measured quantities {sorted(units)}")
    counter = itertools.count(1)

    def checked() -> dict[str, float]:
        return _check_run(sample(), units, f"sample call {next(counter)}")

    warmups, runs, reason = _repeat(checked, protocol, key, clock, probe)
    return {
        k: Stat(
            values=tuple(r[k] for r in runs),
            warmups=tuple(w[k] for w in warmups),
            unit=u,
            rel_spread_tol=protocol.rel_spread_tol,
            min_runs=protocol.min_runs,
            stop_reason=reason,
        )
        for k, u in units.items()
    }
