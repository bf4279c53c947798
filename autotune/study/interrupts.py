"""Ctrl-C and SIGTERM during a study: the study ends, at once, with its storage consistent.

A Python signal handler runs at the main thread's next bytecode, wherever that is. When that is
a garbage collector's weakref callback or a ``__del__`` (seen: SQLAlchemy's class registry
collecting a mapped class mid-trial), what the handler raises is printed as "Exception ignored"
and dropped, and the study would go on for the rest of its budget. So the handler also records
the interrupt, the runner checks it between steps (``raise_if_interrupted``), and until the
runner has caught it, the signal is delivered again every ``INSIST_S`` seconds.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Iterator

INSIST_S = 1.0  # a dropped interrupt is raised again this often, until it is caught


class Interrupted(BaseException):
    """Ctrl-C or SIGTERM: a BaseException, like KeyboardInterrupt, so that a plugin's
    ``except Exception`` cannot turn the user's interrupt into one failed trial and go on."""


class Interrupts:
    """Installs the study's handlers for SIGINT and SIGTERM while ``installed()`` is entered."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._caught = threading.Event()
        self._deferring = False
        self._insisting: threading.Thread | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Handle SIGINT/SIGTERM as ``Interrupted`` inside the block (main thread only: elsewhere
        Python cannot install handlers, and the process's own ones stay)."""
        self.signum = None
        self._caught.clear()
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._on_signal)
        try:
            yield
        finally:
            self._caught.set()  # ends the re-delivery; a delivery still pending is ignored
            if self._insisting is not None:
                self._insisting.join()
                self._insisting = None
                # A delivery sent just before the join reaches our handler (which ignores it)
                # at the main thread's next system call, not the restored one (a stray
                # KeyboardInterrupt while the summary is printed).
                time.sleep(0.01)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def caught(self) -> None:
        """The runner has the interrupt: no more deliveries."""
        self._caught.set()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold an interrupt until the block ends, then raise it.

        An interrupt inside ``study.ask()`` would leave a RUNNING trial that nobody holds a
        handle to; deferring it until ``ask`` returns lets the runner fail that trial cleanly.
        """
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        self.raise_if_interrupted()

    def raise_if_interrupted(self) -> None:
        if self.signum is not None and not self._caught.is_set():
            raise Interrupted()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._caught.is_set():
            return  # a re-delivery that arrived after the runner caught the first one
        if self.signum is None:
            self.signum = signum
            self._insisting = threading.Thread(
                target=self._insist, args=(signum,), daemon=True, name="autotune-interrupt"
            )
            self._insisting.start()
        if not self._deferring:
            raise Interrupted()

    def _insist(self, signum: int) -> None:
        main = threading.main_thread().ident
        while not self._caught.wait(INSIST_S):
            if main is not None:
                signal.pthread_kill(main, signum)
