"""The deploy line: the one shell line a person pastes to serve what a study measured.

Every backend builds its ``deploy_command`` with :func:`deploy_line`, and every one-line setting
is checked with :func:`control_problem`, so that nothing a study file, a template or a path holds
can end the line's comment and start a command of its own.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from autotune.toolkit.redact import mask_argv
from autotune.toolkit.shell import quote

__all__ = ["control_problem", "deploy_line"]

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# In a note: C1 controls (U+009B is a terminal's CSI) and bidirectional overrides too.
_NOTE_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def control_problem(value: str) -> str | None:
    """Why a one-line value (a host, a name, a template's docs) is refused: a control character,
    which would end the deploy line's comment and start a shell command when it is pasted."""
    found = _CONTROL.search(value)
    return (
        None
        if found is None
        else (
            f"holds the control character {found.group()!r} at {found.start()}; it must be one line of printable text"
        )
    )


def deploy_line(argv: Sequence[Any], notes: Sequence[str] = (), env: Mapping[str, str] | None = None) -> str:
    """A deploy command as the one shell line a person pastes: ``VAR=value argv...  # note; note``.

    Every word is quoted as a shell needs it (``shell.quote``: a plain word stays as it is), a
    secret in it (``--api-key sk-...``) is masked (``redact.mask_argv``), and
    each control character of a note becomes a space, so nothing in a setting, a path or a
    template can end the comment and start a command of its own.
    """
    words = [f"{k}={quote(v)}" for k, v in (env or {}).items()] + [quote(a) for a in mask_argv(argv)]
    line = " ".join(words)
    if notes:
        line += "  # " + _NOTE_CONTROL.sub(" ", "; ".join(notes))
    return line
