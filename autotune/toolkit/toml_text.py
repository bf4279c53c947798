"""TOML for files autotune writes for people (``autotune init``'s study file).

Values are written as TOML's own literals (a basic string escapes quotes, backslashes and every
control character), and a comment is one ``#`` line per line of its text with control characters
shown as ``\\xNN``: a model file whose name holds a newline cannot end a comment and start a
table of its own (``[backends.llama-server] binary = "evil"``).
"""

from __future__ import annotations

import math
from typing import Any

from autotune.errors import ConfigError
from autotune.toolkit.terminal import shown

__all__ = ["comment", "value"]

_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"', "\\": "\\\\"}


def _string(s: str) -> str:
    out = []
    for ch in s:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        elif 0xD800 <= code <= 0xDFFF:  # a name's byte that is not UTF-8 (surrogateescape)
            raise ConfigError(
                f"{s.encode('utf-8', 'surrogateescape')!r}: not UTF-8 text, which a TOML file cannot hold; rename it"
            )
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def value(v: Any) -> str:
    """``v`` (bool, int, finite float, str, or a list of them) as a TOML value."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"no TOML for {v!r} in a study file")
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")


def comment(text: str) -> list[str]:
    """``text`` as TOML comment lines, one per line of it; nothing in it can leave the comment."""
    return ["# " + shown(line).replace("\n", " ") for line in str(text).splitlines() or [""]]
