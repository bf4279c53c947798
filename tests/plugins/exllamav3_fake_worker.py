"""A stand-in for ``autotune_plugins.exllamav3.worker`` that speaks the real protocol.

Its behaviour comes from the first argument: ``ok`` (answers like a loaded engine),
``crash-on-load`` (prints a reason to stderr and exits 3), ``hang-on-load`` (never answers),
``other-settings`` (builds a smaller cache than asked for). With ``EXL3_FAKE_REQUESTS`` set,
every request is appended to that file as a JSON line, so tests see what the parent sent.
"""

from __future__ import annotations

import json
import os
import sys
import time

MODE = sys.argv[1]


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


send({"event": "hello", "protocol": 2, "pid": os.getpid(), "python": "3"})
samples = 0
for line in sys.stdin:
    req = json.loads(line)
    if os.environ.get("EXL3_FAKE_REQUESTS"):
        with open(os.environ["EXL3_FAKE_REQUESTS"], "a") as log:
            log.write(json.dumps(req) + "\n")
    op = req["op"]
    if op == "exit":
        send({"id": req["id"], "ok": True})
        break
    if op == "load":
        if MODE == "crash-on-load":
            print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB", file=sys.stderr, flush=True)
            sys.exit(3)
        if MODE == "hang-on-load":
            time.sleep(300)
        built = dict(req["settings"])
        if MODE == "other-settings":  # as a worker that cut the cache to one job's pages would
            built.update(cache_tokens=256)
        send({"id": req["id"], "ok": True, "engine_version": "1.6.5-fake", "settings": built,
              "attention": {"path": "exllamav3_paged"}, "load_s": 0.01})
    elif op == "sample":
        samples += 1
        send({"id": req["id"], "ok": True,
              "metrics": {"decode_tok_s": 120.0, "prefill_tok_s": 3000.0, "ttft_ms": 40.0,
                          "aggregate_tok_s": 400.0 + samples, "per_user_tok_s": 90.0},
              "streams": [], "max_allocated_bytes": 1, "max_reserved_bytes": 2})
    else:
        send({"id": req["id"], "ok": False, "type": "ProtocolError", "error": f"unknown op {op}"})
