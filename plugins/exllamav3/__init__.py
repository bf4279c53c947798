"""exllamav3 for autotune: the ``exllamav3`` backend (extra ``exllamav3``).

Backends (through the ``register_backends`` hook):

* ``exllamav3``: loads an EXL3 directory in a worker process per trial and measures
  exllamav3's paged generator (:mod:`autotune_plugins.exllamav3.backend`).

Registering imports neither torch nor exllamav3: only the worker process does
(:mod:`autotune_plugins.exllamav3.worker`), so the plugin loads and its space, rules and
memory estimate work on a machine without them.
"""

from __future__ import annotations

from autotune import hookimpl

__all__ = ["register_backends"]


@hookimpl
def register_backends(register):
    """Add the ``exllamav3`` backend.

    Args:
        register: Called with each backend instance.
    """
    from autotune_plugins.exllamav3.backend import ExLlamaV3Backend

    register(ExLlamaV3Backend())
