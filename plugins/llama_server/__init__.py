"""llama.cpp's llama-server for autotune: building the engine and synthetic test models.

Commands (through the ``register_commands`` hook):

* ``autotune engine build llama.cpp``: build ``llama-server`` and ``llama-quantize`` from the
  llama.cpp tree pinned in llama-cpp-python's sdist, for the detected GPU's architecture, into
  autotune's cache (:mod:`autotune_plugins.llama_server.engine`).
* ``autotune synth``: write a random-weight GGUF of a real architecture and size, to measure
  speed and memory without downloading a model (:mod:`autotune_plugins.llama_server.synth`).

Backends (through the ``register_backends`` hook):

* ``llama-server``: launches llama.cpp's server on a GGUF file and measures it
  (:mod:`autotune_plugins.llama_server.backend`).
"""

from __future__ import annotations

from autotune.api import hookimpl

from autotune_plugins.llama_server import commands

__all__ = ["register_backends", "register_commands"]


@hookimpl
def register_commands(cli):
    """Add ``autotune engine build`` and ``autotune synth``.

    Args:
        cli: The top-level click group.
    """
    commands.add_engine_commands(cli)
    commands.add_synth_command(cli)


@hookimpl
def register_backends(register):
    """Add the ``llama-server`` backend.

    Args:
        register: Called with each backend instance.
    """
    from autotune_plugins.llama_server.backend import LlamaServerBackend

    register(LlamaServerBackend())


@hookimpl
def register_engine_models(register):
    """The engine's one model (its space, rules, memory model and physics constants): its
    backend reads it, and the twin simulates it from it."""
    from autotune_plugins.llama_server.engine_model import LLAMA_CPP

    register(LLAMA_CPP)
