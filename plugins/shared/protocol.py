"""The worker protocol: JSON lines between autotune and one ExLlamaV2 worker process.

The parent writes one request a line on the worker's stdin; the worker answers each on its
protocol stream (its original stdout; everything the engine prints goes to stderr, so a stray
``print`` cannot corrupt the stream). Before importing anything heavy the worker announces
itself, so a worker that cannot even start is told apart from one that hangs while loading::

    worker -> {"event": "hello", "protocol": 2, "pid": 1234, "python": "3.12.3"}
    parent -> {"id": 1, "op": "load", "model_dir": "...", "settings": {"cache_type": "q8", ...}, "purpose": "measure"}
    worker -> {"id": 1, "ok": true, "settings": {...}, "attention": {...}, "engine_version": "0.3.2"}
    parent -> {"id": 2, "op": "sample", "prompt_tokens": 512, "output_tokens": 128}
    worker -> {"id": 2, "ok": true, "metrics": {"decode_tok_s": ..., ...}, "streams": [...]}
    parent -> {"id": 3, "op": "exit"}
    worker -> {"id": 3, "ok": true}

``load`` carries the whole generator the parent chose (``GeneratorSettings.to_dict()``, what the
deploy line serves); the worker builds exactly that or fails, and answers with what it built.

A failed request is answered ``{"id": n, "ok": false, "error": "...", "type": "...",
"traceback": "..."}`` and the worker keeps serving; the parent decides whether the trial ends.

Operations: ``load``, ``sample`` (one run of the measurement: a single stream, then
``parallel`` streams together), ``tokenize``, ``loglikelihood``, ``next_token_logprobs``
(the scoring API), ``exit``.
"""

from __future__ import annotations

import json
import traceback
from typing import Any, Callable, IO, Mapping

from autotune.api import AutotuneError

__all__ = ["OPS", "PROTOCOL_VERSION", "ProtocolError", "decode", "encode", "error_reply", "serve"]

PROTOCOL_VERSION = 2  # 2: load carries the generator settings, chosen by the parent
OPS = ("load", "sample", "tokenize", "loglikelihood", "next_token_logprobs", "exit")


class ProtocolError(AutotuneError):
    """A line that is not a protocol message."""


def encode(message: Mapping[str, Any]) -> bytes:
    """One message as a JSON line (NaN/inf refused: the other side could not parse them)."""
    return (json.dumps(message, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")


def decode(line: bytes | str) -> dict[str, Any]:
    """Parse one line into a message object.

    Raises:
        ProtocolError: Not JSON, or not an object; the message quotes the start of the line.
    """
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    try:
        message = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"not a protocol line ({exc.msg}): {text[:200]!r}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a protocol line must be a JSON object, got: {text[:200]!r}")
    return message


def error_reply(request_id: Any, exc: BaseException) -> dict[str, Any]:
    return {
        "id": request_id,
        "ok": False,
        "error": str(exc) or type(exc).__name__,
        "type": type(exc).__name__,
        "traceback": "".join(traceback.format_exception(exc))[-4000:],
    }


def serve(
    handlers: Mapping[str, Callable[[dict[str, Any]], Mapping[str, Any] | None]], inp: IO[bytes], out: IO[bytes]
) -> int:
    """The worker's loop: answer each request line with its handler's result, until ``exit``.

    Args:
        handlers: Operation name -> function of the request returning the reply's fields.
        inp: Where requests come from (stdin); its end (the parent died) ends the loop.
        out: The protocol stream.

    Returns:
        0 after ``exit``, 1 when the input ended without one.
    """
    for line in inp:
        if not line.strip():
            continue
        request_id = None
        try:
            request = decode(line)
            request_id = request.get("id")
            op = request.get("op")
            if op == "exit":
                out.write(encode({"id": request_id, "ok": True}))
                out.flush()
                return 0
            if op not in handlers:
                raise ProtocolError(f"unknown op {op!r} (this worker serves: {', '.join(sorted(handlers))}, exit)")
            # Encoded inside the try: a result JSON cannot carry (NaN) is a failed request too.
            data = encode({"id": request_id, "ok": True, **(handlers[op](request) or {})})
        except Exception as exc:  # noqa: BLE001 - every failure is an answer, never a dead worker
            data = encode(error_reply(request_id, exc))
        out.write(data)
        out.flush()
    return 1
