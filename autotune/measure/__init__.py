"""The benchmark protocol every backend shares.

A trial's number is only worth comparing with another trial's when both were measured the
same way. This package is that way, in these rooms:

* :mod:`autotune.measure.loop`: the one loop every backend measures with:
  :func:`measure_engine` (warm-up, the protocol's runs, the probe, telemetry) and
  :func:`serving_run` (one run from a serving engine's primitives: a request alone, N streams);
* :mod:`autotune.measure.protocol`: :class:`Protocol` (warm-ups, runs, when to stop),
  :class:`Stat` (the runs of one quantity, median and spread together) and
  :func:`repeat_until_stable_many` (applies the protocol to one sample function; through
  :func:`measure_engine`, which every backend uses);
* :mod:`autotune.measure.streams`: :func:`run_streams_threaded` runs N generation streams
  that really overlap and summarises them as a :class:`ConcurrentResult`; :func:`post_events`
  is the streaming client, each request ended by one total deadline
  (:mod:`autotune.measure.deadline`: its own, or an outer one such as the study's budget);
* :mod:`autotune.measure.gpu_telemetry`: :class:`GpuSampler` records what the GPU did
  meanwhile through NVML as :class:`GpuTelemetry`, and :func:`measure_with_telemetry` repeats
  under the sampler and takes the peak memory (for :func:`measure_engine`);
* :mod:`autotune.measure.openai_api`: a streamed ``/v1/completions`` request as a
  :class:`StreamResult`, and an engine's Prometheus ``/metrics`` read beside the client's
  figures (any OpenAI-compatible server); :mod:`autotune.measure.prompts`: the prompt text.

Import from here: the names below are the public API, whichever module holds them.
"""

from __future__ import annotations

from autotune.measure.deadline import DeadlineExceeded, within
from autotune.measure.gpu_telemetry import (
    SLOWDOWN_REASONS,
    THROTTLE_REASON_BITS,
    GpuSampler,
    GpuTelemetry,
    NvmlReader,
    PynvmlReader,
    measure_with_telemetry,
    throttle_reason_names,
)
from autotune.measure.loop import measure_engine, serving_metrics, serving_run
from autotune.measure.protocol import PROBE_STOP, Protocol, Stat, relative_spread, repeat_until_stable_many
from autotune.measure.streams import (
    CONCURRENT_UNITS,
    SERVING_UNITS,
    ConcurrentResult,
    StreamResult,
    event_data,
    post_events,
    run_streams_threaded,
)

__all__ = [
    "CONCURRENT_UNITS",
    "ConcurrentResult",
    "DeadlineExceeded",
    "GpuSampler",
    "GpuTelemetry",
    "PROBE_STOP",
    "NvmlReader",
    "PynvmlReader",
    "Protocol",
    "SERVING_UNITS",
    "SLOWDOWN_REASONS",
    "Stat",
    "StreamResult",
    "event_data",
    "THROTTLE_REASON_BITS",
    "measure_engine",
    "measure_with_telemetry",
    "post_events",
    "relative_spread",
    "repeat_until_stable_many",
    "run_streams_threaded",
    "serving_metrics",
    "serving_run",
    "throttle_reason_names",
    "within",
]
