"""Any OpenAI-compatible server (vLLM, SGLang, TGI, TabbyAPI, llama-server) as a backend.

Backends (through the ``register_backends`` hook):

* ``openai-server``: starts the server a command template names, drives the workload through
  ``/v1/completions`` and reads the engine's own ``/metrics``
  (:mod:`autotune_plugins.openai_server.backend`). Templates are data, one TOML file per engine
  in ``templates/`` (:mod:`autotune_plugins.openai_server.templates`).
"""

from __future__ import annotations

from autotune.api import hookimpl

__all__ = ["register_backends"]


@hookimpl
def register_backends(register):
    """Add the ``openai-server`` backend.

    Args:
        register: Called with each backend instance.
    """
    from autotune_plugins.openai_server.backend import OpenAIServerBackend

    register(OpenAIServerBackend())


@hookimpl
def register_engine_models(register):
    """The engine's one model (its space, rules, memory model and physics constants): its
    backend reads it, and the twin simulates it from it."""
    from autotune_plugins.openai_server.engine_model import VLLM

    register(VLLM)
