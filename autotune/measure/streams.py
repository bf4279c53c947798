"""Concurrent generation streams: N requests that really overlap, and what they add up to.

* :class:`StreamResult` is one request as a client saw it (three timestamps).
* :func:`event_data` reads the ``data:`` payloads of a server-sent event stream, and
  :func:`post_events` sends a streamed POST and yields them, ended by its total deadline
  (:mod:`autotune.measure.deadline`): every backend's streaming client.
* :func:`run_streams_threaded` runs N blocking streams released together behind a barrier
  and summarises them as a :class:`ConcurrentResult`, whose :meth:`~ConcurrentResult.metrics`
  feed :func:`autotune.measure.repeat_until_stable_many` with :data:`CONCURRENT_UNITS`.
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from autotune.errors import ConfigError, MeasurementError
from autotune.measure.deadline import Deadline, DeadlineExceeded, request_deadline
from autotune.measure.protocol import _is_int, _is_real
from autotune.engine.workload import SLO_KEYS

__all__ = [
    "CONCURRENT_UNITS",
    "LATENCY_UNITS",
    "SERVING_RATES",
    "SERVING_UNITS",
    "ConcurrentResult",
    "StreamResult",
    "event_data",
    "fetch",
    "post_events",
    "run_streams_threaded",
]


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
            raise MeasurementError(
                f"stream ended ({self.end_s}) before it started ({self.start_s}): use one monotonic clock for both"
            )

    @classmethod
    def from_timestamps(
        cls, prompt_tokens: int, output_tokens: int, start_s: float, first_token_s: float, end_s: float
    ) -> StreamResult:
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
                f"stream timestamps out of order: start {start_s}, first token {first_token_s}, end {end_s}"
            )
        prefill_s = first_token_s - start_s
        decode_s = end_s - first_token_s
        return cls(
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            ttft_ms=prefill_s * 1000.0,
            decode_tok_s=(output_tokens - 1) / decode_s if output_tokens > 1 and decode_s > 0 else 0.0,
            prefill_tok_s=prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
            start_s=start_s,
            end_s=end_s,
        )


#: Units of :meth:`ConcurrentResult.metrics`, for :func:`repeat_until_stable_many`.
CONCURRENT_UNITS: Mapping[str, str] = {
    "aggregate_tok_s": "tok/s",
    "per_user_tok_s": "tok/s",
    "ttft_ms": "ms",
}

#: What every serving run reports besides its rates: the p50, p95 and p99 of each latency over
#: the run's requests, and goodput (:func:`autotune.measure.load.latency_metrics`).
LATENCY_UNITS: Mapping[str, str] = {
    **{key: "ms" for key in SLO_KEYS},
    "goodput_req_s": "req/s",
    "goodput_tok_s": "tok/s",
    "rate_req_s": "req/s",
}

# What a serving backend measures per run: one request alone (its decode and prefill rates), then
# the concurrent streams. The stability key a backend's settings accept is one of these five
# (the latencies are recorded beside them, for every backend, and never judge stability).
SERVING_RATES: Mapping[str, str] = {
    "decode_tok_s": "tok/s",
    "prefill_tok_s": "tok/s",
    "ttft_ms": "ms",
    "aggregate_tok_s": "tok/s",
    "per_user_tok_s": "tok/s",
}
SERVING_UNITS: Mapping[str, str] = {**SERVING_RATES, **LATENCY_UNITS}


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
            raise MeasurementError(
                "streams produced tokens in no time: their start_s/end_s must come from time.monotonic()"
            )

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
        """Median decode speed of the streams, each counting the time it waited behind the others:
        what one user sees.

        A stream's wait is how much later its first token came than the first stream's: an
        engine that serves one request at a time (ExLlamaV2 without paged attention) decodes each
        at the single-stream rate, but the user queued fourth reads nothing until three others
        are done; its decode time plus that wait is what it spends reading at its rate. Streams
        served together start together and wait nothing, so this is their decode speed."""
        first_ms = min(s.ttft_ms for s in self.streams)

        def seen(s: StreamResult) -> float:
            if s.decode_tok_s <= 0 or s.output_tokens <= 1:
                return s.decode_tok_s
            decode_s = (s.output_tokens - 1) / s.decode_tok_s
            return (s.output_tokens - 1) / (decode_s + (s.ttft_ms - first_ms) / 1000.0)

        return statistics.median(seen(s) for s in self.streams)

    @property
    def ttft_ms(self) -> float:
        """Median time to first token."""
        return statistics.median(s.ttft_ms for s in self.streams)

    def metrics(self) -> dict[str, float]:
        """Returns the keys of :data:`CONCURRENT_UNITS`, to feed ``repeat_until_stable_many``."""
        return {"aggregate_tok_s": self.aggregate_tok_s, "per_user_tok_s": self.per_user_tok_s, "ttft_ms": self.ttft_ms}

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


def event_data(chunks: Iterable[bytes]) -> Iterator[str]:
    """The payload of every ``data:`` line of a server-sent event stream, as bytes arrive.

    Lines end at CR, LF or CRLF only, as the SSE format says. Not ``str.splitlines()``, which
    HTTP clients' line readers use (httpx's ``iter_lines``): it also breaks at U+2028, U+0085,
    U+001C..U+001E, which JSON leaves unescaped inside strings, so a generated token holding one
    cut an event in two (seen on an H200: "Unterminated string" failed a trial).
    """
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].decode("utf-8").lstrip(" ")
    if pending.startswith(b"data:"):
        yield pending[5:].decode("utf-8").lstrip(" ")


def _until(chunks: Iterable[bytes], deadline: Deadline) -> Iterator[bytes]:
    for chunk in chunks:
        deadline.check()  # bytes that finish nothing (an SSE comment, a keep-alive) must not extend it
        yield chunk


def post_events(
    http: httpx.Client,
    url: str,
    payload: Any,
    timeout_s: float,
    *,
    failure: Callable[[str], Exception] = MeasurementError,
    setting: str = "request_timeout_s",
) -> Iterator[str]:
    """POST ``payload`` as JSON to ``url`` and yield the ``data:`` payloads of the event stream
    it answers with (:func:`event_data`), until the stream ends or the consumer stops reading.

    ``timeout_s`` bounds the whole request, from sending it to its last byte, not each read
    (an HTTP client's timeout): no read may outlast what is left of it, and every chunk that
    arrives is checked against it. An outer deadline in force (:func:`autotune.measure.deadline.within`)
    ends it sooner. Use it in a ``with contextlib.closing(...)`` so that a consumer that stops
    early closes the response at once.

    Args:
        http: The client.
        url: Where to POST.
        payload: The request body (JSON).
        timeout_s: Bound on the whole request, seconds.
        failure: Builds the error for an HTTP status other than 200 (a backend's, with its log).
        setting: The setting ``timeout_s`` comes from, for the message.

    Raises:
        DeadlineExceeded: The request was still open at its deadline.
        MeasurementError: From ``failure``: the status was not 200.
    """
    with _bounded(http, "POST", url, timeout_s, setting, json=payload) as (r, chunks):
        if r.status_code != 200:
            r.read()
            raise failure(f"HTTP {r.status_code} from {url}: {r.text[:300]}")
        yield from event_data(chunks)  # not iter_lines: see event_data


@contextlib.contextmanager
def _bounded(
    http: httpx.Client, method: str, url: str, timeout_s: float, setting: str, **kwargs: Any
) -> Iterator[tuple[httpx.Response, Iterator[bytes]]]:
    """The response to one request and its body's chunks, ended by one total deadline."""
    deadline = request_deadline(timeout_s, setting)
    deadline.check()
    try:
        # Every read waits at most what was left at the start: a read that times out has
        # therefore outlived the whole request's deadline too.
        with http.stream(method, url, timeout=max(0.001, deadline.left_s()), **kwargs) as r:
            yield r, _until(r.iter_bytes(), deadline)
    except httpx.TimeoutException as exc:
        raise DeadlineExceeded(f"{deadline.reason}; the engine sent nothing more ({exc or 'timed out'})") from exc


# Headers that describe the bytes on the wire, not the decoded body a fetched response holds.
_WIRE_HEADERS = ("content-encoding", "content-length", "transfer-encoding")


def fetch(
    http: httpx.Client, method: str, url: str, timeout_s: float, *, setting: str = "request_timeout_s", **kwargs: Any
) -> httpx.Response:
    """One request whose whole answer must arrive within ``timeout_s`` (or an outer deadline in
    force): what :func:`post_events` does for a stream, for ``/health``, ``/tokenize``,
    ``/metrics`` and the like, where an engine that trickles its answer a byte at a time would
    otherwise never let a read time out.

    Args:
        http: The client.
        method: "GET", "POST"...
        url: Where.
        timeout_s: Bound on the whole request, seconds.
        setting: Where ``timeout_s`` comes from, for the message.
        **kwargs: Passed to ``httpx.Client.stream`` (``json=``, ``params=``...).

    Returns:
        The response, its body read and decoded.

    Raises:
        DeadlineExceeded: The answer was not complete by the deadline.
        httpx.HTTPError: The connection failed.
    """
    with _bounded(http, method, url, timeout_s, setting, **kwargs) as (r, chunks):
        body = b"".join(chunks)
        headers = [(k, v) for k, v in r.headers.multi_items() if k.lower() not in _WIRE_HEADERS]
        return httpx.Response(r.status_code, headers=headers, content=body, request=r.request)


def _check_driver_args(n_streams: int, timeout_s: float) -> None:
    if not _is_int(n_streams) or n_streams < 1:
        raise ConfigError(f"n_streams = {n_streams!r}: must be an integer >= 1")
    if not _is_real(timeout_s) or timeout_s <= 0:
        raise ConfigError(f"timeout_s = {timeout_s!r}: must be a finite number of seconds > 0")


def _check_stream(result: Any, index: int) -> StreamResult:
    if not isinstance(result, StreamResult):
        raise MeasurementError(f"stream {index} returned {type(result).__name__}: expected a StreamResult")
    return result


def _raise_first(failures: Sequence[tuple[int, BaseException]], n_streams: int) -> None:
    if not failures:
        return
    index, exc = failures[0]
    others = [i for i, _ in failures[1:]]
    exc.add_note(
        f"autotune: stream {index} of {n_streams} failed" + (f"; streams {others} failed too" if others else "")
    )
    raise exc


def run_streams_threaded(
    stream_fn: Callable[[int], StreamResult], n_streams: int, timeout_s: float
) -> ConcurrentResult:
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

    # Each thread runs in a copy of the caller's context, so the deadline in force here
    # (autotune.measure.deadline) ends its requests too.
    threads = [
        threading.Thread(
            target=contextvars.copy_context().run, args=(worker, i), daemon=True, name=f"autotune-stream-{i}"
        )
        for i in range(n_streams)
    ]
    try:
        for thread in threads:
            thread.start()
        barrier.wait(timeout=timeout_s)
    except (threading.BrokenBarrierError, RuntimeError) as exc:
        barrier.abort()
        raise MeasurementError(f"could not start {n_streams} streams together within {timeout_s}s: {exc!r}") from exc
    start_s = time.monotonic()
    deadline_s = start_s + timeout_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline_s - time.monotonic()))
    wall_s = time.monotonic() - start_s
    running = [i for i, t in enumerate(threads) if t.is_alive()]
    if running:
        error = MeasurementError(
            f"{len(running)} of {n_streams} streams still running after "
            f"{timeout_s}s (streams {running}): raise the timeout, "
            f"lower the load, or check that the engine is alive"
        )
        if failures:
            error.add_note(f"streams {sorted(i for i, _ in failures)} failed before that")
        raise error
    _raise_first(sorted(failures, key=lambda f: f[0]), n_streams)
    return ConcurrentResult(streams=tuple(r for r in results if r is not None), wall_s=wall_s)
