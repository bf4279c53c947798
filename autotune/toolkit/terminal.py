"""Text made safe for a terminal: what autotune prints of names it did not choose.

A weights file's name, a study name another client wrote into a shared storage, an engine's
output: any of them may hold an escape sequence that clears the screen, retitles the window or
writes the clipboard (OSC 52), or a bidirectional override that shows a line other than it is.
Everything the command line prints passes through :func:`shown` (``echo``), as engine output
already did through ``errors.printable``: one owner, so the two cannot disagree.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import click

__all__ = ["echo", "printable", "shown", "show_warnings"]

# An ANSI escape sequence (CSI such as colours and cursor moves, OSC such as a window title or a
# clipboard write, DCS/APC/PM strings, or a two-character escape), then any other control
# character but tab and newline (C1 controls included: U+009B is a CSI of its own).
_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Bidirectional overrides and isolates: they reorder what follows on the line ("Trojan source"),
# and a file name is no place for them. A lone surrogate (a name not in UTF-8) cannot be printed.
_INVISIBLE = re.compile("[\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: str) -> str:
    """Text an engine wrote, made safe to print to a terminal and to store: ANSI escapes are
    dropped (an engine's colours, or a sequence that rewrites the user's terminal), a carriage
    return ends a line (progress bars), and every other control character, raw binary among
    them, is shown as ``\\xNN`` rather than sent."""
    text = _ESCAPE.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return _INVISIBLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def shown(text: Any) -> str:
    """``text`` as autotune prints it: :func:`printable`, its lines kept. The escape character
    itself is shown (``\\x1b``), not dropped with what follows: a name is not an engine's colours,
    and the user should see that a name holds one."""
    text = str(text).replace("\r\n", "\n")
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return _INVISIBLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def echo(message: Any = "", err: bool = False) -> None:
    """``click.echo`` of :func:`shown` text: every line a command prints."""
    click.echo(shown(message), err=err)


class _ShownFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return shown(super().format(record))


def show_warnings() -> None:
    """Warnings logged by autotune and its plugins (a template's name, a configuration's
    weights path in them), printed as Python's last-resort handler would, ``%(message)s`` on
    stderr at WARNING and above, but through :func:`shown`. Once; not where logging is set up
    already (an embedding program's handlers, pytest's)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_ShownFormatter("%(message)s"))
    root.addHandler(handler)
