"""The twin's requests, one by one: what each of a workload's requests would see on an engine.

autotune measures a length distribution or Poisson arrivals request by request
(:mod:`autotune.measure.load`): every request's time to first token, inter-token latency and
end-to-end latency, and from them percentiles and goodput. The twin predicts the same quantities
by serving the same requests in a small event simulation of continuous batching, with the
engine's own costs from :mod:`physics`:

* the engine holds at most ``slots`` sequences (a request waits for a free one);
* each scheduler step first prefills the prompts admitted at it (their tokens at the engine's
  prefill rate, the batch waiting meanwhile, as llama.cpp's and vLLM's default schedulers do when
  they do not split prompts), then decodes one token for every running sequence in the time of
  one step of that many streams;
* a request's first token comes at the end of the step that prefilled it; closed-loop, a user
  sends the next request when its answer ends; open-loop, requests arrive at their times.

What it leaves out: chunked prefill and prefix caching (no request shares a prefix in autotune's
load anyway), and how a step's time grows with each sequence's own context (the step is costed
at the workload's mean context).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autotune.api import StreamResult
from autotune._builtin import ConcurrentResult, Workload, latency_metrics, poisson_arrivals, rate_run

from autotune_plugins.twin import physics

__all__ = ["predicted_metrics", "predicted_run", "run_metrics", "scaled", "simulate"]


def simulate(
    lengths: Sequence[tuple[int, int]],
    slots: int,
    prefill_tok_s: float,
    step_s: Callable[[int], float],
    request_s: float = 0.0,
    *,
    concurrency: int | None = None,
    arrivals: Sequence[float] | None = None,
) -> list[StreamResult]:
    """Every request's predicted result (timestamps from 0), in ``lengths`` order.

    Args:
        lengths: (prompt, output) tokens per request, in the order they are sent.
        slots: Sequences the engine runs at once.
        prefill_tok_s: The engine's prompt rate.
        step_s: Seconds of one decode step of ``n`` running sequences.
        request_s: What the server spends on each request besides the model (HTTP, tokenizing).
        concurrency: Closed loop: users, each sending its next request when answered.
        arrivals: Open loop: each request's sending time.
    """
    n = len(lengths)
    if (concurrency is None) == (arrivals is None):
        raise ValueError("give concurrency (closed loop) or arrivals (open loop)")
    sent = [0.0] * n
    ready = (
        list(arrivals)
        if arrivals is not None
        else [0.0] * min(concurrency or 1, n) + [float("inf")] * (n - min(concurrency or 1, n))
    )
    next_closed = min(concurrency or 1, n)  # the next request a freed user sends (closed loop)
    first = [0.0] * n
    end = [0.0] * n
    left = [o for _, o in lengths]
    waiting: list[int] = []
    running: list[int] = []
    pending = list(range(n))  # not yet sent, in order
    now = 0.0
    done = 0
    while done < n:
        while pending and ready[pending[0]] <= now:
            k = pending.pop(0)
            sent[k] = ready[k]
            waiting.append(k)
        if not running and not waiting:
            now = ready[pending[0]]  # idle until the next arrival
            continue
        admitted = []
        while waiting and len(running) < slots:
            k = waiting.pop(0)
            running.append(k)
            admitted.append(k)
        now += sum(request_s + lengths[k][0] / prefill_tok_s for k in admitted)
        now += step_s(len(running))
        for k in list(running):
            left[k] -= 1
            if k in admitted:
                first[k] = now
            if left[k] <= 0:
                end[k] = now
                running.remove(k)
                done += 1
                if arrivals is None and next_closed < n:  # the user sends its next request now
                    ready[next_closed] = now
                    next_closed += 1
    return [StreamResult.from_timestamps(lengths[k][0], lengths[k][1], sent[k], first[k], end[k]) for k in range(n)]


def predicted_run(
    s: physics.Scenario, k: physics.EngineConstants, host: physics.HostConstants, workload: Workload
) -> tuple[ConcurrentResult, float | None]:
    """The requests of one run of ``workload`` on scenario ``s`` (``s.parallel`` slots), served
    by :func:`simulate` at the engine's predicted prefill rate and step times: the requests
    drawn from a length distribution, at Poisson arrivals or ``parallel`` in flight; one request
    shape, ``parallel`` copies sent together. Returns the run and, open-loop, the rate offered
    (with a rate search, the highest that met the targets; 0 when none did)."""
    gpu_layers = physics.gpu_layer_split(s, k, physics.memory(s, k))
    c_decode = s.prompt_tokens + s.output_tokens / 2  # mean context while generating, as physics.predict
    steps: dict[int, float] = {}

    def step_s(n: int) -> float:
        if n not in steps:
            steps[n] = physics.decode_seconds(s, k, host, n, c_decode, gpu_layers)
        return steps[n]

    slots = min(s.jobs_at_once or s.parallel, s.parallel)
    request_s = k.request_ms * 1e-3 if s.harness == "server" else 0.0
    lengths = workload.run_lengths(s.parallel)
    prefill = physics.prefill_tok_s(s, k, host, gpu_layers)

    def at(rate: float | None) -> ConcurrentResult:
        arrivals = poisson_arrivals(len(lengths), rate, workload.seed) if rate else None
        streams = simulate(
            lengths, slots, prefill, step_s, request_s, concurrency=None if arrivals else s.parallel, arrivals=arrivals
        )
        return ConcurrentResult(tuple(streams), max(r.end_s for r in streams))

    return rate_run(workload, at, lambda run: latency_metrics(run, workload.slo))


def scaled(run: ConcurrentResult, speed: float) -> ConcurrentResult:
    """``run`` on an engine ``speed`` times as fast (a throttled clock, a run's noise)."""
    return ConcurrentResult(
        tuple(
            StreamResult.from_timestamps(
                r.prompt_tokens,
                r.output_tokens,
                r.start_s / speed,
                (r.start_s + r.ttft_ms / 1000) / speed,
                r.end_s / speed,
            )
            for r in run.streams
        ),
        run.wall_s / speed,
    )


def run_metrics(
    run: ConcurrentResult, workload: Workload, aggregate_tok_s: float, offered: float | None = None
) -> dict[str, float]:
    """The latency keys of a run (:data:`autotune.measure.LATENCY_UNITS`). For one request shape
    sent together, whose throughput the twin predicts in closed form (``service.served``),
    goodput is that throughput times the share of the simulated requests that met the targets,
    so that without targets it is the throughput, as measured."""
    out = latency_metrics(run, workload.slo)
    if offered is not None:
        out["rate_req_s"] = offered
    if not workload.shaped and run.total_output_tokens:
        share = out["goodput_tok_s"] / run.aggregate_tok_s if run.aggregate_tok_s else 0.0
        out["goodput_tok_s"] = aggregate_tok_s * share
        out["goodput_req_s"] = out["goodput_tok_s"] / workload.output_tokens
    return out


def predicted_metrics(
    s: physics.Scenario,
    k: physics.EngineConstants,
    host: physics.HostConstants,
    workload: Workload,
    aggregate_tok_s: float,
) -> dict[str, float]:
    """What ``predict`` adds for a workload of many requests or with targets: the latency keys
    and, for a distribution or arrivals, the simulation's aggregate and per-user rates in place
    of the one shape's closed form (``aggregate_tok_s``)."""
    run, offered = predicted_run(s, k, host, workload)
    rates = {"aggregate_tok_s": run.aggregate_tok_s, "per_user_tok_s": run.per_user_tok_s} if workload.shaped else {}
    return {**rates, **run_metrics(run, workload, rates.get("aggregate_tok_s", aggregate_tok_s), offered)}
