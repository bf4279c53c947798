"""Nothing hangs: an engine that keeps a stream open without finishing (an SSE comment every
0.2 s, so no read ever times out) ends at the request's total deadline through every serving
backend, and at the study's budget when that comes first; the study goes on.

Each call runs in a thread that the test waits for with a generous limit, so a regression fails
instead of hanging the suite; no figure here depends on the machine's load.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from autotune.toolkit import processes
from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.errors import BackendError
from autotune.hardware.gpus import get_gpu
from autotune.measure.local_server import free_port, wait_ready
from autotune.measure import DeadlineExceeded, Protocol, run_streams_threaded, within
from autotune.measure.openai_api import stream_completion
from autotune.modelfiles.models import model_from_gguf
from tests.engine_fixtures import STORIES, keepalive_engine

from autotune_plugins.llama_server.backend import LlamaServerBackend
from autotune_plugins.openai_server.backend import OpenAIServerBackend

LIMIT_S = 60  # far beyond the one-second deadlines below: only a hang reaches it


def outcome(fn: Callable[[], Any]) -> BaseException | None:
    """What ``fn`` raised (None: it returned), failing the test if it is still running at LIMIT_S."""
    box: list[BaseException | None] = [None]

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box[0] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    assert not thread.is_alive(), f"still running after {LIMIT_S} s: the deadline did not end it"
    return box[0]


def ctx_for(base: Path, **settings: Any) -> StudyContext:
    return StudyContext(
        gpu=get_gpu("t4"),
        model=model_from_gguf(STORIES),
        workload=Workload(16, 8),
        vram_budget_bytes=14 * 2**30,
        protocol=Protocol(warmup_runs=1, min_runs=1, max_runs=1),
        settings={"startup_timeout_s": 30, **settings},
        base_dir=base,
        for_gpu=False,
    )


@pytest.fixture
def weights(tmp_path) -> Path:
    shutil.copy(STORIES, tmp_path / "m.gguf")
    return tmp_path / "m.gguf"


@pytest.mark.parametrize("backend", ["llama-server", "openai-server"])
def test_a_stream_kept_open_fails_the_trial_at_request_timeout_s(tmp_path, weights, monkeypatch, backend):
    monkeypatch.setattr("autotune_plugins.llama_server.backend._has_gpu", lambda: False)
    fake = keepalive_engine(tmp_path)
    if backend == "llama-server":
        b: Any = LlamaServerBackend()
        ctx = ctx_for(tmp_path, binary=str(fake), threads=1, request_timeout_s=1)
    else:
        b = OpenAIServerBackend()
        ctx = ctx_for(tmp_path, template="llama-server", executable=str(fake), request_timeout_s=1)
    config = TrialConfig(backend, weights.name, 256, 1, ())
    exc = outcome(lambda: b.run(config, ctx))
    assert isinstance(exc, BackendError), exc
    assert "request exceeded 1 s total (request_timeout_s)" in str(exc)
    assert "kept the stream open without finishing" in str(exc)
    assert not processes.live()


@pytest.fixture
def keepalive_url(tmp_path):
    port = free_port()
    proc = processes.start([str(keepalive_engine(tmp_path)), "--port", str(port)])
    try:
        with httpx.Client() as http:
            wait_ready(proc, http, f"http://127.0.0.1:{port}/health", 30, BackendError)
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        processes.stop(proc)


def test_an_outer_deadline_ends_the_streams_of_every_thread(keepalive_url):
    """The study's budget (an outer deadline, set where the runner sets it) reaches the stream
    threads, whose own request_timeout_s is far off."""

    def streams() -> None:
        with httpx.Client() as http, within(time.monotonic() + 1, "the study's budget (1 s) ran out"):
            run_streams_threaded(
                lambda j: stream_completion(http, keepalive_url, {"prompt": "x"}, 1, 600).result, 2, 600
            )

    exc = outcome(streams)
    assert isinstance(exc, DeadlineExceeded), exc
    assert str(exc).startswith("the study's budget (1 s) ran out; the engine kept the stream open")


def test_an_enclosing_earlier_deadline_is_not_extended(keepalive_url):
    def request() -> None:
        with httpx.Client() as http, within(time.monotonic() + 1, "outer"), within(time.monotonic() + 900, "inner"):
            stream_completion(http, keepalive_url, {"prompt": "x"}, 1, 600)

    exc = outcome(request)
    assert isinstance(exc, DeadlineExceeded) and str(exc).startswith("outer;"), exc


def study_over(tmp_path: Path, timeout_s: float) -> Any:
    from autotune.config import load_study_config
    from tests.engine_fixtures import write_llama_study

    fake = keepalive_engine(tmp_path)
    path = write_llama_study(
        tmp_path / "keepalive.toml",
        parallel="[1, 2]",
        study="baseline = false\nfinish_top = 0",
        extra=f'[backends.llama-server]\nbinary = "{fake}"\nthreads = 1\n'
        f"request_timeout_s = {timeout_s}\nstartup_timeout_s = 30",
    )
    return load_study_config(path)


@pytest.fixture
def llama_plugin():
    import autotune_plugins.llama_server as llama_server
    from tests.conftest import plugin_registered

    with plugin_registered(llama_server, "llama_server"):
        yield


def test_the_study_goes_on_after_a_trial_cut_at_its_request_deadline(tmp_path, monkeypatch, llama_plugin):
    from autotune.study.runner import run_study

    monkeypatch.setattr("autotune_plugins.llama_server.backend._has_gpu", lambda: False)
    events: list[Any] = []
    exc = outcome(
        lambda: run_study(
            study_over(tmp_path, 1), n_trials=2, storage=f"sqlite:///{tmp_path / 's.db'}", callback=events.append
        )
    )
    assert exc is None, exc
    assert [e.state for e in events] == ["FAIL", "FAIL"]  # both configurations launched, each cut
    assert all("request exceeded 1 s total (request_timeout_s)" in (e.reason or "") for e in events), events
    assert not processes.live()


def test_the_study_budget_ends_a_request_its_own_timeout_would_not(tmp_path, monkeypatch, llama_plugin):
    from autotune.study.runner import run_study

    monkeypatch.setattr("autotune_plugins.llama_server.backend._has_gpu", lambda: False)
    events: list[Any] = []
    exc = outcome(
        lambda: run_study(
            study_over(tmp_path, 600), budget_s=2, storage=f"sqlite:///{tmp_path / 's.db'}", callback=events.append
        )
    )
    assert exc is None, exc
    assert [e.state for e in events] == ["FAIL"]  # no launch fits in what is left: the study ends
    assert "the study's budget (2 s) ran out" in (events[0].reason or ""), events
    assert not processes.live()


def test_a_hanging_version_probe_is_ended_with_its_children(tmp_path):
    """A --version that never answers, whose child holds its output pipe: the probe ends at its
    timeout and the child with it (subprocess.run killed the probe alone, then waited for the pipe)."""
    from autotune_plugins.llama_server.builds import EngineNotFoundError, engine_version
    from tests.test_processes import gone

    pidfile = tmp_path / "child.pid"
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!/bin/sh\nsleep 120 &\necho $! > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}\nwait\n")
    fake.chmod(0o755)
    exc = outcome(lambda: engine_version(fake, timeout_s=1))
    assert isinstance(exc, EngineNotFoundError) and "no answer after 1s" in str(exc), exc
    assert gone(int(pidfile.read_text()))


TRICKLE = b'{"tokens": [1, 2, 3]}'


@pytest.fixture
def trickle_url():
    """A server whose answers are complete JSON but arrive a byte every 0.1 s, each for
    ``?repeat=N`` times over (``/fast`` answers at once, gzipped): no read ever times out."""
    import gzip
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/fast":
                data = gzip.compress(TRICKLE)
                self.send_response(200)
                self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            body = TRICKLE * 1000
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for i in range(len(body)):
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_an_answer_trickled_a_byte_at_a_time_ends_at_its_total_deadline(trickle_url):
    """/health, /tokenize, /metrics and the model list are not streams, but an engine can
    trickle them too: fetch bounds the whole answer as post_events bounds a stream."""
    from autotune.measure.streams import fetch

    with httpx.Client() as http:
        exc = outcome(lambda: fetch(http, "GET", f"{trickle_url}/slow", 1, setting="tokenize"))
        assert isinstance(exc, DeadlineExceeded), exc
        assert str(exc).startswith("request exceeded 1 s total (tokenize)"), str(exc)
        # A whole answer comes back as the client would have read it, decoded.
        r = fetch(http, "GET", f"{trickle_url}/fast", 5)
        assert (r.status_code, r.json()) == (200, {"tokens": [1, 2, 3]})
