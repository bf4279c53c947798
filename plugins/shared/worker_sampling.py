"""How a Python engine's worker replies become one run's metrics, for every worker backend.

A worker (ExLlamaV2's, ExLlamaV3's) composes a run in its own process: one request alone, then
the run's requests (the workload's, each to its own lengths, closed loop or at Poisson arrival
times), and answers with each request as a :class:`~autotune.measure.StreamResult`. The parent
turns them into the run's metrics, latencies and goodput by the core's rules
(:func:`autotune.measure.serving_metrics`), and searches the rate as the core's ``serving_run``
does: one owner of that arithmetic, so two worker backends cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from autotune.api import StreamResult
from autotune._builtin import ConcurrentResult, Workload, poisson_arrivals, rate_run, serving_metrics

__all__ = ["worker_sampler"]


def worker_sampler(
    ask: Callable[[Mapping[str, Any]], Mapping[str, Any]], wl: Workload, parallel: int
) -> Callable[[], dict[str, float]]:
    """The ``run_once`` of :func:`autotune.measure.measure_engine` for a worker backend.

    Args:
        ask: Sends the worker one ``sample`` request with these extra fields (``requests``,
            ``concurrency``, ``arrivals``: absent for one request shape) and returns its reply,
            which holds ``single`` and ``streams`` (``StreamResult`` fields).
        wl: The study's workload.
        parallel: The configuration's concurrent requests (closed loop).
    """
    lengths = wl.run_lengths(parallel)

    def one(rate: float | None) -> dict[str, float]:
        extra: dict[str, Any] = {}
        if wl.shaped:  # the workload's requests, each to its lengths, as every backend sends them
            extra = {
                "requests": lengths,
                "concurrency": parallel,
                "arrivals": poisson_arrivals(len(lengths), rate, wl.seed) if rate else None,
            }
        reply = ask(extra)
        single, streams = StreamResult(**reply["single"]), [StreamResult(**r) for r in reply["streams"]]
        wall = max(r.end_s for r in streams) - min(r.start_s for r in streams)
        return serving_metrics(single, ConcurrentResult(tuple(streams), wall), wl.slo)

    def sample() -> dict[str, float]:
        metrics, rate = rate_run(wl, one, lambda m: m)
        return {**metrics, **({"rate_req_s": rate} if rate is not None else {})}

    return sample
