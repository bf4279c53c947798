"""exllamav3 for autotune: the ``exllamav3`` backend (extra ``exllamav3``), an EXL3 directory
loaded in a worker process per trial, exllamav3's paged generator measured
(:mod:`autotune_plugins.exllamav3.backend`).

Only that worker (:mod:`autotune_plugins.exllamav3.worker`) imports torch and exllamav3, as in
ExLlamaV2's plugin: registering needs neither, and the space, rules and memory estimate work
on a machine without them.
"""

from __future__ import annotations

from autotune.api import hookimpl

__all__ = ["register_backends"]


@hookimpl
def register_backends(register):
    """Add the ``exllamav3`` backend (``register`` is called with it)."""
    from autotune_plugins.exllamav3.backend import ExLlamaV3Backend

    register(ExLlamaV3Backend())


@hookimpl
def register_engine_models(register):
    """The engine's one model (its space, rules, memory model and physics constants): its
    backend reads it, and the twin simulates it from it."""
    from autotune_plugins.exllamav3.engine_model import EXLLAMAV3

    register(EXLLAMAV3)
