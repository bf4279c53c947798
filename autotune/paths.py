"""What a path given as input is, in words, when it is not what was asked for.

"no such file" for a directory, a FIFO or ``/dev/zero`` sends the user looking for a typo that
is not there; and reading a FIFO or a device as weights blocks or never ends, so anything that
is not a regular file is refused before it is opened.
"""

from __future__ import annotations

import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISREG, "a file"))


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
