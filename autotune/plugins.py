"""The plugin manager: loads the ``autotune`` entry-point group and owns the registries.

Built-in plugins are entry points of this very distribution, so there is no list of them
here: the core never names a backend. The core's own search strategies
(``autotune.study.default_strategies``) are the one plugin always registered, whatever the variables
say, as pytest's essential plugins: every study needs one. Two environment variables steer
loading:

* ``AUTOTUNE_LOAD_PLUGINS``: comma-separated allow-list of entry-point names to load
  (empty string: load none); unset loads every installed plugin.
* ``AUTOTUNE_TRACE_PLUGINS``: when set, every hook call is logged with its arguments and
  results to stderr, to debug a plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from typing import Any

import pluggy

from autotune.toolkit.terminal import shown
from autotune import hookspecs
from autotune.errors import PluginError, UnknownNameError

# The registry hands out backends, engine models, metrics and strategies as ``Any``: it imports
# none of their modules (they read the registry), so no import cycle runs through it.

ENTRY_POINT_GROUP = "autotune"
# Plugin name -> module of the plugins registered even when autoloading is off (tests) or an
# allow-list leaves them out.
ESSENTIAL_PLUGINS = {"autotune": "autotune.study.default_strategies"}

pm = pluggy.PluginManager("autotune")
pm.add_hookspecs(hookspecs)

_loaded = False
_sources: dict[str, str] = {}  # plugin name in pm -> distribution that provides it
_version = 0  # moves whenever the set of plugins changes: what is read from them is kept until then


def version() -> int:
    """A number that changes whenever a plugin is registered or unregistered, so that what is
    derived from the installed plugins (``cache_types.catalog``) is computed once per change."""
    return _version


def load_plugins() -> None:
    """Load installed plugins once (idempotent).

    Autoloading is skipped under pytest (``sys._called_from_test``, set by our conftest), so
    tests decide exactly which plugins exist.
    """
    global _loaded, _version
    if _loaded:
        return
    _loaded = True
    _version += 1
    for name, module_name in ESSENTIAL_PLUGINS.items():
        if pm.get_plugin(name) is None:
            pm.register(importlib.import_module(module_name), name=name)
            _sources[name] = "autotune"
    if getattr(sys, "_called_from_test", False):
        return
    allow = os.environ.get("AUTOTUNE_LOAD_PLUGINS")
    allowed = None if allow is None else {n.strip() for n in allow.split(",") if n.strip()}
    for ep in _entry_points():
        if allowed is not None and ep.name not in allowed:
            continue
        if pm.get_plugin(ep.name) is not None:
            continue
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
        except Exception as exc:  # a broken third-party plugin must not take the CLI down
            # Kept with the others that broke: `autotune plugins` names it, not stderr alone.
            _report_broken(ep.name, "loading", exc)
            continue
        _sources[ep.name] = ep.dist.name if ep.dist else "?"
    try:
        pm.check_pending()  # a misspelled hook name would otherwise be silently ignored
    except pluggy.PluginValidationError as exc:
        print(shown(f"autotune: {exc}"), file=sys.stderr)
    if os.environ.get("AUTOTUNE_TRACE_PLUGINS"):
        _trace()


def _entry_points() -> Any:
    """The installed plugins: the ``autotune`` entry-point group, the one place they are found."""
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def _trace() -> None:
    def before(hook_name: str, hook_impls: Any, kwargs: dict) -> None:
        print(f"autotune trace: {hook_name}({kwargs}) -> {[i.plugin_name for i in hook_impls]}", file=sys.stderr)

    def after(outcome: Any, hook_name: str, hook_impls: Any, kwargs: dict) -> None:
        print(f"autotune trace: {hook_name} returned {outcome.get_result()!r}", file=sys.stderr)

    pm.add_hookcall_monitoring(before, after)


def register_plugin(plugin: object, name: str, source: str = "(test)") -> None:
    """Register a plugin object by hand (tests, embedding applications)."""
    global _version
    pm.register(plugin, name=name)
    _version += 1
    _sources[name] = source


def unregister_plugin(name: str) -> None:
    """Undo ``register_plugin``."""
    global _version
    _version += 1
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)
    _sources.pop(name, None)
    for key in [k for k in _broken if k[0] == name]:
        del _broken[key]


def _collect(
    hook_name: str, kind: str, manager: pluggy.PluginManager = pm, report: bool = True
) -> dict[str, tuple[Any, str]]:
    """Call a ``register_*`` hook, owning the callback, and return name -> (object, plugin).

    Args:
        manager: The registry (``pm``), or one of every installed plugin (``installed_engine_models``).
        report: Whether a plugin whose hook raises is reported (once) or only left out.
    """
    load_plugins()
    found: dict[str, tuple[Any, str]] = {}
    hook = getattr(manager.hook, hook_name)
    for impl in hook.get_hookimpls():
        plugin_name = impl.plugin_name

        def register(obj: Any, _plugin: str = plugin_name) -> None:
            name = getattr(obj, "name", None)
            if not isinstance(name, str) or not name:
                raise PluginError(f"plugin '{_plugin}' registered a {kind} without a name: {obj!r}")
            if name in found:
                raise PluginError(
                    f"{kind} name '{name}' is registered twice: by plugin '{found[name][1]}' and by plugin '{_plugin}'"
                )
            found[name] = (obj, _plugin)

        before = set(found)
        try:
            impl.function(**{arg: register for arg in impl.argnames if arg == "register"})
        except PluginError:
            raise  # two plugins clash, or one breaks the contract: no registry would be right
        except Exception as exc:
            # One plugin's failure (an optional dependency missing, a bug) costs only its own
            # registrations, said once per process; the others keep working.
            for name in set(found) - before:
                del found[name]
            if report:
                _report_broken(plugin_name, hook_name, exc)
            continue
        if os.environ.get("AUTOTUNE_TRACE_PLUGINS"):
            # The register_* hooks are called here, not through pluggy's hook caller (the
            # core owns the callback), so pluggy's monitoring would not see them.
            added = sorted(set(found) - before)
            print(f"autotune trace: {hook_name} of plugin '{plugin_name}' registered {added}", file=sys.stderr)
    return found


_broken: dict[tuple[str, str], str] = {}  # (plugin, hook) -> error, reported once


def _report_broken(plugin: str, hook_name: str, exc: Exception) -> None:
    if (plugin, hook_name) not in _broken:
        _broken[(plugin, hook_name)] = f"{type(exc).__name__}: {exc}"
        print(
            shown(f"autotune: plugin '{plugin}' failed in {hook_name} and is left out: {type(exc).__name__}: {exc}"),
            file=sys.stderr,
        )


def broken_plugins() -> list[dict[str, str]]:
    """Plugins whose hooks raised: each with the hook and the error (``autotune plugins`` shows them)."""
    return [{"plugin": p, "hook": h, "error": e} for (p, h), e in sorted(_broken.items())]


def get_backends() -> dict[str, Any]:
    """Every registered backend by name."""
    return {name: obj for name, (obj, _) in sorted(_collect("register_backends", "backend").items())}


_engine_models: tuple[int, dict[str, Any]] | None = None


def get_engine_models() -> dict[str, Any]:
    """Every installed engine model, by engine name (``register_engine_models``); gathered once
    per set of plugins, as the twin's physics asks for them in its inner loops."""
    global _engine_models
    load_plugins()
    if _engine_models is None or _engine_models[0] != _version:
        found = {name: obj for name, (obj, _) in sorted(_collect("register_engine_models", "engine model").items())}
        _engine_models = (_version, found)
    return dict(_engine_models[1])


# Every installed plugin, registered or not: engine models are read from all of them.
_installed: dict[str, Any] | None = None  # their engine models, read once
_installed_models: tuple[int, dict[str, Any]] | None = None


def installed_engine_models() -> dict[str, Any]:
    """The registered engine models over those of every installed plugin, loaded or not (an
    allow-list, or autoloading off under tests): what an engine is does not depend on which
    backends a process registered, so the twin, a replay and a test with no engine plugin
    registered know the same engines. A plugin that fails to load is reported by
    ``load_plugins`` when it is loaded for its backends, and only left out here."""
    global _installed, _installed_models
    load_plugins()
    if _installed is None:
        every = pluggy.PluginManager("autotune")
        every.add_hookspecs(hookspecs)
        for ep in _entry_points():
            try:
                every.register(ep.load(), name=ep.name)
            except Exception:  # noqa: BLE001 - reported where it is loaded for its backends
                continue
        found = _collect("register_engine_models", "engine model", every, report=False)
        _installed = {name: obj for name, (obj, _) in sorted(found.items())}
    if _installed_models is None or _installed_models[0] != _version:
        _installed_models = (_version, {**_installed, **get_engine_models()})
    return _installed_models[1]


def get_engine_model(name: str) -> Any:
    """One engine's model; an unknown name is a ``ConfigError`` listing the installed ones."""
    return _one("engine model", name, get_engine_models())


def get_metrics() -> dict[str, Any]:
    """Every registered metric by name."""
    return {name: obj for name, (obj, _) in sorted(_collect("register_metrics", "metric").items())}


def get_strategies() -> dict[str, Any]:
    """Every registered search strategy by name (``[study] sampler``)."""
    return {name: obj for name, (obj, _) in sorted(_collect("register_strategies", "strategy").items())}


def _one(kind: str, name: str, found: dict[str, Any]) -> Any:
    if name not in found:
        raise UnknownNameError(f"{kind} '{name}' is not installed (installed: {', '.join(found) or 'none'})")
    return found[name]


def get_strategy(name: str) -> Any:
    """One search strategy by name, or an error listing the installed ones."""
    return _one("strategy", name, get_strategies())


def get_backend(name: str) -> Any:
    """One backend by name, or an error listing the installed ones."""
    return _one("backend", name, get_backends())


def get_metric(name: str) -> Any:
    """One metric by name, or an error listing the installed ones."""
    return _one("metric", name, get_metrics())


def describe() -> dict[str, list[dict[str, Any]]]:
    """What ``autotune plugins`` shows: each backend, metric and strategy with its plugin and
    distribution; a backend also with the weight formats and KV-cache types it declares, the
    ``[backends.NAME]`` settings it reads and its search dimensions and rules."""
    out: dict[str, list[dict[str, Any]]] = {"backends": [], "metrics": [], "strategies": [], "broken": []}
    # A backend that registers but cannot say what it declares (an optional dependency its
    # properties import): listed, and named under broken with its error, not a traceback for all.
    unlisted: list[dict[str, str]] = []
    for key, hook, kind in (
        ("backends", "register_backends", "backend"),
        ("metrics", "register_metrics", "metric"),
        ("strategies", "register_strategies", "strategy"),
    ):
        for name, (obj, plugin) in sorted(_collect(hook, kind).items()):
            out[key].append(
                {
                    "name": name,
                    "plugin": plugin,
                    "distribution": _sources.get(plugin, "?"),
                    "description": (getattr(obj, "description", "") or "").strip(),
                }
            )
            if key == "backends":
                try:
                    out[key][-1]["formats"] = [f.syntax for f in getattr(obj, "weight_formats", ())]
                    out[key][-1]["cache_types"] = [c.name for c in getattr(obj, "kv_cache_types", ())]
                except Exception as exc:  # noqa: BLE001 - a listing never fails on one backend
                    out[key][-1].update(formats=[], cache_types=[])
                    unlisted.append(
                        {"plugin": plugin, "hook": f"backend {name}", "error": f"{type(exc).__name__}: {exc}"}
                    )
                out[key][-1]["settings"] = [
                    {"name": s.name, "accepted": s.accepted(), "default": _setting_default(s.default), "help": s.help}
                    for s in getattr(obj, "settings", ())
                ]
                out[key][-1].update(_dimensions(obj))
                if "dimensions_error" in out[key][-1]:
                    unlisted.append(
                        {"plugin": plugin, "hook": f"backend {name}", "error": out[key][-1]["dimensions_error"]}
                    )
    out["broken"] = broken_plugins() + unlisted
    return out


def _dimensions(backend: Any) -> dict[str, Any]:
    """A backend's search dimensions ([space] keys) with their accepted values and what each
    means, and the rules it checks before launching: its ``search_dimensions()`` and
    ``search_rules()`` where it has them (the dimensions a study names only when it wants them:
    offload, micro-batch, split), else what ``parameters({})`` offers by default."""
    try:
        params = backend.search_dimensions() if hasattr(backend, "search_dimensions") else backend.parameters({})
        rules = list(backend.search_rules()) if hasattr(backend, "search_rules") else []
    except Exception as exc:  # noqa: BLE001 - a listing never fails on one backend
        return {"dimensions": [], "rules": [], "dimensions_error": f"{type(exc).__name__}: {exc}"}
    return {
        "dimensions": [
            {"name": p.name, "accepted": [_shown(v) for v in (p.accepted or p.choices)], "doc": p.doc} for p in params
        ],
        "rules": rules,
    }


def _setting_default(value: Any) -> Any:
    return [_shown(v) for v in value] if isinstance(value, (list, tuple)) else _shown(value)


def _shown(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def add_commands(cli: Any) -> None:
    """Let plugins add subcommands.

    Each plugin's ``register_commands`` is called on its own: one that raises is reported
    (stderr and ``autotune plugins``) and the commands it added before raising are taken back,
    so a half-registered command never runs and every other command keeps working. Through
    pluggy's single hook call one broken plugin made ``import autotune.cli`` fail.
    """
    load_plugins()
    impls = pm.hook.register_commands.get_hookimpls()
    if os.environ.get("AUTOTUNE_TRACE_PLUGINS"):
        # Called one by one here, not through pluggy's hook caller, which its monitoring sees.
        print(
            f"autotune trace: register_commands({{'cli': {cli!r}}}) -> {[i.plugin_name for i in impls]}",
            file=sys.stderr,
        )
    for impl in impls:
        before = dict(getattr(cli, "commands", {}))
        try:
            impl.function(**{arg: cli for arg in impl.argnames if arg == "cli"})
        except Exception as exc:
            commands = getattr(cli, "commands", None)
            if isinstance(commands, dict):
                commands.clear()
                commands.update(before)
            _report_broken(impl.plugin_name, "register_commands", exc)
