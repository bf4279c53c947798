"""The load generator: many requests, sent closed-loop or at Poisson arrivals, and their latencies.

* :func:`run_requests` sends requests through a backend's one-request primitive, either with a
  fixed number in flight (closed loop: each finished request frees its place for the next) or
  each at its own arrival time (open loop, :func:`poisson_arrivals`), and returns the
  :class:`~autotune.measure.streams.ConcurrentResult` of them all;
* :func:`latency_metrics` turns the requests of a run into the percentiles of time to first token
  (TTFT), inter-token latency (ITL, a request's mean gap between tokens after the first) and
  end-to-end latency (E2E), and into goodput: the requests (and their output tokens) per second
  that met every per-request target (:func:`meets`);
* :func:`run_openai_load` is all of it against any OpenAI-compatible URL, for a bench script
  (e.g. beside aiperf or guidellm), and :func:`search_rate` the highest Poisson rate whose run
  still meets the targets (a bisection, as SGLang's and vLLM's SLA searches do).

A study's run uses the first two through :func:`autotune.measure.serving_run`.
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from autotune.measure.openai_api import stream_completion
from autotune.measure.prompts import PROMPT_TEXT, prompt_of, varied
from autotune.measure.streams import LATENCY_UNITS, ConcurrentResult, StreamResult, _raise_first
from autotune.engine.workload import RATE_SEARCH_STEPS, SLO_KEYS, Workload, percentile

__all__ = [
    "LATENCY_UNITS",
    "LoadReport",
    "latency_metrics",
    "meets",
    "poisson_arrivals",
    "request_latencies",
    "rate_run",
    "run_openai_load",
    "run_requests",
    "search_rate",
]


def poisson_arrivals(n: int, rate: float, seed: int | str) -> list[float]:
    """``n`` arrival times (seconds from the start, the first at 0) of a Poisson process of
    ``rate`` per second: exponential gaps, seeded, so every run and every trial sends at the
    same moments. The draws do not depend on the rate, only their scale: a higher rate sends the
    same requests closer together, so a rate search compares like with like."""
    rng = random.Random(f"arrivals:{seed}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_requests(
    send: Callable[[int], StreamResult],
    indices: Sequence[int],
    timeout_s: float,
    *,
    concurrency: int | None = None,
    arrivals: Sequence[float] | None = None,
) -> ConcurrentResult:
    """Send request ``indices[k]`` through ``send`` for every ``k``, closed-loop or open-loop.

    Args:
        send: One blocking request (a backend's stream primitive).
        indices: The request numbers, in the order they are sent.
        timeout_s: Bound on the whole load (each request is bounded by ``send`` itself too).
        concurrency: Closed loop: this many in flight, each finished one replaced by the next.
        arrivals: Open loop: request ``k`` is sent ``arrivals[k]`` seconds after the start,
            whatever is still in flight (the server queues what it cannot take).

    Returns:
        Every request's result, in ``indices`` order.

    Raises:
        The first request's exception (with a note of the others that failed), or
        TimeoutError when the load outlasted ``timeout_s``.
    """
    if (concurrency is None) == (arrivals is None):
        raise ValueError("give concurrency (closed loop) or arrivals (open loop), not both")
    n = len(indices)
    if n == 0:
        raise ValueError("no requests to send")
    results: list[StreamResult | None] = [None] * n
    failures: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def one(k: int) -> None:
        try:
            results[k] = send(indices[k])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            with lock:
                failures.append((indices[k], exc))

    t0 = time.monotonic()
    threads: list[threading.Thread] = []
    if concurrency is not None:
        todo: queue.SimpleQueue[int] = queue.SimpleQueue()
        for k in range(n):
            todo.put(k)
        barrier = threading.Barrier(min(concurrency, n))

        def worker() -> None:
            barrier.wait()  # released together, so the first ones really overlap
            while not failures:
                try:
                    k = todo.get_nowait()
                except queue.Empty:
                    return
                one(k)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, n))]
        for t in threads:
            t.start()
    else:
        assert arrivals is not None
        for k in range(n):
            delay = t0 + arrivals[k] - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if failures:
                break
            t = threading.Thread(target=one, args=(k,), daemon=True)
            t.start()
            threads.append(t)
    end = t0 + timeout_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    wall = time.monotonic() - t0
    if failures:
        failures.sort(key=lambda f: f[0])
        _raise_first(failures, n)
    if any(t.is_alive() for t in threads) or any(r is None for r in results):
        raise TimeoutError(f"{n} requests were not all answered within {timeout_s:.0f} s")
    return ConcurrentResult(tuple(r for r in results if r is not None), wall)


@dataclass(frozen=True)
class RequestLatency:
    """One request's latencies, milliseconds, and its output tokens."""

    ttft_ms: float
    itl_ms: float
    e2e_ms: float
    output_tokens: int
    decode_tok_s: float


def request_latencies(s: StreamResult) -> RequestLatency:
    """TTFT as the client saw it; ITL the mean gap between tokens after the first (what vLLM
    calls TPOT; 0 for a one-token answer, which has no gap); E2E from sending to the last token."""
    itl = 1000.0 / s.decode_tok_s if s.decode_tok_s > 0 and s.output_tokens > 1 else 0.0
    return RequestLatency(s.ttft_ms, itl, (s.end_s - s.start_s) * 1000.0, s.output_tokens, s.decode_tok_s)


def meets(r: RequestLatency, slo: Sequence[tuple[str, float]]) -> bool:
    """Whether one request meets every target: each latency within the loosest target set on
    it (a p99 target bounds every request that is not in the worst 1%; a request beyond the
    loosest bound fails whatever the percentile), and its decode speed at least the per-user
    floor (``min_per_user_tok_s``)."""
    bound: dict[str, float] = {}
    for key, value in slo:
        if key == "min_per_user_tok_s":
            if r.output_tokens > 1 and r.decode_tok_s < value:
                return False
            continue
        quantity = key.split("_p", 1)[0]
        bound[quantity] = max(bound.get(quantity, 0.0), value)
    seen = {"ttft": r.ttft_ms, "itl": r.itl_ms, "e2e": r.e2e_ms}
    return all(seen[q] <= b for q, b in bound.items())


def latency_metrics(result: ConcurrentResult, slo: Sequence[tuple[str, float]] = ()) -> dict[str, float]:
    """The keys of :data:`LATENCY_UNITS` for one run's requests: the p50, p95 and p99 of TTFT,
    ITL and E2E, and goodput (requests, and their output tokens, that met every target, per
    second of the run's span), and ``rate_req_s``, the requests completed per second. Without
    targets every request counts: goodput is the throughput."""
    lat = [request_latencies(s) for s in result.streams]
    out = {}
    for q in ("ttft", "itl", "e2e"):
        values = [getattr(r, f"{q}_ms") for r in lat]
        for p in (50, 95, 99):
            out[f"{q}_p{p}_ms"] = percentile(values, p)
    good = [r for r in lat if meets(r, slo)]
    span = result.span_s
    out["goodput_req_s"] = len(good) / span if span > 0 else 0.0
    out["goodput_tok_s"] = sum(r.output_tokens for r in good) / span if span > 0 else 0.0
    # The requests completed per second; an open-loop run says the rate it was offered instead.
    out["rate_req_s"] = len(lat) / span if span > 0 else 0.0
    return out


def slo_met(metrics: Mapping[str, float], slo: Sequence[tuple[str, float]]) -> list[str]:
    """The targets a run's percentiles miss, one line each (empty: all met)."""
    out = []
    for key, target in slo:
        if key not in SLO_KEYS:
            continue  # the per-user floor is per request: counted in goodput; its constraint reads per_user_tok_s
        if metrics.get(key, math.inf) > target:
            out.append(f"{key} {metrics.get(key, math.nan):.0f} > {target:g}")
    return out


@dataclass(frozen=True)
class LoadReport:
    """One load run against a server: its requests and what they add up to.

    Attributes:
        result: The requests (client timestamps and token counts).
        metrics: :data:`LATENCY_UNITS`' keys (``rate_req_s``: requests answered per second), with
            ``aggregate_tok_s`` and ``offered_rate`` (the Poisson rate, 0 closed-loop).
        missed: The targets the percentiles missed.
    """

    result: ConcurrentResult
    metrics: Mapping[str, float]
    missed: tuple[str, ...] = field(default=())

    @property
    def records(self) -> list[dict[str, Any]]:
        """One dict per request: lengths, ttft_ms, itl_ms, e2e_ms (for a peer comparison)."""
        return [
            {
                "prompt_tokens": s.prompt_tokens,
                "output_tokens": s.output_tokens,
                **{k: v for k, v in vars(request_latencies(s)).items() if k.endswith("_ms")},
            }
            for s in self.result.streams
        ]


def run_openai_load(
    base_url: str,
    requests: Sequence[tuple[int, int]],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    slo: Sequence[tuple[str, float]] = (),
    model: str | None = None,
    base_tokens: Sequence[int] | None = None,
    timeout_s: float = 600.0,
    first_index: int = 0,
) -> LoadReport:
    """Send ``requests`` (prompt, output tokens each) to an OpenAI-compatible server's
    ``/v1/completions``, streamed, as a study would: closed loop at ``concurrency`` or Poisson
    arrivals at ``rate`` (seeded); prompts are token ids (``base_tokens``, else the server's
    ``/tokenize`` of autotune's prompt text, llama-server's form) cut to each length, the first
    token varied per request so no prefix cache answers; ``ignore_eos`` holds each answer to its
    length on servers that honour it (llama-server, vLLM).

    Returns:
        The :class:`LoadReport` (per-request records in ``.records``, percentiles and goodput in
        ``.metrics``).
    """
    base_url = base_url.rstrip("/").removesuffix("/v1")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    with httpx.Client(trust_env=False, limits=limits) as http:
        if base_tokens is None:
            r = http.post(f"{base_url}/tokenize", json={"content": PROMPT_TEXT}, timeout=30)
            r.raise_for_status()
            base_tokens = [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]

        def send(i: int) -> StreamResult:
            p, o = requests[i % len(requests)]
            body: dict[str, Any] = {
                "prompt": varied(prompt_of(base_tokens, p), i),
                "max_tokens": o,
                "ignore_eos": True,
                "temperature": 0,
            }
            if model:
                body["model"] = model
            return stream_completion(http, f"{base_url}/v1/completions", body, p, timeout_s).result

        indices = list(range(first_index, first_index + len(requests)))
        arrivals = poisson_arrivals(len(requests), rate, seed) if rate is not None else None
        result = run_requests(send, indices, timeout_s, concurrency=concurrency, arrivals=arrivals)
    metrics = {**latency_metrics(result, slo), "aggregate_tok_s": result.aggregate_tok_s, "offered_rate": rate or 0.0}
    return LoadReport(result, metrics, tuple(slo_met(metrics, slo)))


def search_rate(
    measure: Callable[[float], Mapping[str, float]],
    slo: Sequence[tuple[str, float]],
    low: float,
    high: float,
    *,
    steps: int = 6,
) -> tuple[float | None, list[tuple[float, bool]]]:
    """The highest Poisson rate (requests/s) in ``[low, high]`` whose run meets every target,
    by bisection: ``measure(rate)`` runs the load at a rate and returns its metrics
    (:func:`latency_metrics`' keys). Latency grows with the rate, so the rates that meet the
    targets are those below one threshold; ``steps`` bisections pin it to ``(high - low) / 2**steps``.

    Returns:
        (the highest rate that met the targets, or None when even ``low`` missed them; every
        rate tried with whether it met them, in order).
    """
    if not 0 < low < high:
        raise ValueError(f"rate search needs 0 < low < high (got {low}, {high})")
    tried: list[tuple[float, bool]] = []

    def ok(rate: float) -> bool:
        good = not slo_met(measure(rate), slo)
        tried.append((rate, good))
        return good

    if ok(high):
        return high, tried
    if not ok(low):
        return None, tried
    lo, hi = low, high
    for _ in range(steps):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


R = TypeVar("R")


def rate_run(
    workload: Workload, run: Callable[[float | None], R], metrics_of: Callable[[R], Mapping[str, float]]
) -> tuple[R, float | None]:
    """The run a workload's arrivals ask for, and the rate it reports (``rate_req_s``), for an
    engine whose runs can be kept: a worker's, the twin's simulation. ``run(rate)`` sends the
    run's requests at a Poisson ``rate`` (None: closed loop); ``metrics_of`` its latency keys.

    Closed loop: ``run(None)``, no rate. A fixed rate: that run and rate. A rate search: the
    bisection's run at the highest rate that met the targets, reported; when none did, its run at
    the range's low end, reported as 0. (:func:`autotune.measure.serving_run` decides the same
    but sends the chosen rate once more: its backend's hook reads the engine's counters around
    the one run it reports.)
    """
    if workload.arrival == "poisson" and workload.rate_search:
        runs: dict[float, R] = {}

        def measured(rate: float) -> Mapping[str, float]:
            runs[rate] = run(rate)
            return metrics_of(runs[rate])

        found, _ = search_rate(measured, workload.slo, *workload.rate_search, steps=RATE_SEARCH_STEPS)
        # search_rate always runs ``low`` before it gives up, and returns a rate it ran
        return runs[found if found is not None else workload.rate_search[0]], found or 0.0
    rate = workload.rate if workload.arrival == "poisson" else None
    return run(rate), rate
