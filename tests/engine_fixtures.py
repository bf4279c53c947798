"""Finding the llama.cpp engine from tests: skip on a developer's machine without a build,
fail in CI, where `.ci/run` builds it first and sets AUTOTUNE_REQUIRE_ENGINE=1.

A missing build must never turn CI's engine tests into silent skips.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping, NoReturn

import pytest

from autotune.errors import AutotuneError


def engine_required() -> bool:
    return os.environ.get("AUTOTUNE_REQUIRE_ENGINE") == "1"


def missing(what: str) -> NoReturn:
    """Skip (developer machine) or fail (CI) because ``what`` is missing."""
    message = f"{what}: run `autotune engine build llama.cpp --cpu --python` first"
    if engine_required():
        pytest.fail(f"AUTOTUNE_REQUIRE_ENGINE=1 but {message}", pytrace=False)
    pytest.skip(message)


def llama_server_binary() -> Path:
    from autotune_plugins.llama_server import engine

    try:
        return engine.find_llama_server({})
    except AutotuneError as exc:
        missing(f"no llama-server ({exc})")


def cpu_build() -> Any:
    """The CPU build (runs anywhere), else any complete build."""
    from autotune_plugins.llama_server import engine

    builds = engine.built_engines()
    if not builds:
        missing("no llama.cpp build")
    return next((b for b in builds if b.manifest.get("arch") == "cpu"), builds[0])


def llama_cpp_module() -> Any:
    """llama-cpp-python, loading the engine build's libllama."""
    from autotune_plugins.llama_server import engine

    try:
        return engine.import_llama_cpp({})
    except AutotuneError as exc:
        missing(str(exc))


FAKE_ENGINE = '''#!{python}
"""A stand-in for {name}: records how it was started, answers --version, then exits."""
import json, os, sys
if "--version" in sys.argv:
    print("version: 1 (fake000)", file=sys.stderr)
    sys.exit(0)
with open(sys.argv[0] + ".calls.jsonl", "a") as f:
    f.write(json.dumps({{"argv": sys.argv, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}})
            + "\\n")
sys.exit({exit_code})
'''


def fake_engine(directory: Path, name: str = "llama-server", exit_code: int = 1) -> Path:
    """An executable named ``name`` in ``directory`` that records each start (argv,
    CUDA_VISIBLE_DEVICES, CPU affinity) and exits with ``exit_code``; read them with
    :func:`fake_engine_calls`. Its ``--version`` prints a llama.cpp-style version line."""
    import sys

    path = Path(directory) / name
    path.write_text(FAKE_ENGINE.format(python=sys.executable, name=name, exit_code=exit_code), encoding="utf-8")
    path.chmod(0o755)
    return path


def fake_engine_calls(path: Path) -> list[dict[str, Any]]:
    """The starts a :func:`fake_engine` recorded, oldest first."""
    import json

    log = Path(str(path) + ".calls.jsonl")
    if not log.is_file():
        return []
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]


KEEPALIVE_ENGINE = '''#!{python}
"""A stand-in for an engine that answers /health and then never finishes a completion: it sends
an SSE comment every 0.2 s for as long as the client stays (what kept trials running forever)."""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
if "--version" in sys.argv:
    print("version: 1 (fake000)", file=sys.stderr)
    sys.exit(0)

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.answer({{"data": [{{"id": "fake"}}]}} if self.path.startswith("/v1/models") else {{"status": "ok"}})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if "tokenize" in self.path:
            return self.answer({{"tokens": list(range(1, 17))}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            while True:
                self.wfile.write(b": keepalive\\n\\n")
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass

port = int(sys.argv[sys.argv.index("--port") + 1])
ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def keepalive_engine(directory: Path, name: str = "llama-server") -> Path:
    """An executable named ``name`` in ``directory``: a server on ``--port`` that answers
    ``/health``, ``/v1/models`` and ``/tokenize``, and answers every other POST with an event
    stream of SSE comments that never ends."""
    import sys

    path = Path(directory) / name
    path.write_text(KEEPALIVE_ENGINE.format(python=sys.executable), encoding="utf-8")
    path.chmod(0o755)
    return path


STORIES = Path(__file__).resolve().parent / "data" / "stories260K.gguf"


def write_llama_study(path: Path, *, space: str = "", extra: str = "", study: str = "", parallel: str = "[1]") -> Path:
    """A llama-server study file over the shipped stories260K on the catalog T4 (a budget
    only: on a machine without a GPU the server runs on the CPU)."""
    path.write_text(
        f"""[study]
name = "{path.stem}"
{study}

[hardware]
gpu = "t4"

[model]
ref = "{STORIES}"

[workload]
prompt_tokens = 16
output_tokens = 16

[[candidates]]
backend = "llama-server"
weights = ["{STORIES}"]

[space]
ctx = [256]
parallel = {parallel}
{space}

{extra}
""",
        encoding="utf-8",
    )
    return path


class RecordedRequests:
    """Every streamed request a backend sends (``post_events``, which both request paths use):
    its body, the server's own count of the prompt and output tokens it processed for it (the
    final event's ``timings`` on llama-server's /completion, ``usage`` on /v1/completions), and
    how many were open at once. Put in place of a module's ``post_events`` (monkeypatch): a
    check that two launches got the same load, where their speeds are only printed."""

    def __init__(self, original: Any):
        self.original, self.sent, self.open, self.most_open = original, [], 0, 0
        self.lock = threading.Lock()

    def __call__(self, http: Any, url: str, body: Mapping[str, Any], *args: Any, **kwargs: Any) -> Iterator[str]:
        counted: dict[str, Any] = {"body": dict(body)}
        self.sent.append(counted)
        events = self.original(http, url, body, *args, **kwargs)

        def read() -> Iterator[str]:
            with self.lock:
                self.open += 1
                self.most_open = max(self.most_open, self.open)
            try:
                for payload in events:
                    event = json.loads(payload) if payload.strip().startswith("{") else {}
                    if event.get("timings"):
                        counted.update(prompt=event["timings"].get("prompt_n"), output=event["timings"]["predicted_n"])
                    if event.get("usage"):
                        counted.update(
                            prompt=event["usage"]["prompt_tokens"], output=event["usage"]["completion_tokens"]
                        )
                    yield payload
            finally:
                events.close()
                with self.lock:
                    self.open -= 1

        return read()

    def counts(self) -> set[tuple[Any, Any]]:
        return {(r.get("prompt"), r.get("output")) for r in self.sent}
