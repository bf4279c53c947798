"""The parent's side of one worker: start it, ask it things with a timeout, always end it.

A worker runs in its own session (process group) and gets SIGKILL from the kernel when
autotune dies (``PR_SET_PDEATHSIG``, as llama-server does). A worker that exits (a crash, a
signal such as the OOM killer's) or stays silent past a phase's timeout ends the trial with a
:class:`~autotune.errors.BackendError` carrying the reason and the tail of its stderr, and its
whole process group is killed, also on ``atexit`` and on SIGTERM to autotune.
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from autotune._builtin import processes
from autotune.api import BackendError

from autotune_plugins.shared.protocol import PROTOCOL_VERSION, ProtocolError, decode, encode

__all__ = ["WorkerProcess", "default_worker_command"]

_EOF = object()


def default_worker_command(python: str | None, module: str) -> list[str]:
    """``python -m MODULE`` (the engine's worker) with autotune's interpreter by default."""
    return [python or sys.executable, "-u", "-m", module]


def _tail(path: Path, n_lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-n_lines:])


def _exit_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


class WorkerProcess:
    """One running worker: its process, its protocol stream and its stderr log.

    Args:
        command: The worker's command line (tests pass fake workers).
        log_path: File that receives the worker's stderr.
        env: Its environment (default: ours).
        name: What to call it in messages.
    """

    def __init__(
        self, command: Sequence[str], log_path: Path, env: dict[str, str] | None = None, name: str = "engine worker"
    ):
        self.command = list(command)
        self.log_path = Path(log_path)
        self.env = env
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.hello: dict[str, Any] = {}
        self._replies: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        self._stray: list[str] = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # -------------------------------------------------------------- lifecycle

    def start(self, timeout_s: float) -> dict[str, Any]:
        """Launch the worker and wait for its hello.

        Raises:
            BackendError: It could not be started, died, or said nothing in ``timeout_s``.
        """
        with open(self.log_path, "wb") as log:
            try:
                self.proc = processes.start(
                    self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self.env
                )
            except OSError as exc:
                raise BackendError(f"{self.name} could not be started ({' '.join(self.command)}): {exc}") from exc
        threading.Thread(target=self._read, daemon=True, name=f"autotune-exl2-reader-{self.proc.pid}").start()
        hello = self._next(timeout_s, "start (hello)")
        if hello.get("event") != "hello" or hello.get("protocol") != PROTOCOL_VERSION:
            raise self.failure(
                f"spoke another protocol: first message {hello!r}, expected a hello of protocol {PROTOCOL_VERSION}"
            )
        self.hello = hello
        return hello

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.strip():
                continue
            try:
                self._replies.put(decode(line))
            except ProtocolError as exc:
                # Not fatal by itself: keep it for the error message if no answer comes.
                self._stray.append(str(exc))
        self._replies.put(_EOF)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to exit, then make sure its whole process group is gone."""
        proc = self.proc
        if proc is None:
            return
        try:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    proc.stdin.write(encode({"id": 0, "op": "exit"}))
                    proc.stdin.flush()
                    proc.wait(timeout=min(2.0, timeout_s))
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    pass
            processes.stop(proc, timeout_s=timeout_s)  # SIGTERM, SIGKILL, and the group's leftovers
        finally:
            for stream in (proc.stdin, proc.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass

    # -------------------------------------------------------------- requests

    def failure(self, what: str) -> BackendError:
        """A BackendError for ``what``, with the worker's exit status and stderr tail; kills it."""
        rc = self.proc.poll() if self.proc is not None else None
        status = f"{self.name} {_exit_text(rc)}" if rc is not None else f"{self.name} (pid {self.pid})"
        self.stop(timeout_s=5.0)
        tail = _tail(self.log_path)
        last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
        extra = f"; it printed on its protocol stream: {self._stray[-1]}" if self._stray else ""
        reason = f": {last}" if last else " (nothing on stderr)"
        return BackendError(f"{status}: {what}{reason}{extra}", log_tail=tail)

    def _next(self, timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                message = self._replies.get(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
                break
            except queue.Empty:
                # A dead worker's children (a compiler it started) may keep the pipe open, so
                # no end of file comes: its exit status is the sign.
                if self.proc is not None and self.proc.poll() is not None:
                    try:  # what it wrote before exiting may still be on its way
                        message = self._replies.get(timeout=0.5)
                    except queue.Empty:
                        message = _EOF
                    break
                if time.monotonic() >= deadline:
                    raise self.failure(f"no answer to {what} within {timeout_s:g} s (hung; killed)") from None
        if message is _EOF:
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    pass
            raise self.failure(f"died during {what}")
        return message

    def request(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its answer.

        Raises:
            BackendError: The worker answered with an error (it stays alive), died, or hung
                (it is killed); the message says which, with the worker's own reason.
        """
        if self.proc is None or self.proc.stdin is None:
            raise BackendError(f"{self.name} was not started")
        request_id = next(self._ids)
        try:
            self.proc.stdin.write(encode({"id": request_id, "op": op, **fields}))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self.failure(f"died before '{op}' could be sent") from None
        while True:
            reply = self._next(timeout_s, f"'{op}'")
            if reply.get("id") == request_id:
                break
        if not reply.get("ok"):
            error = BackendError(
                f"{self.name}: '{op}' failed: {reply.get('type', 'Error')}: {reply.get('error', 'no reason given')}",
                log_tail=str(reply.get("traceback") or _tail(self.log_path)),
            )
            raise error
        return reply
