"""Command lines for people to paste: one owner of how an argv becomes a shell line.

Every command autotune prints or stores for a person (the deploy line, ``init``'s "next:", the
report hint) is built here from an argv, never by formatting a path or a name into a string:
a name holding ``;``, ``$( )``, quotes or a newline is one word when pasted, and nothing else runs.
"""

from __future__ import annotations

import re
import shlex
from typing import Any, Iterable

__all__ = ["command_line", "quote"]

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def quote(word: Any) -> str:
    """One word for a POSIX shell (``shlex.quote``: a plain word stays as it is). A word with a
    control character (a newline in a file name) is written as bash's ``$'...'`` with ``\\xNN``
    escapes: the printed line stays one line of printable text, and pasted, it is the same word."""
    word = str(word)
    if not _CONTROL.search(word):
        return shlex.quote(word)
    out = []
    for ch in word:
        if ch in "\\'":
            out.append("\\" + ch)
        elif _CONTROL.fullmatch(ch):
            # Its UTF-8 bytes: bash's \u needs a UTF-8 locale, \xNN does not.
            out.append("".join(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogateescape")))
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def command_line(argv: Iterable[Any]) -> str:
    """An argv as one shell line, each word :func:`quote`d."""
    return " ".join(quote(a) for a in argv)
