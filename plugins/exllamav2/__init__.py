"""ExLlamaV2 for autotune: the ``exllamav2`` backend (extra ``exllamav2``).

Backends (through the ``register_backends`` hook):

* ``exllamav2``: loads an EXL2 directory in a worker process per trial and measures
  ExLlamaV2's dynamic generator (:mod:`autotune_plugins.exllamav2.backend`).

Registering imports neither torch nor exllamav2: only the worker process does
(:mod:`autotune_plugins.exllamav2.worker`), so the plugin loads and its space, rules and
memory estimate work on a machine without them.
"""

from __future__ import annotations

from autotune.api import hookimpl

__all__ = ["register_backends"]


@hookimpl
def register_backends(register):
    """Add the ``exllamav2`` backend.

    Args:
        register: Called with each backend instance.
    """
    from autotune_plugins.exllamav2.backend import ExLlamaV2Backend

    register(ExLlamaV2Backend())


@hookimpl
def register_engine_models(register):
    """The engine's one model (its space, rules, memory model and physics constants): its
    backend reads it, and the twin simulates it from it."""
    from autotune_plugins.exllamav2.engine_model import EXLLAMAV2

    register(EXLLAMAV2)
