"""One running OpenAI-compatible server: started from a rendered template, its log, its address.

Its lifetime belongs to :mod:`autotune.toolkit.processes` (its own session, dies with autotune, stopped in
a ``finally``); this module adds what an HTTP engine has: the client, readiness, the model name
it serves, and a failure message that carries the server's own log tail.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import httpx

from autotune._builtin import processes
from autotune.api import BackendError, MeasurementError
from autotune._builtin import EngineUnavailableError, engine_environment, fetch
from autotune._builtin import read_log, server_url, tail, wait_ready
from autotune_plugins.shared.engine_log import DEBUGGER_LINE

__all__ = ["OpenAIServer"]


class OpenAIServer:
    """A server process started from ``argv``; use as a context manager (stops it on exit).

    Args:
        argv: The rendered command.
        host, port: Where it listens.
        env: Its environment.
        label: The template's name, for messages.
        api_key: Sent as ``Authorization: Bearer`` with every request (``api_key_env``).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        host: str,
        port: int,
        env: Mapping[str, str],
        label: str,
        api_key: str | None = None,
    ):
        self.argv = list(argv)
        self.label = label
        self.url = server_url(host, port)
        self._tmp = tempfile.TemporaryDirectory(prefix="autotune-openai-server-")
        self.log_path = Path(self._tmp.name) / "server.log"
        # A local server: no proxy from the environment, no pool limit (every stream gets its
        # connection at once), no keep-alive (a server closing idle connections on its own
        # schedule failed pooled requests: see the llama-server plugin's Server).
        # api_key: a server started with one answers 401 to every request without it; it is held
        # here only, as the header of every request, never stored nor printed.
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = httpx.Client(
            trust_env=False, headers=headers, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0)
        )
        with open(self.log_path, "w") as log:
            try:
                self.proc = processes.start(
                    self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env)
                )
            except OSError as exc:
                self.close()
                raise EngineUnavailableError(
                    f"template {label}: {self.argv[0]} cannot be started ({exc}); set "
                    "[backends.openai-server] executable or command to the engine's "
                    "executable"
                ) from exc

    def log(self) -> str:
        return read_log(self.log_path)

    def failure(self, what: str) -> BackendError:
        """The error for ``what`` went wrong, with the server's exit status and its log's tail."""
        text = self.log()
        rc = self.proc.poll()
        status = f"exited with code {rc}" if rc is not None else "is running"
        # A debugger's backtrace (ggml's crash handler runs gdb) is not the engine's words.
        last = [ln.strip() for ln in text.splitlines() if ln.strip() and not DEBUGGER_LINE.search(ln.strip())][-3:]
        message = f"{self.label} server {status}: {what}: {' | '.join(last) or 'no output'}"
        if rc in (126, 127):  # the shell's "cannot execute" / "not found": every trial would fail
            return EngineUnavailableError(f"{message}. The engine cannot run here", log_tail=tail(text))
        return BackendError(message, log_tail=tail(text))

    def wait_ready(self, path: str, timeout_s: float) -> None:
        wait_ready(self.proc, self.http, f"{self.url}{path}", timeout_s, self.failure)

    def served_model(self) -> str | None:
        """The model name ``/v1/models`` lists first (vLLM and SGLang want it in each request)."""
        try:
            r = fetch(self.http, "GET", f"{self.url}/v1/models", 10, setting="the model list")
            data = r.json().get("data") or []
            return str(data[0]["id"]) if r.status_code == 200 and data else None
        except (httpx.HTTPError, MeasurementError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def post(self, path: str, body: Mapping[str, Any], timeout_s: float) -> Any:
        r = fetch(self.http, "POST", f"{self.url}{path}", timeout_s, setting=path, json=dict(body))
        if r.status_code != 200:
            raise self.failure(f"HTTP {r.status_code} from {path}: {r.text[:300]}")
        return r.json()

    def close(self) -> None:
        proc = getattr(self, "proc", None)
        self.http.close()  # our streams first: a server may finish the requests it holds before exiting
        try:
            if proc is not None:
                processes.stop(proc)
        finally:
            self._tmp.cleanup()

    def __enter__(self) -> "OpenAIServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def environment(cuda_devices: str | None, declared: Sequence[str] = ()) -> dict[str, str]:
        """The server's environment: the allow-list and ``declared`` (``engine_environment``),
        the study's card as ``CUDA_VISIBLE_DEVICES``."""
        env = engine_environment(declared)
        if cuda_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda_devices
        return env
