"""The load every OpenAI-compatible server gets: streamed ``/v1/completions``, and its own metrics.

Engine-neutral: vLLM, SGLang, TGI, TabbyAPI and llama-server all answer the same request, so one
client measures them all the same way.

* :func:`stream_completion` sends one streaming request and returns what the client saw as a
  :class:`~autotune.measure.StreamResult` (its timestamps: TTFT, decode rate) and the tokens
  the server says it generated;
* :func:`parse_prometheus` reads a Prometheus ``/metrics`` page, and :class:`ServerCounters`
  turns two readings of it into the engine's own figures for a run, to be recorded beside the
  client's; :func:`disagreements` says where the two differ by more than 5%.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from autotune.errors import MeasurementError
from autotune.measure.streams import StreamResult, post_events

__all__ = [
    "DISAGREEMENT_TOL",
    "ServerCounters",
    "StreamedCompletion",
    "disagreements",
    "parse_prometheus",
    "stream_completion",
]

#: The relative difference between the engine's figure and the client's beyond which the trial
#: warns: at 5% a whole-run figure is no longer explained by the first token's placement.
DISAGREEMENT_TOL = 0.05


@dataclass(frozen=True)
class StreamedCompletion:
    """One streamed completion: the client's result and what the server reported with it.

    Attributes:
        result: Client timestamps (start, first token, end) and token counts.
        chunks: Streamed chunks that carried text.
        usage: The server's ``usage`` object when it sent one (``completion_tokens``...).
    """

    result: StreamResult
    chunks: int
    usage: Mapping[str, Any] | None


def stream_completion(
    http: httpx.Client, url: str, body: Mapping[str, Any], prompt_tokens: int, timeout_s: float
) -> StreamedCompletion:
    """POST ``body`` to ``url`` (``.../v1/completions``) with ``stream`` on; read it to the end.

    The output tokens are the server's ``usage.completion_tokens`` when it reports usage,
    else the chunks that carried text (one token each on every engine autotune knows).

    Args:
        http: The client (no proxy, no pooled keep-alive: see the llama-server plugin's note).
        url: The completions URL.
        body: The request; ``stream`` and ``stream_options`` are set here.
        prompt_tokens: Tokens in the prompt, unless the server's usage says otherwise.
        timeout_s: Bound on the whole request, from sending it to its last byte (see
            :func:`~autotune.measure.streams.post_events`).

    Raises:
        DeadlineExceeded: The request was still open at its deadline.
        MeasurementError: HTTP status other than 200, or a stream that is not server-sent JSON.
    """
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.monotonic()
    first: float | None = None
    chunks = 0
    usage: Mapping[str, Any] | None = None
    with contextlib.closing(post_events(http, url, payload, timeout_s)) as events:
        for data in events:
            data = data.strip()
            if data == "[DONE]":
                break
            try:
                event = json.loads(data)
            except json.JSONDecodeError as exc:
                raise MeasurementError(f"{url}: a streamed event is not JSON ({data[:120]!r})") from exc
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                if choice.get("text"):
                    chunks += 1
                    if first is None:
                        first = time.monotonic()
    end = time.monotonic()
    n_out = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") is not None else chunks
    n_prompt = int(usage["prompt_tokens"]) if usage and usage.get("prompt_tokens") else prompt_tokens
    result = StreamResult.from_timestamps(n_prompt, n_out, start, first if first is not None else end, end)
    return StreamedCompletion(result, chunks, usage)


_SAMPLE_RX = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values of a Prometheus text page by metric name, series of one name added up
    (labels such as ``model_name`` split a counter the server keeps for one model)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RX.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


@dataclass(frozen=True)
class ServerCounters:
    """Which counters of an engine's ``/metrics`` give its own view of a run.

    Attributes:
        generated_tokens: Counter of output tokens generated.
        decode_tokens: Counter of the tokens timed by ``decode_seconds`` (a histogram's
            ``_count``, or a token counter).
        decode_seconds: Counter of the seconds those tokens took per sequence (a histogram's
            ``_sum``): their ratio is the engine's per-stream decode speed.
    """

    generated_tokens: str | None = None
    decode_tokens: str | None = None
    decode_seconds: str | None = None

    def figures(self, before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float | None]:
        """The engine's figures between two readings: ``generated_tokens`` (how many it made) and
        ``decode_tok_s`` (its mean per-stream decode speed); None where a counter is missing."""

        def delta(name: str | None) -> float | None:
            if name is None or name not in after:
                return None
            return after[name] - before.get(name, 0.0)

        tokens, timed, seconds = delta(self.generated_tokens), delta(self.decode_tokens), delta(self.decode_seconds)
        return {"generated_tokens": tokens, "decode_tok_s": timed / seconds if timed is not None and seconds else None}


def disagreements(
    server: Mapping[str, float | None], client: Mapping[str, float | None], tol: float = DISAGREEMENT_TOL
) -> list[str]:
    """One line per figure that both sides have and that differs by more than ``tol``."""
    out = []
    for key, theirs in server.items():
        ours = client.get(key)
        if theirs is None or ours is None or not ours:
            continue
        rel = theirs / ours - 1
        if abs(rel) > tol:
            out.append(
                f"{key}: the engine says {theirs:.4g}, the client measured {ours:.4g} ({rel:+.0%}); "
                "the client's figure is the one scored"
            )
    return out
