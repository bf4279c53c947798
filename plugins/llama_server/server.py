"""One running ``llama-server``: its process, address, log, the cores it runs on, and what its
start-up log says (buffer sizes, offloaded layers, the reason for a failure).

The backend (:mod:`~autotune_plugins.llama_server.backend`) builds the command and measures;
this module holds what belongs to the process and the machine it runs on.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx

from autotune.api import BackendError
from autotune._builtin import EngineUnavailableError
from autotune._builtin import read_log, server_url, tail
from autotune_plugins.shared.engine_log import DEBUGGER_LINE

__all__ = [
    "BUILD_REMEDY",
    "CpuPlan",
    "Pinned",
    "Server",
    "engine_reason",
    "median",
    "parse_log",
    "plan_cpus",
    "process_cpu_s",
]

BUILD_REMEDY = "run `autotune engine build llama.cpp` (it builds for this machine's GPU, or the CPU without one)"


# ------------------------------------------------------------------------------ the engine's log

_BUFFER_RX = {
    "model_buffer_mib": re.compile(r"(\S+) model buffer size\s*=\s*([\d.]+) MiB"),
    "kv_buffer_mib": re.compile(r"(\S+) KV buffer size\s*=\s*([\d.]+) MiB"),
    "compute_buffer_mib": re.compile(r"(\S+) compute buffer size\s*=\s*([\d.]+) MiB"),
}
_OFFLOAD_RX = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_KV_CELLS_RX = re.compile(r"llama_kv_cache: size\s*=.*?\(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\)")


def parse_log(text: str) -> dict[str, Any]:
    """Buffer sizes by device (MiB) and the offloaded layers, as llama.cpp logs them at start."""
    out: dict[str, Any] = {}
    for key, rx in _BUFFER_RX.items():
        found: dict[str, float] = {}
        for dev, mib in rx.findall(text):
            found[dev] = found.get(dev, 0.0) + float(mib)
        if found:
            out[key] = found
    m = _OFFLOAD_RX.search(text)
    if m:
        on_gpu, total = int(m.group(1)), int(m.group(2))
        out["offloaded_layers"] = on_gpu
        out["total_layers"] = total
        out["spilled"] = on_gpu < total
    m = _KV_CELLS_RX.search(text)
    if m:
        # cells per sequence stream x streams: the cache's real capacity
        out["kv_cells"] = int(m.group(1)) * int(m.group(4))
    return out


_REASON_RX = re.compile(
    r"(out of memory|failed to allocate|unsupported cache type|does not divide|no such file|"
    r"failed to open|failed to load|invalid argument|error:|unknown value|not supported|"
    r"requires|requested)",
    re.IGNORECASE,
)


# ggml's own failure line: "ggml.c:1234: GGML_ASSERT(cond) failed", GGML_ABORT's message, a C++
# exception's what(). The most specific words there are: said first.
_ASSERT_RX = re.compile(r"GGML_ASSERT|GGML_ABORT|: fatal error|terminate called|what\(\):")


def engine_reason(log_text: str) -> str:
    """The engine's own words for a failure: its error lines, most specific first (an
    assertion's own line before any other), never a debugger's backtrace."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not DEBUGGER_LINE.search(ln)]
    asserted = [ln for ln in lines if _ASSERT_RX.search(ln)]
    errors = [ln for ln in lines if ln not in asserted and (re.search(r"\s E\s", f" {ln} ") or _REASON_RX.search(ln))]
    pick = (asserted + errors)[:3] if asserted or errors else lines[-3:]
    return " | ".join(pick)[:800] or "no output"


# ------------------------------------------------------------------------------ the process


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used so far, from /proc (None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass(frozen=True)
class CpuPlan:
    """Which cores the engine and autotune's load generator run on, and why.

    ``engine``/``client`` are None when nothing is pinned; ``note`` says what was done or why not.
    """

    engine: tuple[int, ...] | None
    client: tuple[int, ...] | None
    note: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "pinned": self.engine is not None,
            "engine_cores": list(self.engine or ()),
            "client_cores": list(self.client or ()),
            "note": self.note,
        }


def plan_cpus(threads: int, enabled: bool, allowed: Sequence[int] | None = None) -> CpuPlan:
    """Keep the load generator off the engine's cores when the machine has cores to spare.

    The engine gets the last ``threads`` of the cores autotune may use, the client the rest.
    SMT siblings are not told apart: two logical CPUs of one core count as two cores.
    """
    if not enabled:
        return CpuPlan(None, None, "not pinned: [backends.llama-server] pin_cores = false")
    if allowed is None:
        if not hasattr(os, "sched_getaffinity"):
            return CpuPlan(None, None, "not pinned: CPU affinity is not available on this platform")
        allowed = sorted(os.sched_getaffinity(0))
    allowed = sorted(allowed)
    if len(allowed) <= threads:
        return CpuPlan(
            None,
            None,
            f"not pinned: {len(allowed)} cores and -t {threads} engine threads leave no "
            "core for the load generator, which shares the engine's cores",
        )
    engine_cores, client_cores = tuple(allowed[-threads:]), tuple(allowed[:-threads])
    return CpuPlan(
        engine_cores,
        client_cores,
        f"llama-server pinned to cores {list(engine_cores)}, the load generator to {list(client_cores)}",
    )


class Pinned:
    """Run the calling thread on ``cores`` for a while (threads and processes it starts inherit
    the mask), then give it its old mask back."""

    def __init__(self, cores: Sequence[int] | None):
        self.cores = cores
        self.saved: set[int] | None = None
        self.error: str | None = None

    def __enter__(self) -> "Pinned":
        if self.cores:
            saved = os.sched_getaffinity(0)
            try:
                os.sched_setaffinity(0, self.cores)
            except OSError as exc:  # e.g. a cpuset that changed since the plan: run unpinned, say so
                self.error = f"not pinned: setting the affinity to {list(self.cores)} failed ({exc})"
            else:
                self.saved = saved
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.saved is not None:
            os.sched_setaffinity(0, self.saved)


class Server:
    """One running llama-server: its process, address, log and the cores it runs on."""

    def __init__(
        self,
        proc: subprocess.Popen,
        port: int,
        log_path: Path,
        cmd: list[str],
        *,
        host: str = "127.0.0.1",
        cpus: CpuPlan | None = None,
    ):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.cmd = cmd
        self.cpus = cpus or CpuPlan(None, None, "not pinned")
        self.url = server_url(host, port)
        # A local server: never through a proxy the environment names. No pool limit, so
        # ``parallel`` streams each get their connection at once. No keep-alive: llama-server
        # closes idle connections on its own schedule, and httpx (unlike urllib3) does not
        # check a pooled connection before reusing it, so a reused one failed trials with
        # "Server disconnected without sending a response"; a new loopback connection per
        # request costs well under a millisecond.
        self.http = httpx.Client(
            trust_env=False, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0)
        )

    def log(self) -> str:
        return read_log(self.log_path)

    def failure(self, what: str) -> BackendError:
        text = self.log()
        rc = self.proc.poll()
        status = f"exited with code {rc}" if rc is not None else "is running"
        message = f"llama-server {status}: {what}: {engine_reason(text)}"
        # Causes in the binary itself fail every configuration: the study must stop, not go on.
        if rc in (126, 127) or "error while loading shared libraries" in text:
            return EngineUnavailableError(
                f"{message}. The engine binary cannot run here: {BUILD_REMEDY}", log_tail=tail(text)
            )
        if rc == -signal.SIGILL:
            return EngineUnavailableError(
                f"{message}. The build uses CPU instructions this machine lacks: "
                "rebuild it here with `autotune engine build llama.cpp --force`",
                log_tail=tail(text),
            )
        return BackendError(message, log_tail=tail(text))

    def close(self) -> None:
        self.http.close()
