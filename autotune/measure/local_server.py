"""An engine that serves HTTP on this machine: a free port, its address, its log's tail, readiness.

Every backend that launches a server (llama-server, any OpenAI-compatible server) needs the same
few things around :mod:`autotune.toolkit.processes` (which owns the process's lifetime): a port nobody
holds, the URL autotune's client reaches it at, a wait until it answers its health path, and
the last lines of its log for an error message.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx

from autotune.errors import BackendError
from autotune.measure.deadline import DeadlineExceeded, passed
from autotune.measure.streams import fetch

__all__ = ["connect_host", "free_port", "loopback", "port_free", "server_url", "tail", "wait_ready"]


def loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only."""
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def connect_host(host: str) -> str:
    """Where autotune's client reaches a server bound to ``host`` (a wildcard: the loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host in ("::", "[::]"):
        return "::1"
    return host


def server_url(host: str, port: int) -> str:
    """``http://host:port`` of a server bound to ``host``, IPv6 addresses bracketed."""
    h = connect_host(host)
    return f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}"


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (trials never use the deploy port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(20):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port_free(port, host):
            return port
    raise BackendError(f"no free TCP port on {host} for the engine's server")


def read_log(path: Path) -> str:
    """A server's log as far as it is written ("" when it cannot be read: the error at hand matters more)."""
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def tail(text: str, n: int = 40) -> str:
    """The last ``n`` lines of a log: what an error message carries of the engine's own words."""
    return "\n".join(text.splitlines()[-n:])


def wait_ready(
    proc: subprocess.Popen, http: httpx.Client, url: str, timeout_s: float, failure: Callable[[str], BackendError]
) -> None:
    """Poll ``url`` until it answers 200, the process exits, or ``timeout_s`` passes.

    Args:
        proc: The server's process; its exit ends the wait at once.
        http: The client to poll with.
        url: The health URL (``/health``, ``/v1/models``...).
        timeout_s: Bound on the model's loading.
        failure: Builds the error (with the engine's log) from what went wrong.

    Raises:
        BackendError: From ``failure``: the server exited, or was not ready in time.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise failure("failed to start")
        outer = passed()
        if outer is not None:  # the study's budget ran out while it loaded: not "not ready after 60 s"
            raise failure(f"{outer.reason} while it loaded")
        try:
            if fetch(http, "GET", url, 2, setting="health check").status_code == 200:
                return
        except (httpx.HTTPError, DeadlineExceeded):
            pass  # not listening yet, or answering too slowly: the model is still loading
        time.sleep(0.1)
    raise failure(f"not ready after {timeout_s:.0f} s")
