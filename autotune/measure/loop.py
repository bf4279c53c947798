"""The one measurement loop: what a run is, and how often it is done.

Every backend's number must mean the same thing, so the backends do not write loops. A backend
starts its engine and hands this module the primitives of that engine; this module does the
warm-up, the runs the study's protocol asks for (``StudyContext.protocol``), the probe that may
end a launch after its first run (``StudyContext.probe``), and the telemetry around them:

* :func:`serving_run` makes one run out of the two primitives of a serving engine, one request
  alone (its decode and prefill rates, its time to first token) and ``parallel`` streams at once
  (aggregate and per-user rates), with an optional hook around the streams for the engine's own
  counters;
* :func:`measure_engine` runs a warm-up, then the protocol's runs under NVML, and returns the
  stats, the telemetry and the peak memory.

A backend whose engine composes a run itself (a worker process, a model) gives
:func:`measure_engine` its own ``run_once``, with the same keys (:data:`SERVING_UNITS`), and still
gets the protocol, the probe and the telemetry from here. Before this module each backend
called the repetition itself, and openai-server never passed the probe, so ``probe_margin``
silently did nothing there.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autotune.measure.gpu_telemetry import GpuTelemetry, measure_with_telemetry
from autotune.measure.load import latency_metrics, poisson_arrivals, run_requests, search_rate
from autotune.engine.workload import FIRST_RUN_REQUEST, RATE_SEARCH_STEPS
from autotune.measure.protocol import Protocol, Stat
from autotune.measure.streams import SERVING_UNITS, ConcurrentResult, StreamResult, run_streams_threaded

if TYPE_CHECKING:  # pragma: no cover
    from autotune.engine.workload import Workload

__all__ = ["measure_engine", "serving_metrics", "serving_run"]


class MeasuredContext(typing.Protocol):
    """What the loop reads of a study's context (:class:`autotune.engine.backend.StudyContext` is one):
    named here, so that the loop sits below the backend that hands it its context."""

    @property
    def protocol(self) -> Protocol: ...

    @property
    def gpu_index(self) -> int: ...

    @property
    def probe(self) -> Callable[[Mapping[str, float]], bool] | None: ...


def serving_metrics(
    alone: StreamResult, together: ConcurrentResult, slo: Sequence[tuple[str, float]] = ()
) -> dict[str, float]:
    """The quantities of one run (:data:`SERVING_UNITS`): the request alone's decode, prefill
    and time to first token; the streams' aggregate and median per-user rate; the percentiles of
    the streams' latencies and their goodput under ``slo`` (:func:`latency_metrics`)."""
    return {
        "decode_tok_s": alone.decode_tok_s,
        "prefill_tok_s": alone.prefill_tok_s,
        "ttft_ms": alone.ttft_ms,
        "aggregate_tok_s": together.aggregate_tok_s,
        "per_user_tok_s": together.per_user_tok_s,
        **latency_metrics(together, slo),
    }


def serving_run(
    alone: Callable[[int], StreamResult],
    stream: Callable[[int], StreamResult],
    parallel: int,
    timeout_s: float,
    *,
    around_streams: Callable[[Callable[[], ConcurrentResult]], ConcurrentResult] | None = None,
    workload: Workload | None = None,
) -> Callable[[], dict[str, float]]:
    """One run of a serving engine, as every serving backend defines it.

    Args:
        alone: Sends request number ``i`` with nothing else in flight and returns its result.
        stream: Sends stream request number ``i``; ``parallel`` of them run at once.
        parallel: Streams at once (the configuration's slots).
        timeout_s: Bound on the streams together.
        around_streams: Wraps the streams (called with the function that runs them, returns
            its result): where a backend reads the engine's counters or CPU time before and
            after.
        workload: The study's (``ctx.workload``). One request shape (or None): ``parallel``
            requests released together, as always. A length distribution or Poisson arrivals
            (``Workload.shaped``): the run's drawn requests, ``parallel`` in flight (closed loop)
            or each at its arrival time (open loop, the same times every run). Either way the
            backend builds request ``i`` to ``workload.request(i)``'s lengths, and goodput
            counts against ``workload.slo``. With ``workload.rate_search`` each run first sends
            the requests at several Poisson rates (a bisection, :func:`search_rate`), then once
            more at the highest rate that met the targets, which it reports (``rate_req_s`` that
            rate; 0 when none did, the load then sent at the range's low end).

    Returns:
        A ``run_once`` for :func:`measure_engine`. Request numbers never repeat within a
        launch (a prompt differs per number, so no engine answers from its prompt cache).
    """
    counter = iter(range(10**9))
    slo = workload.slo if workload is not None else ()
    shaped = workload is not None and workload.shaped
    size = workload.run_size(parallel) if workload is not None else parallel
    search = workload.rate_search if workload is not None else None
    fixed = workload.rate if workload is not None and workload.arrival == "poisson" else None
    loads = iter(range(10**9))  # each load of requests sent, for their numbers

    def load(rate: float | None) -> ConcurrentResult:
        # Numbered from a multiple of the run's size, so request k of every load has the lengths
        # of the drawn request k (Workload.request); above the requests alone's.
        first = size * (FIRST_RUN_REQUEST + next(loads))
        indices = range(first, first + size)
        if rate is not None:
            arrivals = poisson_arrivals(size, rate, workload.seed if workload is not None else 0)
            return run_requests(stream, indices, timeout_s + arrivals[-1], arrivals=arrivals)
        return run_requests(stream, indices, timeout_s * math.ceil(size / parallel), concurrency=parallel)

    def run_once() -> dict[str, float]:
        i = next(counter)
        single = alone(i)
        rate = fixed
        if search is not None:
            # The bisection's loads first; then the run itself at the rate found (``low`` when
            # none met the targets), alone inside the backend's hook, whose engine counters
            # must describe the requests the run reports.
            found, _ = search_rate(lambda r: latency_metrics(load(r), slo), slo, *search, steps=RATE_SEARCH_STEPS)
            rate = found if found is not None else search[0]

        def streams() -> ConcurrentResult:
            if not shaped:
                return run_streams_threaded(lambda j: stream(1000 + parallel * i + j), parallel, timeout_s)
            return load(rate)

        together = around_streams(streams) if around_streams is not None else streams()
        out = serving_metrics(single, together, slo)
        if shaped and rate is not None:  # open loop: the rate offered (found), not the rate served
            out["rate_req_s"] = 0.0 if search is not None and found is None else float(rate)
        return out

    return run_once


def measure_engine(
    ctx: MeasuredContext,
    run_once: Callable[[], Mapping[str, float]],
    *,
    warm_up: Callable[[], Any] | None = None,
    key: str = "aggregate_tok_s",
    units: Mapping[str, str] = SERVING_UNITS,
    gpu: bool = False,
    pid: int | None = None,
) -> tuple[dict[str, Stat], GpuTelemetry | None, int | None]:
    """Measure one started engine by the study's protocol: every backend's loop.

    Args:
        ctx: The study's context: its ``protocol`` (warm-up runs, runs, when to stop), its
            ``probe`` (multi-fidelity; None: measure in full) and ``gpu_index``.
        run_once: One run (e.g. :func:`serving_run`), returning a value per key of ``units``.
        warm_up: Called once before any run, outside the protocol's own warm-up runs: what
            the first request of a fresh engine pays (allocator, caches, CUDA graphs).
        key: The quantity whose spread decides when the runs are stable (a backend's
            ``stability_metric`` setting).
        units: The quantities and their units.
        gpu: Whether the engine runs on a GPU (then NVML watches the runs).
        pid: The engine's process, for its own peak memory.

    Returns:
        The stats, the telemetry (None without a GPU) and the peak device memory.
    """
    if warm_up is not None:
        warm_up()
    return measure_with_telemetry(
        run_once, ctx.protocol, units, key, gpu=gpu, gpu_index=ctx.gpu_index, pid=pid, probe=ctx.probe
    )
