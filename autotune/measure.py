"""The benchmark protocol every backend shares.

A trial's number is only worth comparing with another trial's when both were
measured the same way. This module is that way:

* :class:`Protocol` says how many warm-ups and runs, and when the runs are
  stable enough to stop.
* :func:`repeat_until_stable` / :func:`repeat_until_stable_many` apply it and
  return immutable :class:`Stat` objects that keep warm-ups apart from values
  and carry their median and spread together, with a warning (and a remedy)
  when the spread is too high to trust the median.
* :func:`run_streams_threaded` / :func:`run_streams_async` run N generation
  streams that really overlap and summarise them as a :class:`ConcurrentResult`.
* :class:`GpuSampler` records what the GPU did meanwhile (memory, temperature,
  clocks, power, throttling) as :class:`GpuTelemetry`, or says cleanly that
  there is no GPU.
* :func:`drift` compares two measurements of a reference configuration, to
  catch a GPU that got slower during the study (heat, another job).

Relative spread is defined once for the whole tool as ``MAD / |median|``
(median absolute deviation, unscaled). MAD rather than the standard deviation
because one slow run (a page fault, a log flush) should not force extra runs
nor hide an otherwise tight distribution; rather than ``(p90 - p10) / median``
because with the 3 to 10 runs we can afford, p10 and p90 are just the extreme
values, which is the outlier sensitivity we want to avoid. Read it as "half of
the runs lie within ``rel_spread`` of the median".
"""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol as _TypingProtocol

from autotune.errors import ConfigError, MeasurementError

__all__ = [
    "CONCURRENT_UNITS",
    "ConcurrentResult",
    "GpuSampler",
    "GpuTelemetry",
    "NvmlReader",
    "PynvmlReader",
    "Protocol",
    "SLOWDOWN_REASONS",
    "Stat",
    "StreamResult",
    "THROTTLE_REASON_BITS",
    "drift",
    "measure_with_telemetry",
    "relative_spread",
    "repeat_until_stable",
    "repeat_until_stable_many",
    "run_streams_async",
    "run_streams_threaded",
    "throttle_reason_names",
]


# ---------------------------------------------------------------------------
# Protocol
# ---------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    # bool is an int subclass; `min_runs = true` in a study file is a typo, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclass(frozen=True)
class Protocol:
    """How one configuration is measured.

    Attributes:
        warmup_runs: Runs done first and kept apart (caches, JIT, clocks
            ramping up); they never enter the median.
        min_runs: Measured runs always taken before stability is judged.
        max_runs: Measured runs never exceeded, stable or not.
        rel_spread_tol: Largest accepted relative spread, ``MAD / |median|``
            (see the module docstring); 0.05 means half of the runs lie
            within 5% of the median.
        max_seconds: Time budget for the whole measurement, warm-ups
            included, or None for no budget. When spent, repetition stops and
            what was measured is kept; the budget can be overrun by one run,
            since a run is never cut short, and at least one measured run is
            always taken.
    """

    warmup_runs: int = 1
    min_runs: int = 3
    max_runs: int = 10
    rel_spread_tol: float = 0.05
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.warmup_runs) or self.warmup_runs < 0:
            raise ConfigError(
                f"measure.warmup_runs = {self.warmup_runs!r}: must be an integer >= 0")
        if not _is_int(self.min_runs) or self.min_runs < 1:
            raise ConfigError(
                f"measure.min_runs = {self.min_runs!r}: must be an integer >= 1")
        if not _is_int(self.max_runs) or self.max_runs < self.min_runs:
            raise ConfigError(
                f"measure.max_runs = {self.max_runs!r}: must be an integer >= "
                f"measure.min_runs ({self.min_runs})")
        if not _is_real(self.rel_spread_tol) or self.rel_spread_tol < 0:
            raise ConfigError(
                f"measure.rel_spread_tol = {self.rel_spread_tol!r}: must be a finite "
                f"number >= 0 (a fraction of the median, e.g. 0.05 for 5%)")
        if self.max_seconds is not None and (
                not _is_real(self.max_seconds) or self.max_seconds <= 0):
            raise ConfigError(
                f"measure.max_seconds = {self.max_seconds!r}: must be a finite number "
                f"of seconds > 0, or null for no time budget")


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
        min_runs: Runs the protocol wanted at least; fewer (a spent time
            budget) makes the Stat unstable.
        stop_reason: Why repetition stopped: ``"stable"``, ``"max_runs"``,
            ``"max_seconds"``, or None for a Stat built by hand.
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
            raise MeasurementError(f"measured values for {self.unit or 'a quantity'} are not "
                                   f"all numbers: {exc}") from exc
        if not values:
            raise MeasurementError(
                f"no measured values for {self.unit or 'a quantity'}: at least one "
                f"run is needed (warm-ups do not count)")
        bad = [v for v in values + warmups if not math.isfinite(v)]
        if bad:
            raise MeasurementError(
                f"non-finite measurement {bad[0]!r} ({self.unit}): the engine or the "
                f"sample function returned nonsense")
        if not _is_real(self.rel_spread_tol) or self.rel_spread_tol < 0:
            raise ConfigError(
                f"Stat.rel_spread_tol = {self.rel_spread_tol!r}: must be a finite number >= 0")
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
        if self.n < self.min_runs:
            return (f"only {self.n} of the {self.min_runs} runs wanted fit in the time "
                    f"budget: raise measure.max_seconds or lower measure.min_runs")
        if self.rel_spread > self.rel_spread_tol:
            spread = "undefined (median 0)" if math.isinf(self.rel_spread) \
                else f"{self.rel_spread:.0%} of median"
            more = "measure.max_seconds" if self.stop_reason == "max_seconds" \
                else "measure.max_runs"
            return (f"spread {spread} over {self.n} runs (tolerance "
                    f"{self.rel_spread_tol:.0%}): raise {more}, let the GPU "
                    f"cool, or close other GPU work")
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
        raise MeasurementError(
            f"{what} returned {value!r}: expected a finite number")
    return float(value)


def _check_run(result: Any, units: Mapping[str, str], what: str) -> dict[str, float]:
    if not isinstance(result, Mapping):
        raise MeasurementError(f"{what} returned {type(result).__name__}: expected a mapping "
                               f"of {sorted(units)} to numbers")
    missing = [k for k in units if k not in result]
    if missing:
        raise MeasurementError(f"{what} lacks {missing}: every run must report {sorted(units)}")
    extra = [k for k in result if k not in units]
    if extra:
        # Dropping them silently would lose data nobody knows was there.
        raise MeasurementError(f"{what} reported {extra}, which have no unit: add them to units")
    return {k: _check_number(result[k], f"{what} key {k!r}") for k in units}


def _repeat(sample: Callable[[], dict[str, float]], protocol: Protocol, key: str,
            clock: Callable[[], float]
            ) -> tuple[list[dict[str, float]], list[dict[str, float]], str]:
    """Runs the protocol on checked samples; returns (warm-ups, runs, stop reason)."""
    start_s = clock()
    warmups = [sample() for _ in range(protocol.warmup_runs)]
    runs: list[dict[str, float]] = []
    while True:
        runs.append(sample())
        n = len(runs)
        if n >= protocol.min_runs and \
                relative_spread([r[key] for r in runs]) <= protocol.rel_spread_tol:
            return warmups, runs, "stable"
        if n >= protocol.max_runs:
            return warmups, runs, "max_runs"
        if protocol.max_seconds is not None and clock() - start_s >= protocol.max_seconds:
            return warmups, runs, "max_seconds"


def repeat_until_stable(sample: Callable[[], float], protocol: Protocol, unit: str,
                        clock: Callable[[], float] = time.monotonic) -> Stat:
    """Measures one quantity by the protocol.

    Runs ``protocol.warmup_runs`` warm-ups, then samples until at least
    ``min_runs`` runs have a relative spread within ``rel_spread_tol``, or
    ``max_runs`` runs were taken, or ``max_seconds`` is spent.

    Args:
        sample: Does one run and returns its value. Its exceptions propagate
            unchanged, so the caller fails the trial with the real cause.
        protocol: How many runs and when to stop.
        unit: Unit of the sampled values.
        clock: Seconds, monotonic; injectable so tests need not sleep.

    Returns:
        The runs, with the stop reason; check ``stable``/``warning``.

    Raises:
        MeasurementError: ``sample`` returned something not a finite number.
    """
    counter = itertools.count(1)

    def checked() -> dict[str, float]:
        return {"value": _check_number(sample(), f"sample call {next(counter)}")}

    warmups, runs, reason = _repeat(checked, protocol, "value", clock)
    return Stat(values=tuple(r["value"] for r in runs),
                warmups=tuple(w["value"] for w in warmups), unit=unit,
                rel_spread_tol=protocol.rel_spread_tol, min_runs=protocol.min_runs,
                stop_reason=reason)


def repeat_until_stable_many(sample: Callable[[], Mapping[str, float]], protocol: Protocol,
                             units: Mapping[str, str], key: str,
                             clock: Callable[[], float] = time.monotonic) -> dict[str, Stat]:
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

    Returns:
        A Stat per key of ``units``.

    Raises:
        ConfigError: ``key`` is not in ``units``.
        MeasurementError: A run lacked a key, had an unknown one, or a value
            was not a finite number.
    """
    if key not in units:
        raise ConfigError(f"stability key {key!r} is not among the measured quantities "
                          f"{sorted(units)}")
    counter = itertools.count(1)

    def checked() -> dict[str, float]:
        return _check_run(sample(), units, f"sample call {next(counter)}")

    warmups, runs, reason = _repeat(checked, protocol, key, clock)
    return {k: Stat(values=tuple(r[k] for r in runs), warmups=tuple(w[k] for w in warmups),
                    unit=u, rel_spread_tol=protocol.rel_spread_tol,
                    min_runs=protocol.min_runs, stop_reason=reason)
            for k, u in units.items()}


def drift(reference_before: Stat, reference_now: Stat, tol: float = 0.05) -> float | None:
    """Says whether a reference configuration got faster or slower since it was measured.

    Re-measuring one fixed configuration now and then separates "this trial is
    slower" from "the GPU got slower" (thermal throttling, another job). Pick
    ``tol`` above the references' own ``rel_spread`` or noise will look like
    drift.

    Args:
        reference_before: The earlier measurement.
        reference_now: The new one, same configuration and unit.
        tol: Relative change of the median tolerated, >= 0.

    Returns:
        ``(now.median - before.median) / |before.median|`` when its magnitude
        exceeds ``tol`` (negative: lower now), else None.

    Raises:
        ConfigError: ``tol`` is negative or not finite.
        MeasurementError: The units differ, or the earlier median is 0 (no
            relative change exists).
    """
    if not _is_real(tol) or tol < 0:
        raise ConfigError(f"drift tol = {tol!r}: must be a finite number >= 0")
    if reference_before.unit != reference_now.unit:
        raise MeasurementError(f"drift between {reference_before.unit!r} and "
                               f"{reference_now.unit!r}: measure the same quantity twice")
    if reference_before.median == 0:
        raise MeasurementError("drift from a reference median of 0: the reference "
                               "measurement is unusable, measure it again")
    change = (reference_now.median - reference_before.median) / abs(reference_before.median)
    return change if abs(change) > tol else None


# ---------------------------------------------------------------------------
# Concurrent streams
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamResult:
    """One generation request as a client saw it.

    Attributes:
        prompt_tokens: Tokens in the prompt.
        output_tokens: Tokens generated.
        ttft_ms: Time from sending the request to the first output token.
        decode_tok_s: Output tokens after the first over the time after the
            first token (the first token belongs to prefill).
        prefill_tok_s: Prompt tokens over the time to first token (includes
            queueing and transport, which is what a user waits for).
        start_s: When the request was sent, ``time.monotonic()`` seconds.
        end_s: When the last token arrived, same clock.
    """

    prompt_tokens: int
    output_tokens: int
    ttft_ms: float
    decode_tok_s: float
    prefill_tok_s: float
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise MeasurementError(f"stream {name} = {value!r}: must be an integer >= 0")
        for name in ("ttft_ms", "decode_tok_s", "prefill_tok_s", "start_s", "end_s"):
            value = getattr(self, name)
            if not _is_real(value) or (name != "start_s" and name != "end_s" and value < 0):
                raise MeasurementError(f"stream {name} = {value!r}: must be a finite number >= 0")
        if self.end_s < self.start_s:
            raise MeasurementError(f"stream ended ({self.end_s}) before it started "
                                   f"({self.start_s}): use one monotonic clock for both")

    @classmethod
    def from_timestamps(cls, prompt_tokens: int, output_tokens: int, start_s: float,
                        first_token_s: float, end_s: float) -> StreamResult:
        """Builds a result from the three moments a streaming client observes.

        Rates that cannot be measured (one output token, zero duration) are 0.0.

        Args:
            prompt_tokens: Tokens in the prompt.
            output_tokens: Tokens generated.
            start_s: Request sent, ``time.monotonic()``.
            first_token_s: First output token received, same clock.
            end_s: Last output token received, same clock.
        """
        if not (start_s <= first_token_s <= end_s):
            raise MeasurementError(
                f"stream timestamps out of order: start {start_s}, first token "
                f"{first_token_s}, end {end_s}")
        prefill_s = first_token_s - start_s
        decode_s = end_s - first_token_s
        return cls(
            prompt_tokens=prompt_tokens, output_tokens=output_tokens,
            ttft_ms=prefill_s * 1000.0,
            decode_tok_s=(output_tokens - 1) / decode_s
            if output_tokens > 1 and decode_s > 0 else 0.0,
            prefill_tok_s=prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
            start_s=start_s, end_s=end_s)


#: Units of :meth:`ConcurrentResult.metrics`, for :func:`repeat_until_stable_many`.
CONCURRENT_UNITS: Mapping[str, str] = {
    "aggregate_tok_s": "tok/s",
    "per_user_tok_s": "tok/s",
    "ttft_ms": "ms",
}


@dataclass(frozen=True)
class ConcurrentResult:
    """N streams that ran together.

    Attributes:
        streams: One result per stream, in stream index order; never empty.
        wall_s: The driver's own elapsed time, from releasing the streams to
            the last one finishing (includes thread/task overhead; kept as a
            sanity check, the rates use the streams' own timestamps).
    """

    streams: tuple[StreamResult, ...]
    wall_s: float

    def __post_init__(self) -> None:
        streams = tuple(self.streams)
        if not streams:
            raise MeasurementError("no streams in a concurrent result: run at least one")
        if not _is_real(self.wall_s) or self.wall_s < 0:
            raise MeasurementError(f"wall_s = {self.wall_s!r}: must be a finite number >= 0")
        object.__setattr__(self, "streams", streams)
        if self.span_s <= 0 and self.total_output_tokens > 0:
            raise MeasurementError("streams produced tokens in no time: their start_s/end_s "
                                   "must come from time.monotonic()")

    @property
    def n_streams(self) -> int:
        """Number of streams."""
        return len(self.streams)

    @property
    def span_s(self) -> float:
        """Seconds from the first stream's start to the last stream's end."""
        return max(s.end_s for s in self.streams) - min(s.start_s for s in self.streams)

    @property
    def total_output_tokens(self) -> int:
        """Output tokens of all streams together."""
        return sum(s.output_tokens for s in self.streams)

    @property
    def aggregate_tok_s(self) -> float:
        """Total output tokens over :attr:`span_s`: the server's throughput."""
        span_s = self.span_s
        return self.total_output_tokens / span_s if span_s > 0 else 0.0

    @property
    def per_user_tok_s(self) -> float:
        """Median decode speed of the streams: what one user sees."""
        return statistics.median(s.decode_tok_s for s in self.streams)

    @property
    def ttft_ms(self) -> float:
        """Median time to first token."""
        return statistics.median(s.ttft_ms for s in self.streams)

    def metrics(self) -> dict[str, float]:
        """Returns the keys of :data:`CONCURRENT_UNITS`, to feed ``repeat_until_stable_many``."""
        return {"aggregate_tok_s": self.aggregate_tok_s,
                "per_user_tok_s": self.per_user_tok_s,
                "ttft_ms": self.ttft_ms}

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict of the summary and the streams."""
        return {
            **self.metrics(),
            "n_streams": self.n_streams,
            "total_output_tokens": self.total_output_tokens,
            "span_s": self.span_s,
            "wall_s": self.wall_s,
            "streams": [vars(s).copy() for s in self.streams],
        }


def _check_driver_args(n_streams: int, timeout_s: float) -> None:
    if not _is_int(n_streams) or n_streams < 1:
        raise ConfigError(f"n_streams = {n_streams!r}: must be an integer >= 1")
    if not _is_real(timeout_s) or timeout_s <= 0:
        raise ConfigError(f"timeout_s = {timeout_s!r}: must be a finite number of seconds > 0")


def _check_stream(result: Any, index: int) -> StreamResult:
    if not isinstance(result, StreamResult):
        raise MeasurementError(f"stream {index} returned {type(result).__name__}: "
                               f"expected a StreamResult")
    return result


def _raise_first(failures: Sequence[tuple[int, BaseException]], n_streams: int) -> None:
    if not failures:
        return
    index, exc = failures[0]
    others = [i for i, _ in failures[1:]]
    exc.add_note(f"autotune: stream {index} of {n_streams} failed"
                 + (f"; streams {others} failed too" if others else ""))
    raise exc


def run_streams_threaded(stream_fn: Callable[[int], StreamResult], n_streams: int,
                         timeout_s: float) -> ConcurrentResult:
    """Runs ``n_streams`` blocking streams at once, one thread each.

    The threads wait behind a barrier and are released together, so the
    streams really overlap instead of trickling in as threads start.

    Args:
        stream_fn: Does one blocking request for stream index ``i`` and
            returns its result, stamped with ``time.monotonic()``.
        n_streams: Streams to run together, >= 1.
        timeout_s: Limit for all of them, from release to the last end.

    Returns:
        The streams' results in index order.

    Raises:
        ConfigError: ``n_streams`` or ``timeout_s`` is invalid.
        MeasurementError: Streams were still running at the timeout. Their
            threads are daemons and cannot be killed: the caller should stop
            the engine, which ends their blocking I/O.
        BaseException: The exception of the first failed stream (lowest
            index), re-raised once every stream has ended, with a note naming
            the others that failed.
    """
    _check_driver_args(n_streams, timeout_s)
    # One more party than streams: the driver passes the barrier with them, so
    # the wall clock starts at release, not while threads are being created.
    barrier = threading.Barrier(n_streams + 1)
    results: list[StreamResult | None] = [None] * n_streams
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        try:
            barrier.wait(timeout=timeout_s)
        except threading.BrokenBarrierError:
            return  # The driver reports the failed start; nothing ran here.
        try:
            results[index] = _check_stream(stream_fn(index), index)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the driver.
            with lock:
                failures.append((index, exc))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True,
                                name=f"autotune-stream-{i}") for i in range(n_streams)]
    try:
        for thread in threads:
            thread.start()
        barrier.wait(timeout=timeout_s)
    except (threading.BrokenBarrierError, RuntimeError) as exc:
        barrier.abort()
        raise MeasurementError(f"could not start {n_streams} streams together within "
                               f"{timeout_s}s: {exc!r}") from exc
    start_s = time.monotonic()
    deadline_s = start_s + timeout_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline_s - time.monotonic()))
    wall_s = time.monotonic() - start_s
    running = [i for i, t in enumerate(threads) if t.is_alive()]
    if running:
        error = MeasurementError(f"{len(running)} of {n_streams} streams still running after "
                                 f"{timeout_s}s (streams {running}): raise the timeout, "
                                 f"lower the load, or check that the engine is alive")
        if failures:
            error.add_note(f"streams {sorted(i for i, _ in failures)} failed before that")
        raise error
    _raise_first(sorted(failures, key=lambda f: f[0]), n_streams)
    return ConcurrentResult(streams=tuple(r for r in results if r is not None), wall_s=wall_s)


async def run_streams_async(stream_coro: Callable[[int], Awaitable[StreamResult]],
                            n_streams: int, timeout_s: float) -> ConcurrentResult:
    """Runs ``n_streams`` asynchronous streams at once (HTTP clients).

    All coroutines are gathered in one go, so they are all started before any
    of them passes its first await: they overlap without a barrier.

    Args:
        stream_coro: Makes the coroutine of stream index ``i``; it returns a
            result stamped with ``time.monotonic()``.
        n_streams: Streams to run together, >= 1.
        timeout_s: Limit for all of them; at the limit they are cancelled.

    Returns:
        The streams' results in index order.

    Raises:
        ConfigError: ``n_streams`` or ``timeout_s`` is invalid.
        MeasurementError: The timeout passed (the streams were cancelled).
        BaseException: The exception of the first failed stream (lowest
            index), re-raised once every stream has ended.
    """
    _check_driver_args(n_streams, timeout_s)

    async def one(index: int) -> StreamResult:
        return _check_stream(await stream_coro(index), index)

    start_s = time.monotonic()
    try:
        # return_exceptions: one failure must not cancel the others before
        # they end, so the engine is not left with half-abandoned requests.
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(one(i) for i in range(n_streams)), return_exceptions=True),
            timeout=timeout_s)
    except asyncio.TimeoutError as exc:
        raise MeasurementError(f"{n_streams} streams not done after {timeout_s}s (cancelled): "
                               f"raise the timeout, lower the load, or check that the engine "
                               f"is alive") from exc
    wall_s = time.monotonic() - start_s
    failures = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
    _raise_first(failures, n_streams)
    return ConcurrentResult(streams=tuple(outcomes), wall_s=wall_s)


# ---------------------------------------------------------------------------
# GPU telemetry
# ---------------------------------------------------------------------------

#: NVML clock event (formerly "throttle") reason bits, by name. The bit values
#: are the same in the old ...ThrottleReasons and new ...ClocksEventReasons APIs.
THROTTLE_REASON_BITS: Mapping[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
    "board_limit": 0x200,
    "reliability": 0x400,
}

#: Reasons that mean the GPU ran slower than it could because of power or
#: heat; "gpu_idle" and the settings reasons are normal and not listed.
SLOWDOWN_REASONS: frozenset[str] = frozenset({
    "sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
})


def throttle_reason_names(mask: int) -> tuple[str, ...]:
    """Returns the names of the bits set in an NVML clock event reason mask.

    Unknown bits (a newer driver) become ``"unknown_0x..."`` rather than vanish.
    """
    names = [name for name, bit in THROTTLE_REASON_BITS.items() if mask & bit]
    known = 0
    for bit in THROTTLE_REASON_BITS.values():
        known |= bit
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"unknown_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return tuple(names)


class NvmlReader(_TypingProtocol):
    """What :class:`GpuSampler` needs from NVML for one GPU; fakes implement it in tests.

    Any method may raise when the GPU does not support that reading; the
    sampler then leaves that field out and keeps the others.
    """

    def name(self) -> str:
        """Returns the GPU's marketing name."""

    def memory_used_bytes(self) -> int:
        """Returns device memory in use by everyone."""

    def temperature_c(self) -> float:
        """Returns the GPU core temperature."""

    def sm_clock_mhz(self) -> float:
        """Returns the current SM clock."""

    def power_w(self) -> float:
        """Returns the current board power draw."""

    def throttle_mask(self) -> int:
        """Returns the current clock event reason bits."""

    def process_used_bytes(self, pid: int) -> int | None:
        """Returns memory used by compute process ``pid``, None if not listed/unknown."""

    def close(self) -> None:
        """Releases NVML."""


class PynvmlReader:
    """:class:`NvmlReader` over the real NVML via ``pynvml`` (nvidia-ml-py)."""

    def __init__(self, index: int):
        """Initialises NVML and opens GPU ``index``.

        Raises:
            ImportError: nvidia-ml-py is not installed.
            RuntimeError: NVML or the GPU is not there; the message says which.
        """
        try:
            import pynvml  # Imported here so the module loads on machines without it.
        except ImportError as exc:
            raise ImportError(f"pynvml is missing ({exc}): pip install nvidia-ml-py") from exc

        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise RuntimeError(f"NVML could not start ({exc}): no NVIDIA driver here") from exc
        try:
            count = pynvml.nvmlDeviceGetCount()
            if not 0 <= index < count:
                raise RuntimeError(f"GPU index {index} not found: {count} GPU(s) visible "
                                   f"(indices 0..{count - 1})")
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        # Newer drivers renamed "throttle reasons" to "clocks event reasons";
        # old bindings only have the old name.
        self._reasons_fn = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        self._temperature_v = hasattr(pynvml, "nvmlDeviceGetTemperatureV")

    def name(self) -> str:
        name = self._nvml.nvmlDeviceGetName(self._handle)
        return name.decode() if isinstance(name, bytes) else str(name)

    def memory_used_bytes(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def temperature_c(self) -> float:
        nvml = self._nvml
        if self._temperature_v:
            try:
                return float(nvml.nvmlDeviceGetTemperatureV(self._handle,
                                                            nvml.NVML_TEMPERATURE_GPU))
            except nvml.NVMLError:
                # The versioned call is missing from older drivers; the old one
                # is deprecated but present everywhere so far.
                self._temperature_v = False
        return float(nvml.nvmlDeviceGetTemperature(self._handle, nvml.NVML_TEMPERATURE_GPU))

    def sm_clock_mhz(self) -> float:
        return float(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))

    def power_w(self) -> float:
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0  # mW -> W

    def throttle_mask(self) -> int:
        return int(self._reasons_fn(self._handle))

    def process_used_bytes(self, pid: int) -> int | None:
        used = [p.usedGpuMemory for p in
                self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
                if p.pid == pid]
        # usedGpuMemory is None where the driver hides it (WDDM, some containers).
        known = [u for u in used if u is not None]
        return int(sum(known)) if known else None

    def close(self) -> None:
        self._nvml.nvmlShutdown()


@dataclass(frozen=True)
class GpuTelemetry:
    """What the GPU did while a measurement ran.

    Fields other than ``available``/``reason``/``throttle_reasons``/
    ``n_samples`` are None when unavailable or never read successfully.

    Attributes:
        available: False when there was no NVML or no such GPU.
        reason: Why not available (or a per-metric failure note), else None.
        gpu_name: NVML's name of the GPU.
        peak_used_bytes: Highest device memory in use (all processes).
        baseline_used_bytes: Device memory in use when sampling started.
        peak_process_bytes: Highest memory of the watched pid.
        max_temp_c: Highest core temperature.
        min_sm_clock_mhz: Lowest SM clock.
        median_sm_clock_mhz: Median SM clock.
        max_power_w: Highest board power.
        throttle_reasons: Union of the clock event reasons seen, in bit order.
        n_samples: Samples taken.
    """

    available: bool
    reason: str | None = None
    gpu_name: str | None = None
    peak_used_bytes: int | None = None
    baseline_used_bytes: int | None = None
    peak_process_bytes: int | None = None
    max_temp_c: float | None = None
    min_sm_clock_mhz: float | None = None
    median_sm_clock_mhz: float | None = None
    max_power_w: float | None = None
    throttle_reasons: tuple[str, ...] = ()
    n_samples: int = 0

    @property
    def peak_delta_bytes(self) -> int | None:
        """Peak minus baseline: the memory the measured work added, when no pid is watched."""
        if self.peak_used_bytes is None or self.baseline_used_bytes is None:
            return None
        return self.peak_used_bytes - self.baseline_used_bytes

    @property
    def slowdowns(self) -> tuple[str, ...]:
        """The throttle reasons that mean power or heat slowed the GPU down."""
        return tuple(r for r in self.throttle_reasons if r in SLOWDOWN_REASONS)

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict."""
        d = vars(self).copy()
        d["throttle_reasons"] = list(self.throttle_reasons)
        d["peak_delta_bytes"] = self.peak_delta_bytes
        d["slowdowns"] = list(self.slowdowns)
        return d


class GpuSampler:
    """Samples one GPU in a daemon thread while a measurement runs.

    Use as a context manager; read :meth:`result` after (or during) the
    block. One sample is taken on entry (the baseline) and one on exit, so
    even a block shorter than ``interval_s`` has readings. Without NVML or
    without the GPU the sampler does nothing and :meth:`result` says why.

    Example::

        with GpuSampler(index=0, pid=server.pid) as gpu:
            stat = repeat_until_stable(run_once, protocol, "tok/s")
        telemetry = gpu.result()
    """

    def __init__(self, index: int = 0, interval_s: float = 0.1, pid: int | None = None,
                 reader_factory: Callable[[int], NvmlReader] | None = None):
        """Prepares a sampler; nothing is opened before entering the context.

        Args:
            index: NVML index of the GPU (NVML order, which is PCI bus order and
                can differ from CUDA_VISIBLE_DEVICES order).
            interval_s: Seconds between samples, > 0.
            pid: Process whose own GPU memory to record too, or None.
            reader_factory: Opens a reader for ``index``; defaults to
                :class:`PynvmlReader`. Whatever it raises means "no GPU".
        """
        if not _is_real(interval_s) or interval_s <= 0:
            raise ConfigError(f"GpuSampler interval_s = {interval_s!r}: must be a finite "
                              f"number of seconds > 0")
        self.index = index
        self.interval_s = float(interval_s)
        self.pid = pid
        self._factory = reader_factory or PynvmlReader
        self._reader: NvmlReader | None = None
        self._unavailable: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpu_name: str | None = None
        self._baseline_used_bytes: int | None = None
        self._used_bytes: list[int] = []
        self._process_bytes: list[int] = []
        self._temps_c: list[float] = []
        self._clocks_mhz: list[float] = []
        self._powers_w: list[float] = []
        self._mask = 0
        self._n_samples = 0
        self._failed: set[str] = set()

    def __enter__(self) -> GpuSampler:
        try:
            self._reader = self._factory(self.index)
        except Exception as exc:  # noqa: BLE001 - any failure here just means "no GPU".
            self._unavailable = f"no GPU telemetry for GPU {self.index}: {exc}"
            return self
        try:
            self._gpu_name = self._reader.name()
        except Exception:  # noqa: BLE001 - the name is decoration, not a reason to stop.
            self._failed.add("name")
        self.sample_now()
        self._baseline_used_bytes = self._used_bytes[0] if self._used_bytes else None
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"autotune-gpu-sampler-{self.index}")
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._reader is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
        self.sample_now()
        try:
            self._reader.close()
        except Exception:  # noqa: BLE001 - closing must not mask the block's outcome.
            pass
        self._reader = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_now()

    def _read(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:  # noqa: BLE001 - one unsupported reading must not stop the rest.
            self._failed.add(what)
            return None

    def sample_now(self) -> None:
        """Takes one sample immediately (e.g. right after a model has loaded)."""
        reader = self._reader
        if reader is None:
            return
        with self._lock:
            used = self._read("memory", reader.memory_used_bytes)
            temp = self._read("temperature", reader.temperature_c)
            clock = self._read("sm_clock", reader.sm_clock_mhz)
            power = self._read("power", reader.power_w)
            mask = self._read("throttle_reasons", reader.throttle_mask)
            proc = None
            if self.pid is not None:
                proc = self._read("process_memory", lambda: reader.process_used_bytes(self.pid))
            if used is not None:
                self._used_bytes.append(int(used))
            if temp is not None:
                self._temps_c.append(float(temp))
            if clock is not None:
                self._clocks_mhz.append(float(clock))
            if power is not None:
                self._powers_w.append(float(power))
            if mask is not None:
                self._mask |= int(mask)
            if proc is not None:
                self._process_bytes.append(int(proc))
            self._n_samples += 1

    def result(self) -> GpuTelemetry:
        """Returns the telemetry so far; available=False with a reason when there is no GPU."""
        if self._unavailable is not None:
            return GpuTelemetry(available=False, reason=self._unavailable)
        if self._n_samples == 0:
            return GpuTelemetry(available=False,
                                reason="GpuSampler was never entered: use it as a context manager")
        with self._lock:
            return GpuTelemetry(
                available=True,
                reason=(f"readings not supported on this GPU: {', '.join(sorted(self._failed))}"
                        if self._failed else None),
                gpu_name=self._gpu_name,
                peak_used_bytes=max(self._used_bytes, default=None),
                baseline_used_bytes=self._baseline_used_bytes,
                peak_process_bytes=max(self._process_bytes, default=None),
                max_temp_c=max(self._temps_c, default=None),
                min_sm_clock_mhz=min(self._clocks_mhz, default=None),
                median_sm_clock_mhz=statistics.median(self._clocks_mhz)
                if self._clocks_mhz else None,
                max_power_w=max(self._powers_w, default=None),
                throttle_reasons=throttle_reason_names(self._mask),
                n_samples=self._n_samples,
            )


def measure_with_telemetry(sample: Callable[[], Mapping[str, float]], protocol: Protocol,
                           units: Mapping[str, str], key: str, *, gpu: bool, gpu_index: int = 0,
                           pid: int | None = None
                           ) -> tuple[dict[str, Stat], GpuTelemetry | None, int | None]:
    """Every backend's measuring block: repeat ``sample`` by the protocol while NVML watches.

    Args:
        sample, protocol, units, key: As for :func:`repeat_until_stable_many`.
        gpu: Whether the engine runs on a GPU; without one no telemetry is taken.
        gpu_index: The NVML index of the engine's card.
        pid: The engine's process, for its own peak memory.

    Returns:
        The stats; the telemetry (None without a GPU); the peak device memory of the
        configuration: the process's own peak where NVML reports per-process memory, else
        the rise of the card's used memory, None when neither was readable.
    """
    if not gpu:
        return repeat_until_stable_many(sample, protocol, units, key=key), None, None
    with GpuSampler(index=gpu_index, pid=pid) as sampler:
        stats = repeat_until_stable_many(sample, protocol, units, key=key)
    telemetry = sampler.result()
    peak = None
    if telemetry.available:
        peak = telemetry.peak_process_bytes if telemetry.peak_process_bytes is not None \
            else telemetry.peak_delta_bytes
    return stats, telemetry, peak
