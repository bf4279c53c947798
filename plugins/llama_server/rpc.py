"""llama.cpp's RPC backend as extra devices on one machine (issue 40 item 6).

``ggml-rpc-server -H 127.0.0.1 -p PORT`` serves its host's CPU as one ggml device; llama-server
given ``--rpc 127.0.0.1:P1,127.0.0.1:P2`` puts them ahead of its own devices (src/llama.cpp:
RPC servers first, then GPUs), so a study whose cards are ``["cpu", "cpu"]`` runs llama-server
across two real devices on a CPU-only machine: split mode, ``-ts`` and each device's buffers
as llama.cpp logs them, without a GPU. Each trial starts its own servers and stops them after
llama-server (a device keeps no state a later trial could inherit).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

from autotune._builtin import processes
from autotune.api import BackendError
from autotune._builtin import EngineUnavailableError
from autotune._builtin import free_port
from autotune_plugins.llama_server.llama_build import RPC_SERVER

__all__ = ["DEPLOY_PORT", "binary_beside", "endpoints_flag", "rpc_servers"]

HOST = "127.0.0.1"
DEPLOY_PORT = 50052  # rpc-server's own default port: the deploy line's first device


def binary_beside(server: Path) -> Path:
    """The rpc-server built with ``server`` (the same build: the RPC protocol is versioned)."""
    return server.parent / RPC_SERVER


def endpoints_flag(endpoints: list[str]) -> list[str]:
    return ["--rpc", ",".join(endpoints)] if endpoints else []


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


@contextlib.contextmanager
def rpc_servers(binary: Path, count: int, threads: int, log_dir: Path, timeout_s: float = 30.0) -> Iterator[list[str]]:
    """``count`` rpc-server processes on free ports of 127.0.0.1, listening; their endpoints.

    Raises:
        EngineUnavailableError: The build has no rpc-server (built before GGML_RPC was on).
        BackendError: One did not listen within ``timeout_s`` (its log's tail says why).
    """
    if count <= 0:
        yield []
        return
    if not binary.is_file():
        raise EngineUnavailableError(
            f"{binary}: no such file: this llama.cpp build has no RPC server (built before "
            "GGML_RPC); rebuild it with `autotune engine build llama.cpp --force`"
        )
    procs: list[tuple[subprocess.Popen, int, Path]] = []
    try:
        for i in range(count):
            port = free_port(HOST)
            log = log_dir / f"rpc-server-{i}.log"
            with open(log, "w") as out:
                procs.append(
                    (
                        processes.start(
                            [str(binary), "-H", HOST, "-p", str(port), "-t", str(max(1, threads))],
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                        ),
                        port,
                        log,
                    )
                )
        deadline = time.monotonic() + timeout_s
        for proc, port, log in procs:
            while not _listening(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    text = log.read_text(errors="replace")[-600:] if log.exists() else ""
                    raise BackendError(f"rpc-server on port {port} did not start: {text.strip() or 'no output'}")
                time.sleep(0.05)
        yield [f"{HOST}:{port}" for _, port, _ in procs]
    finally:
        for proc, _, _ in procs:
            processes.stop(proc)
