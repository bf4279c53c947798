"""Engine processes that never outlive autotune: one implementation for every backend plugin.

A backend starts its engine (a server, a worker) with :func:`start`: a session (process group)
of its own, :func:`die_with_parent` in the child, and a registry of live engines that is
emptied at interpreter exit and on SIGTERM. It ends it with :func:`stop`, in a ``finally``.
The kernel's parent-death signal covers the one case no handler can: autotune being SIGKILLed.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["die_with_parent", "live", "on_exit", "start", "stop", "stop_group"]

_CLEANUPS: list[Callable[[], None]] = []
_LOCK = threading.Lock()
_INSTALLED = False
_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()


def die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGKILL it when autotune dies.

    atexit and signal handlers cannot run when autotune itself is SIGKILLed; the kernel's
    parent-death signal still fires then. Use it with ``start_new_session=True`` and start the
    child from the main thread: the signal follows the thread that forked.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux/glibc: the atexit and SIGTERM paths still apply
        pass


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


def live() -> set[subprocess.Popen]:
    """Engine processes started with :func:`start` and not stopped yet."""
    with _LIVE_LOCK:
        return set(_LIVE)


def _stop_live() -> None:
    for proc in live():
        try:
            stop(proc, timeout_s=5.0)
        except Exception:  # noqa: BLE001 - best effort while exiting
            pass


def start(cmd: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """Start an engine in its own session, dying with autotune, registered until :func:`stop`.

    Args:
        cmd: The command line.
        popen_kwargs: Anything else for ``subprocess.Popen`` (streams, env, cwd).

    Raises:
        OSError: It could not be started.
    """
    on_exit(_stop_live)
    # Registered under the lock it was started under: a SIGTERM between the two cannot miss it.
    with _LIVE_LOCK:
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent, **popen_kwargs)
        _LIVE.add(proc)
    return proc


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """End ``proc``'s whole process group (:func:`stop_group`) and forget it."""
    try:
        stop_group(proc, timeout_s)
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(proc)
