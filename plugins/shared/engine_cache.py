"""Where ``autotune engine build`` keeps the engines it builds: the llama-server plugin builds
and finds them there, openai-server finds the servers its templates name there. No engine owns it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["engines_dir"]


def engines_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory holding built engines.

    Args:
        cache_dir: An explicit directory (``--cache-dir``); it is used as is.

    Returns:
        ``cache_dir``, else ``$AUTOTUNE_CACHE_DIR/engines``, else
        ``$XDG_CACHE_HOME/autotune/engines``, else ``~/.cache/autotune/engines``.
    """
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("AUTOTUNE_CACHE_DIR"):
        return Path(os.environ["AUTOTUNE_CACHE_DIR"]).expanduser() / "engines"
    # An empty XDG_CACHE_HOME means "unset" (XDG Base Directory spec).
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "autotune" / "engines"
