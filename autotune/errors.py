"""Errors raised by autotune's library code, and the one place they become exit statuses."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import traceback
from typing import Iterator

from autotune.toolkit.redact import scrub
from autotune.toolkit.terminal import printable, shown


class AutotuneError(Exception):
    """Base of every error autotune raises on purpose."""


class ConfigError(AutotuneError):
    """A study file, a flag or another input is invalid; the message says what would be accepted."""


class UnknownNameError(ConfigError):
    """A name (GPU, model, backend, format) is not in its catalog or registry."""


class MeasurementError(AutotuneError):
    """A measurement could not be completed (timeout, engine died, nonsense values)."""


class PluginError(AutotuneError):
    """A plugin broke the contract: a duplicate name, a missing method, a bad registration."""


class BackendError(AutotuneError):
    """A backend could not launch or measure a configuration; the message is the engine's reason.

    The message and the log tail are scrubbed of known secrets (``autotune.toolkit.redact.scrub``) here,
    where every backend's engine output enters the core: both are printed and stored in the trial,
    and an engine may print its environment or its command line when it fails.

    Attributes:
        log_tail: The last lines of the engine's log, when there is one.
    """

    def __init__(self, message: str, log_tail: str = ""):
        # Every backend's error carries the engine's own words to the terminal and the storage:
        # made printable, then scrubbed of secrets, here, once, whoever raised it.
        super().__init__(scrub(printable(message)))
        self.log_tail = scrub(printable(log_tail)) if log_tail else log_tail


class UnsupportedError(BackendError):
    """The engine refuses this configuration on this card (e.g. BF16 weights before sm_80)."""


class EngineUnavailableError(BackendError):
    """The engine cannot run any configuration here (no binary, a build without this card's
    architecture): every trial would fail the same way, so the study stops at the first one
    with this message, which names the remedy."""


class StorageError(ConfigError):
    """A study storage cannot be opened, written or read (path, server, schema)."""


EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130


def exit_status(exc: BaseException) -> int:
    """The command line's exit status for an error: 2 for bad input, 130 for an interrupt, else 1."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, (ConfigError, EngineUnavailableError)):
        return EXIT_BAD_INPUT
    return EXIT_FAILURE


@contextlib.contextmanager
def handle_errors(debug: bool = False) -> Iterator[None]:
    """Turn autotune's errors into one ``Error:`` line on stderr and the exit status.

    Every command, the core's and the plugins', runs inside it, so the exit-status promise of
    docs/usage.md ("Exit status") has one owner. Tracebacks only with ``debug``; an error that
    is not autotune's is a bug and keeps its traceback.
    """
    try:
        yield
    except AutotuneError as exc:
        if debug:
            traceback.print_exc()
        print(f"Error: {shown(exc)}", file=sys.stderr)
        raise SystemExit(exit_status(exc)) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except OSError as exc:
        # A path the user gave (a study file, a model, a storage) that no filesystem call can
        # take: bad input wherever it is first touched, not a bug.
        if exc.errno != errno.ENAMETOOLONG:
            raise
        if debug:
            traceback.print_exc()
        print(f"Error: {shown(too_long(exc.filename))}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None


def too_long(path: object) -> str:
    """The message for a path the filesystem refuses as too long (ENAMETOOLONG)."""
    text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
    longest = max((len(os.fsencode(part)) for part in text.split(os.sep)), default=0)
    shown = text if len(text) <= 120 else f"{text[:60]}...{text[-40:]} ({len(text):,} characters)"
    return (
        f"{shown}: too long for the filesystem (its longest name is {longest:,} bytes; a name may "
        "have 255 and a whole path 4,096 on Linux): give a shorter path or name"
    )
