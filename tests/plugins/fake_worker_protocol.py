"""The protocol loop both fake exllama workers run (``exllamav2_fake_worker.py``,
``exllamav3_fake_worker.py``): hello, then one JSON line per request until ``exit``.

Each fake says only how it answers ``load`` and ``sample`` (a reply without its ``id``,
``ok`` included), and may fail there as a real worker would (exit, hang, SIGKILL); other
operations (a scorer's) may be answered by handlers as the real protocol takes them.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Mapping


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve(
    requests_log: str,
    load: Callable[[dict], dict],
    sample: Callable[[dict, int], dict],
    more: Mapping[str, Callable[[dict], Mapping[str, Any]]] | None = None,
) -> None:
    """Answer the parent until it says ``exit``; with the environment variable ``requests_log``
    set, every request is appended to that file as a JSON line, so tests see what was sent.

    Args:
        requests_log: The variable's name.
        load: The ``load`` request -> the reply.
        sample: The ``sample`` request and how many samples so far (this one included) -> the reply.
        more: Other operations -> the reply's fields (``ok`` added); an exception is a failed
            request, as the real worker answers it.
    """
    send({"event": "hello", "protocol": 2, "pid": os.getpid(), "python": "3"})
    samples = 0
    for line in sys.stdin:
        req = json.loads(line)
        if os.environ.get(requests_log):
            with open(os.environ[requests_log], "a") as log:
                log.write(json.dumps(req) + "\n")
        op = req["op"]
        if op == "exit":
            send({"id": req["id"], "ok": True})
            break
        if op == "load":
            send({"id": req["id"], **load(req)})
        elif op == "sample":
            samples += 1
            send({"id": req["id"], **sample(req, samples)})
        elif more and op in more:
            try:
                send({"id": req["id"], "ok": True, **more[op](req)})
            except Exception as exc:  # noqa: BLE001 - answered as the real protocol answers it
                send({"id": req["id"], "ok": False, "type": type(exc).__name__, "error": str(exc)})
        else:
            send({"id": req["id"], "ok": False, "type": "ProtocolError", "error": f"unknown op {op}"})
