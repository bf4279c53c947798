"""Child processes that never outlive autotune: one way to start them, for the core and every plugin.

Every child autotune starts (an engine, a converter, a build step, a ``--version`` probe) is
started with :func:`start` (a long-lived child, ended with :func:`stop` in a ``finally``) or
:func:`run` (a tool run to its end, or to its timeout): a session (process group) of its own,
:func:`die_with_parent` in the child, a mark in its environment that its descendants inherit,
and a registry of live children that is emptied at interpreter exit and on SIGTERM. The
kernel's parent-death signal covers the one case no handler can: autotune being SIGKILLed.

Stopping ends the child's process group and then every process that still carries its mark:
a grandchild that left the group with ``setsid`` (and was reparented to init by a double fork)
kept running before. Why a mark and not a subreaper (``PR_SET_CHILD_SUBREAPER``): a subreaper
is process-wide (autotune, or pytest embedding it, would adopt the orphans of every tool it
ever ran and have to reap them) and still cannot tell which child an adopted orphan came from,
so stopping one engine could not end only its own; walking ``/proc`` by parent misses exactly
the double-forked process, whose parent is init. The environment is inherited across fork,
``setsid`` and exec, so the mark finds them by ``/proc/PID/environ``; only a descendant that
clears its environment on purpose escapes it (none of the engines or tools autotune runs does).
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MARK_ENV", "die_with_parent", "live", "marked", "on_exit", "run", "start", "stop", "stop_group"]

#: The environment variable that marks a child and all its descendants (a token per child).
MARK_ENV = "AUTOTUNE_PROCESS_MARK"

_CLEANUPS: list[Callable[[], None]] = []
_LOCK = threading.Lock()
_INSTALLED = False
_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()
_MARKS: dict[subprocess.Popen, str] = {}


def die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGKILL it when autotune dies.

    atexit and signal handlers cannot run when autotune itself is SIGKILLed; the kernel's
    parent-death signal still fires then. Use it with ``start_new_session=True`` and start the
    child from the main thread: the signal follows the thread that forked.
    """
    libc = _libc()
    if libc is not None:  # not Linux/glibc: the atexit and SIGTERM paths still apply
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    # Loaded in the parent (start() calls it first): importing ctypes in every forked child
    # cost ~25 ms a child on a 2-core VM, which a --version probe pays each time.
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def stop_group(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group ``proc`` leads, wait, SIGKILL it if it lingers.

    When the leader has already exited, what is left of its group is killed outright. An
    interrupt while waiting ends the grace at once (the group is killed, the interrupt goes on),
    and a group that outlives even SIGKILL's wait is left to the kernel: neither may replace the
    error the caller is already raising with a ``TimeoutExpired`` that looks like a failed trial.
    """
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            pass
        except BaseException:
            _kill_group(proc)
            raise
        _kill_group(proc)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    else:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run_cleanups() -> None:
    with _LOCK:
        cleanups = list(_CLEANUPS)
    for cleanup in cleanups:
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - best effort while exiting
            pass


def _on_sigterm(previous: Any) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        _run_cleanups()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    return handler


def on_exit(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` at interpreter exit and on SIGTERM (once registered, idempotent).

    The SIGTERM handler is installed once, from the main thread, and chains to the handler it
    replaced, then dies of the signal as it would have.
    """
    global _INSTALLED
    with _LOCK:
        if cleanup not in _CLEANUPS:
            _CLEANUPS.append(cleanup)
        if _INSTALLED:
            return
        atexit.register(_run_cleanups)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, _on_sigterm(signal.getsignal(signal.SIGTERM)))
        _INSTALLED = True


def forget(cleanup: Callable[[], None]) -> None:
    """Stop running ``cleanup`` at exit (its work is done: a partial file became the result)."""
    with _LOCK:
        if cleanup in _CLEANUPS:
            _CLEANUPS.remove(cleanup)


def live() -> set[subprocess.Popen]:
    """Children started with :func:`start` (or :func:`run`) and not stopped yet."""
    with _LIVE_LOCK:
        return set(_LIVE)


def _stop_live() -> None:
    for proc in live():
        try:
            stop(proc, timeout_s=5.0)
        except Exception:  # noqa: BLE001 - best effort while exiting
            pass


def start(cmd: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
    """Start a child in its own session, dying with autotune, marked, registered until :func:`stop`.

    Args:
        cmd: The command line.
        popen_kwargs: Anything else for ``subprocess.Popen`` (streams, env, cwd, text); not
            ``start_new_session`` nor ``preexec_fn``, which are this function's.

    Raises:
        OSError: It could not be started.
    """
    on_exit(_stop_live)
    _libc()
    mark = uuid.uuid4().hex
    env = dict(os.environ if popen_kwargs.get("env") is None else popen_kwargs["env"])
    # Added to the marks it inherits: a child that starts children of its own the same way
    # (autotune run by autotune) must not take them out of its parent's reach.
    env[MARK_ENV] = f"{env[MARK_ENV]}:{mark}" if env.get(MARK_ENV) else mark
    popen_kwargs["env"] = env
    # Registered under the lock it was started under: a SIGTERM between the two cannot miss it.
    with _LIVE_LOCK:
        proc = subprocess.Popen(list(cmd), start_new_session=True, preexec_fn=die_with_parent, **popen_kwargs)
        _LIVE.add(proc)
        _MARKS[proc] = mark
    return proc


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """End ``proc``'s whole process group (:func:`stop_group`), then whatever of its descendants
    escaped the group (:func:`marked`), and forget it. Those are killed outright: the child had
    its grace, and a process that left its group is not one it waits for."""
    try:
        stop_group(proc, timeout_s)
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(proc)
            mark = _MARKS.pop(proc, None)
        if mark is not None:
            _kill_marked(mark)


def marked(mark: str) -> list[int]:
    """The processes whose environment carries ``mark`` in ``MARK_ENV`` (a zombie's reads as empty)."""
    prefix = f"{MARK_ENV}=".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc: the group kill is all there is
        return found
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone meanwhile, or not ours to read (so not our descendant either)
            continue
        if prefix not in environ:
            continue
        for var in environ.split(b"\0"):
            if var.startswith(prefix) and mark in var[len(prefix) :].decode("ascii", "replace").split(":"):
                found.append(int(name))
    return found


def _kill_marked(mark: str) -> None:
    # A few rounds: a marked process may fork while the previous round kills it.
    for _ in range(10):
        pids = marked(mark)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def run(
    cmd: Sequence[str], *, timeout_s: float | None = None, capture_output: bool = False, **popen_kwargs: Any
) -> subprocess.CompletedProcess:
    """Run a tool to its end through :func:`start`; what it leaves running is stopped.

    As ``subprocess.run`` (``check`` aside), with one difference that matters: at the timeout
    the whole group and the tool's marked descendants are killed before its output is read, so
    a probe whose child holds its pipe open cannot hang the caller (``subprocess.run`` kills
    the child alone and then waits for the pipe).

    Args:
        cmd: The command line.
        timeout_s: Bound on the run, seconds; None waits.
        capture_output: Collect stdout and stderr (as ``subprocess.run``).
        popen_kwargs: Anything else for ``subprocess.Popen`` (``stdout``, ``env``, ``text``...).

    Raises:
        OSError: It could not be started.
        subprocess.TimeoutExpired: It ran past ``timeout_s`` (it and its descendants are dead).
    """
    if capture_output:
        popen_kwargs["stdout"] = popen_kwargs["stderr"] = subprocess.PIPE
    proc = start(cmd, **popen_kwargs)
    try:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc, timeout_s=2.0)
            try:
                out, err = proc.communicate(timeout=5.0)
            except (subprocess.TimeoutExpired, ValueError):
                out = err = None
            raise subprocess.TimeoutExpired(list(cmd), timeout_s or 0.0, output=out, stderr=err) from None
    finally:
        stop(proc)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
