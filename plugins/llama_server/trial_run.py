"""One launched llama-server measured (the per-trial half of the llama-server backend): the
streams of each run under the protocol, llama-server's own timings beside the client's, and what
the load generator took of the machine. :mod:`.backend` launches the server and calls :func:`measure`.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Callable, Mapping, Sequence

from autotune._builtin import ACCEPTANCE_ATTR, DraftCount, command_line, mask_argv, total_acceptance
from autotune.api import Measurement, StreamResult, StudyContext, TrialConfig, measure_engine, serving_run
from autotune._builtin import ConcurrentResult, SERVING_UNITS, post_events, prompt_of, varied
from autotune_plugins.llama_server.server import CpuPlan, Pinned, Server, median, process_cpu_s

__all__ = ["measure"]

UNITS = SERVING_UNITS


def measure(
    backend: Any,
    server: Server,
    config: TrialConfig,
    ctx: StudyContext,
    has_gpu: bool,
    startup_s: float,
    request_s: float,
) -> Measurement:
    backend.wait_ready(server, startup_s)
    wl = ctx.workload
    base = backend.base_tokens(server)
    prompt = prompt_of(base, wl.prompt_tokens)
    url = f"{server.url}/completion"

    def body(i: int) -> dict[str, Any]:
        n_prompt, n_out = wl.request(i)  # request i's lengths, the same for every backend
        return {
            "prompt": varied(prompt_of(base, n_prompt), i),
            "n_predict": n_out,
            "ignore_eos": True,
            "temperature": 0,
            "cache_prompt": False,
            "stream": True,
        }

    def stream(i: int, seen: list[dict[str, Any]]) -> StreamResult:
        start = time.monotonic()
        first = None
        n_out = 0
        n_prompt = wl.request(i)[0]
        timings: dict[str, Any] = {}
        events = post_events(server.http, url, body(i), request_s, failure=server.failure)
        with contextlib.closing(events):
            for payload in events:
                data = json.loads(payload)
                if first is None and data.get("content") is not None and not data.get("stop"):
                    first = time.monotonic()
                if data.get("stop"):
                    timings = data.get("timings") or {}
                    n_out = int(timings.get("predicted_n", data.get("tokens_predicted", 0)))
                    n_prompt = int(timings.get("prompt_n", n_prompt))
                    # The last event: waiting for the server to close the stream as well
                    # hung a finish's request alone until the timeout (seen on the CPU).
                    break
        end = time.monotonic()
        if first is None:
            first = end
        client = StreamResult.from_timestamps(n_prompt, n_out, start, first, end)
        seen.append(
            {
                "client_decode": client.decode_tok_s,
                "client_ttft_ms": client.ttft_ms,
                "engine_decode": float(timings.get("predicted_per_second") or 0.0),
                "engine_prefill": float(timings.get("prompt_per_second") or 0.0),
                "timings": timings,
            }
        )
        if not timings.get("predicted_per_second"):
            return client
        # The server's own clock for the rates: on a fast model a whole burst of tokens
        # arrives in one read, and the client's gaps measure the socket, not the decode.
        return StreamResult(
            n_prompt,
            n_out,
            client.ttft_ms,
            float(timings["predicted_per_second"]),
            float(timings.get("prompt_per_second") or client.prefill_tok_s),
            start,
            end,
        )

    runs: list[dict[str, Any]] = []  # per run: the engine's timings and what the client cost

    def alone(i: int) -> StreamResult:
        """One request alone: the engine's timings, and the time to its first token as a
        client sees it (``ttft_ms`` means that for every backend; the engine's ``prompt_ms``
        leaves out queueing, tokenizing and slot handling)."""
        seen: list[dict[str, Any]] = []
        result = stream(i, seen)
        if not seen[0]["timings"].get("predicted_per_second"):
            raise server.failure("/completion gave no timings (predicted_per_second) for a request alone")
        runs.append({"single": {**seen[0]["timings"], "client_ttft_ms": result.ttft_ms}, "streams": []})
        return result

    def around_streams(streams: Callable[[], ConcurrentResult]) -> ConcurrentResult:
        cpu0, engine0, wall0 = time.process_time(), process_cpu_s(server.proc.pid), time.monotonic()
        conc = streams()
        wall = time.monotonic() - wall0
        cpu, engine1 = time.process_time() - cpu0, process_cpu_s(server.proc.pid)
        runs[-1].update(
            {
                "wall_s": wall,
                "client_cpu_s": cpu,
                "aggregate_tok_s": conc.aggregate_tok_s,
                "engine_cpu_s": None if engine0 is None or engine1 is None else engine1 - engine0,
            }
        )
        return conc

    with Pinned(server.cpus.client) as client_pin:
        stats, telemetry, peak = measure_engine(
            ctx,
            serving_run(
                alone,
                lambda j: stream(j, runs[-1]["streams"]),
                config.parallel,
                request_s,
                around_streams=around_streams,
                workload=wl,
            ),
            warm_up=lambda: stream(-1, []),  # allocator, caches, CUDA graphs
            key=str(backend.value(ctx, "stability_metric")),
            gpu=has_gpu,
            pid=server.proc.pid,
        )
    cpus = server.cpus
    if client_pin.error:
        cpus = CpuPlan(cpus.engine, None, f"{cpus.note}, but the load generator was {client_pin.error}")
    measured = runs[ctx.protocol.warmup_runs :]  # the runs the stats are made of
    attrs: dict[str, Any] = {
        "engine_version": backend._version_of(server.cmd[0]),
        "command": command_line(mask_argv(server.cmd)),  # stored and shown: a key masked
        "argv": mask_argv(server.cmd),
        "gpu": has_gpu,
        "prompt_tokens": len(prompt),
        **_timings(measured),
        "load_generator": _load_generator(measured, cpus),
    }
    if config.option("spec_type", "none") != "none":
        attrs[ACCEPTANCE_ATTR] = acceptance(measured).to_dict()
    return Measurement(metrics=stats, peak_vram_bytes=peak, telemetry=telemetry, attrs=attrs)


def _timings(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The engine's own figures beside the client's, each the median over the measured runs.

    ``engine_timings`` are llama-server's ``timings`` (its own clock); ``streams_*`` are over the
    ``parallel`` streams of one run: ``_sum`` adds them (the engine's view of the aggregate),
    ``_median`` is the middle stream. ``client_timings`` are autotune's timestamps.
    """

    def over_runs(f: Any) -> float | None:
        return median([v for v in (f(r) for r in runs) if v is not None])

    def streams(r: Mapping[str, Any], k: str) -> list[float]:
        return [s[k] for s in r["streams"]]

    return {
        "engine_timings": {
            "single_decode_tok_s": over_runs(lambda r: float(r["single"]["predicted_per_second"])),
            "single_prefill_tok_s": over_runs(lambda r: float(r["single"]["prompt_per_second"])),
            "single_prompt_ms": over_runs(lambda r: r["single"].get("prompt_ms")),
            "streams_decode_tok_s_sum": over_runs(lambda r: sum(streams(r, "engine_decode")) or None),
            "streams_decode_tok_s_median": over_runs(lambda r: median(streams(r, "engine_decode"))),
            "streams_prefill_tok_s_median": over_runs(lambda r: median(streams(r, "engine_prefill"))),
        },
        "client_timings": {
            "aggregate_tok_s": over_runs(lambda r: r["aggregate_tok_s"]),
            "streams_decode_tok_s_median": over_runs(lambda r: median(streams(r, "client_decode"))),
            "streams_ttft_ms_median": over_runs(lambda r: median(streams(r, "client_ttft_ms"))),
        },
    }


def acceptance(runs: Sequence[Mapping[str, Any]]) -> Any:
    """The draft counters of every measured request (the one alone and the streams), summed.

    llama-server's ``timings`` carry ``draft_n`` and ``draft_n_accepted`` once a slot has drafted
    (tools/server/server-common.cpp ``server_slot_stats::to_json``: absent while
    ``n_draft_tokens`` is 0, so a request that drafted nothing counts 0). Its verification passes
    (``n_draft_verif_steps``) are only logged, not returned: ``passes`` stays unknown."""
    requests = [r["single"] for r in runs] + [s["timings"] for r in runs for s in r["streams"]]
    return total_acceptance(
        DraftCount(int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0)), int(t.get("predicted_n", 0)))
        for t in requests
    )


def _load_generator(runs: Sequence[Mapping[str, Any]], cpus: CpuPlan) -> dict[str, Any]:
    """What the client cost during the concurrent phase (CPU seconds of autotune's whole
    process per wall second, i.e. cores busy) and the engine's own use, with the pinning."""

    def cores(k: str) -> float | None:
        return median([r[k] / r["wall_s"] for r in runs if r[k] is not None and r["wall_s"] > 0])

    return {"client_cpu_cores": cores("client_cpu_s"), "engine_cpu_cores": cores("engine_cpu_s"), **cpus.to_dict()}
