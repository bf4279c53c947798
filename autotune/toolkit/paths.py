"""What a path given as input is, in words, when it is not what was asked for.

"no such file" for a directory, a FIFO or ``/dev/zero`` sends the user looking for a typo that
is not there; and reading a FIFO or a device as weights blocks or never ends, so anything that
is not a regular file is refused before it is opened.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISREG, "a file"),
)


def path_problem(path: str | Path, want: str = "file") -> str | None:
    """Why ``path`` is not a ``want`` ("file": a regular file, or "directory"), in words
    (None: it is one). Symbolic links are followed; one that leads nowhere is named as such."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return f"a symbolic link to {p.readlink()}, which does not exist" if p.is_symlink() else f"no such {want}"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if (stat.S_ISREG if want == "file" else stat.S_ISDIR)(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a file nor a directory")
    return f"is {kind}, not a {'regular file' if want == 'file' else want}"


def read_input(path: str | Path, shown: str | None = None, limit: int = 64 * 2**20, what: str = "a file") -> bytes:
    """The bytes of ``path``, an input file autotune reads whole (a workload's lengths file).

    Only a regular file is opened: a FIFO would block the study (and ``best``) for ever, and
    ``/dev/zero`` (or a link to it) would fill memory. One over ``limit`` bytes is refused
    rather than read, and at most ``limit + 1`` bytes are ever read (a file that grows).

    Raises:
        ValueError: naming the file (``shown``, default the path), what it is and what is accepted.
    """
    shown = shown or str(path)
    problem = path_problem(path)
    if problem is not None:
        raise ValueError(f"{shown}: {problem}; give {what}")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"{shown}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise ValueError(f"{shown}: larger than {limit // 2**20} MiB, the most autotune reads as {what}")
    return data


def read_json(path: str | Path, shown: str | None = None, limit: int = 64 * 2**20, what: str = "a JSON file") -> Any:
    """The JSON document in ``path``, read as :func:`read_input` reads (a regular file, bounded).

    Raises:
        ValueError: naming the file, what is wrong (its kind, its size, not UTF-8, not JSON and
            where) and what is accepted.
    """
    shown = shown or str(path)
    data = read_input(path, shown, limit, what)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{shown}: cannot be read as UTF-8 text ({exc}); give {what}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{shown}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
