"""A stand-in for ``autotune_plugins.exllamav2.worker`` that speaks the real protocol.

Its behaviour comes from the first argument, so tests can ask for each failure the parent
must survive: ``ok`` (answers like a loaded engine), ``crash-on-load`` (prints a reason to
stderr and exits 3), ``signal-on-sample`` (SIGKILLs itself mid-measurement), ``hang-on-load``
(never answers; its child ``sleep`` must die with its process group too), ``silent`` (never
says hello), ``noise`` (prints garbage on its protocol stream instead of a hello),
``other-settings`` (builds a generator other than the one asked for). With ``EXL2_FAKE_REQUESTS``
set, every request is appended to that file as a JSON line, so tests see what the parent sent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from fake_worker_protocol import serve  # this script's own directory is on sys.path

MODE = sys.argv[1]
PIDFILE = sys.argv[2] if len(sys.argv) > 2 else None

if PIDFILE:
    # The child sleeper shows whether the whole process group is killed, not just the leader.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(PIDFILE, "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")

if MODE == "silent":
    time.sleep(300)
if MODE == "noise":
    print("Loading extension... done", flush=True)
    time.sleep(300)


def load(req: dict) -> dict:
    if MODE == "crash-on-load":
        print("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr, flush=True)
        sys.exit(3)
    if MODE == "hang-on-load":
        time.sleep(300)
    built = dict(req["settings"])
    if MODE == "other-settings":  # as a worker that fell back to one sequence at a time would
        built.update(paged=False, cache_max_seq_len=built["max_seq_len"])
    return {
        "ok": True,
        "engine_version": "0.3.2-fake",
        "settings": built,
        "attention": {"path": "sdpa", "paged": built["paged"]},
        "load_s": 0.01,
    }


def sample(req: dict, samples: int) -> dict:
    if MODE == "signal-on-sample":
        print("Segmentation fault in kernel", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if MODE == "error-on-sample":
        return {"ok": False, "type": "AssertionError", "error": "Total sequence length exceeds cache size"}
    # What the real worker answers: the request alone and every stream, from which the
    # parent computes the metrics. Each stream decodes at 100 tok/s after a 50 ms first token;
    # the run's requests (a workload's lengths) or parallel copies of the one shape.
    lengths = req.get("requests") or [[req["prompt_tokens"], req["output_tokens"]]] * 2

    def stream(start, p, o):
        return {
            "prompt_tokens": p,
            "output_tokens": o,
            "ttft_ms": 50.0,
            "decode_tok_s": 100.0,
            "prefill_tok_s": p / 0.05,
            "start_s": start,
            "end_s": start + 0.05 + (o - 1) / 100.0,
        }

    t = 10.0 * samples
    return {
        "ok": True,
        "metrics": {},
        "single": stream(t, req["prompt_tokens"], req["output_tokens"]),
        "streams": [stream(t + 0.01 * k, p, o) for k, (p, o) in enumerate(lengths)],
        "max_allocated_bytes": 1,
        "max_reserved_bytes": 2,
        "requests_seen": len(lengths),
    }


serve("EXL2_FAKE_REQUESTS", load, sample)
