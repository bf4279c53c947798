"""The plugin contract: every hook autotune calls, grouped by the phase it runs in.

A plugin is a module (or object) whose functions are marked with ``autotune.hookimpl`` and
named like the hooks below. It is found through the ``autotune`` entry-point group; the
built-in plugins under ``plugins/`` register exactly that way, from our own pyproject.toml.
Implementations may accept any subset of a hook's arguments (pluggy passes them by name).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:  # pragma: no cover - types only
    import click

# Each ``register`` takes an instance of the class its docstring names (``BaseBackend``,
# ``EngineModel``, ``BaseMetric``, ``BaseStrategy``); typed ``Any`` so that this contract imports
# none of their modules, which import the registry (no import cycle through the hooks).

hookspec = pluggy.HookspecMarker("autotune")
hookimpl = pluggy.HookimplMarker("autotune")


# --------------------------------------------------------------------------------------
# Registration: called once when the plugin manager is first used.
# --------------------------------------------------------------------------------------


@hookspec
def register_backends(register: Callable[[Any], None]) -> None:
    """Register serving backends.

    Args:
        register: Call once per backend instance. Its ``name`` must be unique among all
            installed plugins: a name already taken is a ``PluginError`` naming both plugins.
    """


@hookspec
def register_engine_models(register: Callable[[Any], None]) -> None:
    """Register engine models (:class:`autotune.engine.model.EngineModel`): one per engine, by
    the engine's name. Its backends read their space and rules from it, and the twin plugin
    simulates every one that names a ``twin_name``.

    Args:
        register: Call once per engine model. Its ``name`` (the engine) must be unique among
            all installed plugins: a name already taken is a ``PluginError`` naming both plugins.
    """


@hookspec
def register_metrics(register: Callable[[Any], None]) -> None:
    """Register metrics (quality benchmarks and proxies) that a study's objective can use.

    Args:
        register: Call once per metric instance. Names are unique across plugins, as for
            backends.
    """


@hookspec
def register_strategies(register: Callable[[Any], None]) -> None:
    """Register search strategies: what a study file names as ``[study] sampler``.

    The core registers its own (tpe, prior, random, nsga2, grid) the same way, from
    ``autotune.study.default_strategies``; a plugin adds one that needs what it ships (the twin's
    ``twin``, which ranks with the twin before every launch).

    Args:
        register: Call once per strategy instance (an ``autotune.engine.strategy.BaseStrategy``).
            Names are unique across plugins, as for backends: a name already taken is a
            ``PluginError`` naming both plugins.
    """


@hookspec
def register_commands(cli: "click.Group") -> None:
    """Add subcommands to the ``autotune`` command line.

    Args:
        cli: The top-level click group; call ``cli.command()`` or ``cli.add_command()`` on it.
    """
