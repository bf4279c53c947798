"""autotune: find the fastest way to serve an LLM on a GPU without breaking its memory or quality."""

from autotune.hookspecs import hookimpl

__all__ = ["hookimpl"]
__version__ = "0.1.0"
