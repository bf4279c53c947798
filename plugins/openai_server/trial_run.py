"""One launched OpenAI-compatible server measured (the per-trial half of the openai-server
backend): prompts cut from what the server's tokenizer says, the streams of each run under the
protocol, and the engine's own ``/metrics`` beside the client's figures. :mod:`.backend` launches
the server and calls :func:`measure`.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable, Mapping, Sequence

from autotune.api import Measurement, StreamResult, StudyContext, TrialConfig, measure_engine, serving_run
from autotune._builtin import (
    ConcurrentResult,
    PROMPT_TEXT,
    command_line,
    disagreements,
    fetch,
    mask_argv,
    parse_prometheus,
    prompt_of,
    stream_completion,
    varied,
)
from autotune_plugins.openai_server.server import OpenAIServer
from autotune_plugins.openai_server.templates import Template

__all__ = ["measure", "prompts"]

log = logging.getLogger(__name__)


def prompts(server: OpenAIServer, t: Template) -> Callable[[int], tuple[Any, int]]:
    """Builds a prompt of ``n`` tokens (and its length) for any ``n``, the server asked to
    tokenize once: token ids when the template can tokenize, else text."""
    if t.prompt == "tokens":
        data = server.post(t.tokenize or "/tokenize", {t.tokenize_field: PROMPT_TEXT}, 30)
        raw = data.get("tokens") if isinstance(data, dict) else data
        base = [tok if isinstance(tok, int) else tok["id"] for tok in raw or ()]
        if not base:
            raise server.failure("the tokenizer returned no tokens for the prompt text")

        def tokens(n: int) -> tuple[Any, int]:
            cut = prompt_of(base, n)
            return cut, len(cut)

        return tokens
    words = PROMPT_TEXT.split()

    def text(n: int) -> tuple[Any, int]:
        # About 4/3 tokens per English word; the server's usage gives the real count.
        return " ".join((words * (n // len(words) + 2))[: max(1, int(n * 0.75))]), n

    return text


def measure(
    backend: Any,
    server: OpenAIServer,
    t: Template,
    config: TrialConfig,
    ctx: StudyContext,
    has_gpu: bool,
    request_s: float,
) -> Measurement:
    wl = ctx.workload
    make_prompt = prompts(server, t)
    prompt, n_prompt = make_prompt(wl.prompt_tokens)
    model = server.served_model()
    url = f"{server.url}/v1/completions"

    def body(i: int) -> dict[str, Any]:
        length, n_out = wl.request(i)  # request i's lengths, the same for every backend
        prompt_i = prompt if length == wl.prompt_tokens else make_prompt(length)[0]
        p = varied(prompt_i, i) if isinstance(prompt_i, list) else f"{i} {prompt_i}"
        out = {"prompt": p, "max_tokens": n_out, "temperature": 0, **t.request}
        if model:
            out["model"] = model
        return out

    def metrics() -> dict[str, float] | None:
        if not t.metrics_path:
            return None
        try:
            r = fetch(server.http, "GET", f"{server.url}{t.metrics_path}", 10, setting="metrics")
        except Exception:  # noqa: BLE001 - the engine's view is a check, not the measurement
            return None
        return parse_prometheus(r.text) if r.status_code == 200 else None

    server_rows: list[dict[str, Any]] = []

    def request(i: int) -> StreamResult:
        return stream_completion(server.http, url, body(i), wl.request(i)[0], request_s).result

    def around_streams(streams: Callable[[], ConcurrentResult]) -> ConcurrentResult:
        before = metrics()
        conc = streams()
        after = metrics()
        row: dict[str, Any] = {
            "client": {
                "generated_tokens": float(conc.total_output_tokens),
                "decode_tok_s": float(sum(s.decode_tok_s for s in conc.streams) / conc.n_streams),
            }
        }
        if before is not None and after is not None:
            row["server"] = t.counters.figures(before, after)
        server_rows.append(row)
        return conc

    stats, telemetry, peak = measure_engine(
        ctx,
        serving_run(request, request, config.parallel, request_s, around_streams=around_streams, workload=wl),
        warm_up=lambda: request(-1),  # allocator, caches, graphs
        key=str(backend.value(ctx, "stability_metric")),
        gpu=has_gpu,
        pid=server.proc.pid,
    )
    attrs: dict[str, Any] = {
        "engine_version": backend.version(t),
        "template": t.name,
        "template_file": t.source,
        "template_docs": t.docs,
        # Stored and shown (notes, report): any key in the argv masked (mask_argv).
        "command": command_line(mask_argv(server.argv)),
        "argv": mask_argv(server.argv),
        "gpu": has_gpu,
        "prompt_tokens": n_prompt,
        "server_metrics": _compare(server_rows[ctx.protocol.warmup_runs :], t),
    }
    for warning in attrs["server_metrics"]["warnings"]:
        log.warning("%s (template %s, %s)", warning, t.name, config.key)
    return Measurement(metrics=stats, peak_vram_bytes=peak, telemetry=telemetry, attrs=attrs)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _compare(rows: Sequence[Mapping[str, Any]], t: Template) -> dict[str, Any]:
    """The engine's own figures beside the client's, medians over the measured runs, and a warning
    for each that differs by more than 5%."""
    if not t.metrics_path:
        return {"available": False, "reason": f"template {t.name} names no metrics endpoint", "warnings": []}
    with_server = [r for r in rows if "server" in r]
    if not with_server:
        return {"available": False, "reason": f"{t.metrics_path} did not answer", "warnings": []}

    def med(side: str, key: str) -> float | None:
        return _median([r[side][key] for r in with_server if r[side].get(key) is not None])

    keys = ("generated_tokens", "decode_tok_s")
    server = {k: med("server", k) for k in keys}
    client = {k: med("client", k) for k in keys}
    return {
        "available": True,
        "path": t.metrics_path,
        "server": server,
        "client": client,
        "warnings": disagreements(server, client),
    }
