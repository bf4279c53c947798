"""Engine processes that never outlive autotune: one implementation for every backend plugin.

A backend starts its engine (a server, a worker) in a session of its own with
:func:`die_with_parent` as ``preexec_fn``, ends it with :func:`stop_group`, and registers a
cleanup with :func:`on_exit`, which runs at interpreter exit and on SIGTERM. The kernel's
parent-death signal covers the one case no handler can: autotune being SIGKILLed.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["die_with_parent", "on_exit", "stop_group"]

_CLEANUPS: list[Callable[[], None]] = []
_LOCK = threading.Lock()
_INSTALLED = False


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

    When the leader has already exited, what is left of its group is killed outright.
    """
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=timeout_s)
    else:
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
