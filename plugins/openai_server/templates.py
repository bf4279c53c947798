"""Server templates: how to start one OpenAI-compatible engine, kept as data.

A template is a TOML file (the shipped ones sit in ``templates/`` beside this module, one per
engine, each citing the engine's documentation for its flags). It says:

* ``[template]``: ``command`` (a list of arguments with placeholders, rendered to an argument
  list and never given to a shell), ``ready`` (the health path), ``startup_timeout_s``,
  ``memory`` (``fraction``: the engine pre-allocates ``memory_fraction`` of the card, so
  admission uses that fraction; ``measured``: weights + KV, and the NVML peak is recorded),
  ``version`` (arguments that print the engine's version), ``docs``;
* ``[cache_type]`` and ``[flash_attn]``: each accepted value -> the arguments it becomes
  (``{cache_type}`` and ``{flash_attn}`` stand alone in ``command`` and expand to them);
* ``[options]``: further ``[space]`` keys -> arguments, ``{value}`` being the searched value;
* ``[api]``: how to reach it (``tokenize`` path and field, ``prompt`` as ``tokens`` or ``text``,
  ``request``: fields every completion carries, ``logprobs``: ``echo``, ``next_token`` or
  ``none``, with ``logprobs_note`` saying why);
* ``[server_metrics]``: the engine's ``/metrics`` counters (see
  :class:`autotune.measure.openai_api.ServerCounters`);
* ``[[rule]]``: configurations the engine refuses, in :mod:`autotune.engine.rules`' format.

:func:`load_template` checks all of it and reports every problem at once, each naming the file,
the field and what is accepted; :func:`render` turns a configuration into the argument list.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autotune._builtin import ConfigError, Rule, control_problem, load_rules
from autotune._builtin import ServerCounters

__all__ = ["PLACEHOLDERS", "SHIPPED_DIR", "Template", "load_template", "render", "shipped", "template_path"]

SHIPPED_DIR = Path(__file__).with_name("templates")

#: Every placeholder a command may hold, and what it becomes.
PLACEHOLDERS: Mapping[str, str] = {
    "weights": "the weights' absolute path (a file or a directory)",
    "weights_dir": "the directory that holds the weights",
    "weights_name": "the weights' file or directory name",
    "ctx": "the context of one sequence",
    "ctx_total": "ctx x parallel: the context all slots share",
    "ctx_input": "ctx - 1: the longest prompt a ctx-token sequence can hold",
    "ctx_paged": "parallel x pad256(ctx + 1): a cache of 256-token pages that holds parallel sequences of ctx "
    "tokens, as exllamav3 reserves them (a job's prompt and response plus one token)",
    "parallel": "sequences served at once",
    "cache_type": "the KV-cache type's arguments, from [cache_type] (a whole argument)",
    "flash_attn": "flash attention's arguments, from [flash_attn] (a whole argument)",
    "port": "the TCP port",
    "host": "the address it listens on",
    "gpu": "the card, as CUDA_VISIBLE_DEVICES names it ('' without a GPU)",
    "memory_fraction": "the share of the card's memory the engine may pre-allocate",
}
#: Placeholders that expand to zero or more arguments, so they must be an argument of their own.
SPLICED = ("cache_type", "flash_attn")
_PLACEHOLDER_RX = re.compile(r"\{([^{}]*)\}")
_FIELDS = {
    "template": {
        "name",
        "engine",
        "docs",
        "command",
        "ready",
        "startup_timeout_s",
        "memory",
        "memory_fraction",
        "version",
        "weights",
        "notes",
    },
    "api": {"tokenize", "tokenize_field", "tokenize_add_special", "prompt", "request", "logprobs", "logprobs_note"},
    "server_metrics": {"path", "generated_tokens", "decode_tokens", "decode_seconds", "note"},
}
_TABLES = {"template", "cache_type", "flash_attn", "options", "api", "server_metrics", "rule"}


@dataclass(frozen=True)
class Template:
    """One engine's template, checked (see the module docstring for each field)."""

    name: str
    source: str
    command: tuple[str, ...]
    engine: str = "openai-api"
    docs: str = ""
    ready: str = "/health"
    startup_timeout_s: float = 300.0
    memory: str = "measured"
    memory_fraction: float | None = None
    version: tuple[str, ...] = ()
    weights: str = "file"
    cache_type: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    flash_attn: Mapping[bool, tuple[str, ...]] = field(default_factory=dict)
    options: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    tokenize: str | None = None
    tokenize_field: str = "prompt"
    tokenize_add_special: str | None = None
    prompt: str = "text"
    request: Mapping[str, Any] = field(default_factory=dict)
    logprobs: str = "none"
    logprobs_note: str = ""
    metrics_path: str | None = None
    counters: ServerCounters = ServerCounters()
    rules: tuple[Rule, ...] = ()


def shipped() -> list[str]:
    """Names of the templates that ship with autotune."""
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.toml"))


def template_path(ref: str, base_dir: Path) -> Path:
    """A shipped template's file (``"vllm"``), else a TOML file relative to the study file."""
    if (SHIPPED_DIR / f"{ref}.toml").is_file() and "/" not in ref and not ref.endswith(".toml"):
        return SHIPPED_DIR / f"{ref}.toml"
    p = Path(ref).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def _args(value: Any) -> tuple[str, ...] | None:
    """A list of strings (or a string split as a shell would, but never run by one)."""
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError:
            return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def check_command(command: Sequence[str], where: str) -> list[str]:
    """Problems of a command's placeholders (unknown ones; a spliced one inside an argument)."""
    problems = []
    if not command:
        problems.append(f"{where}: empty: name the server's executable and its arguments")
    for arg in command:
        for name in _PLACEHOLDER_RX.findall(arg):
            if name not in PLACEHOLDERS:
                problems.append(
                    f"{where}: unknown placeholder {{{name}}} in {arg!r} "
                    f"(accepted: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})"
                )
            elif name in SPLICED and arg != "{" + name + "}":
                problems.append(
                    f"{where}: {{{name}}} must be an argument of its own (it becomes the arguments "
                    f"[{name}] maps it to), not part of {arg!r}"
                )
    return problems


def _fragments(
    table: Any, where: str, keys_ok: Any, accepted: str, placeholders: Sequence[str] = ()
) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    out, problems = {}, []
    if not isinstance(table, dict):
        return {}, [f"{where}: must be a table of value = [arguments]"]
    for key, value in table.items():
        args = _args(value)
        if not keys_ok(key):
            problems.append(f"{where} {key}: not a value this table maps ({accepted})")
        elif args is None:
            problems.append(f"{where} {key} = {value!r}: must be a list of arguments (strings)")
        else:
            for arg in args:
                for name in _PLACEHOLDER_RX.findall(arg):
                    if name not in placeholders:
                        allowed = ", ".join("{" + p + "}" for p in placeholders) or "none"
                        problems.append(
                            f"{where} {key}: unknown placeholder {{{name}}} in {arg!r} (accepted here: {allowed})"
                        )
            out[key] = args
    return out, problems


def load_template(path: Path) -> Template:
    """Read and check one template file.

    Raises:
        ConfigError: Every problem of the file, each naming the file, the table and the field.
    """
    src = str(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        names = ", ".join(shipped())
        raise ConfigError(
            f"{src}: no such template file (shipped templates: {names}; or a TOML file relative to the study file)"
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{src}: unreadable template ({exc})") from None
    problems: list[str] = []
    for table in sorted(set(data) - _TABLES):
        problems.append(f"{src}: [{table}]: unknown table (accepted: {', '.join(sorted(_TABLES))})")
    for table, known in _FIELDS.items():
        raw = data.get(table, {})
        if not isinstance(raw, dict):
            problems.append(f"{src}: [{table}] must be a table")
            continue
        for key in sorted(set(raw) - known):
            problems.append(f"{src}: [{table}] {key}: unknown field (accepted: {', '.join(sorted(known))})")
    t = data.get("template", {}) if isinstance(data.get("template"), dict) else {}
    api = data.get("api", {}) if isinstance(data.get("api"), dict) else {}
    sm = data.get("server_metrics", {}) if isinstance(data.get("server_metrics"), dict) else {}

    command = _args(t.get("command"))
    if command is None:
        problems.append(f"{src}: [template] command: must be a list of arguments (strings)")
        command = ()
    problems += check_command(command, f"{src}: [template] command")
    memory = t.get("memory", "measured")
    if memory not in ("fraction", "measured"):
        problems.append(
            f"{src}: [template] memory = {memory!r}: must be 'fraction' (the engine pre-allocates "
            "memory_fraction of the card) or 'measured'"
        )
    fraction = t.get("memory_fraction")
    if fraction is not None and not (
        isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 < fraction <= 1
    ):
        problems.append(f"{src}: [template] memory_fraction = {fraction!r}: must be a number in (0, 1]")
    if memory == "fraction" and fraction is None:
        problems.append(f"{src}: [template] memory = 'fraction' needs memory_fraction (e.g. 0.9)")
    if any("{memory_fraction}" in a for a in command) and fraction is None:
        problems.append(f"{src}: [template] command uses {{memory_fraction}}: give memory_fraction")
    for key, kind in (("ready", str), ("name", str), ("docs", str), ("engine", str), ("notes", str)):
        if key in t and not isinstance(t[key], kind):
            problems.append(f"{src}: [template] {key} = {t[key]!r}: must be a string")
        elif key in t and control_problem(t[key]):  # each is printed in the deploy line's comment
            problems.append(f"{src}: [template] {key} = {t[key]!r}: {control_problem(t[key])}")
    if not str(t.get("ready", "/health")).startswith("/"):
        problems.append(f"{src}: [template] ready = {t.get('ready')!r}: must be a path such as /health or /v1/models")
    timeout = t.get("startup_timeout_s", 300.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        problems.append(f"{src}: [template] startup_timeout_s = {timeout!r}: must be a number of seconds > 0")
    version = _args(t.get("version", []))
    if version is None:
        problems.append(f"{src}: [template] version: must be a list of arguments")
    if t.get("weights", "file") not in ("file", "directory"):
        problems.append(f"{src}: [template] weights = {t.get('weights')!r}: must be 'file' or 'directory'")

    cache, p = _fragments(data.get("cache_type", {}), f"{src}: [cache_type]", lambda k: bool(k), "any cache-type name")
    problems += p
    flash_raw = data.get("flash_attn", {})
    flash, p = _fragments(flash_raw, f"{src}: [flash_attn]", lambda k: k in ("true", "false"), "true or false")
    problems += p
    options, p = _fragments(
        data.get("options", {}),
        f"{src}: [options]",
        lambda k: k not in ("ctx", "parallel", "cache_type", "flash_attn"),
        "a [space] key other than ctx, parallel, cache_type and flash_attn",
        ("value",),
    )
    problems += p
    if any(a == "{cache_type}" for a in command) and not cache:
        problems.append(f"{src}: [template] command uses {{cache_type}}: map each accepted type in [cache_type]")
    if any(a == "{flash_attn}" for a in command) and not flash:
        problems.append(f"{src}: [template] command uses {{flash_attn}}: map true and/or false in [flash_attn]")

    logprobs = api.get("logprobs", "none")
    if logprobs not in ("echo", "next_token", "none"):
        problems.append(
            f"{src}: [api] logprobs = {logprobs!r}: must be 'echo' (prompt log-probs through echo), "
            "'next_token' (one request per scored token) or 'none'"
        )
    if logprobs == "next_token" and not api.get("tokenize"):
        problems.append(f"{src}: [api] logprobs = 'next_token' needs a tokenize path")
    prompt = api.get("prompt", "text")
    if prompt not in ("tokens", "text"):
        problems.append(f"{src}: [api] prompt = {prompt!r}: must be 'tokens' or 'text'")
    if prompt == "tokens" and not api.get("tokenize"):
        problems.append(f"{src}: [api] prompt = 'tokens' needs a tokenize path")
    if not isinstance(api.get("request", {}), dict):
        problems.append(f"{src}: [api] request: must be a table of JSON fields")
    for key in ("tokenize", "tokenize_field", "tokenize_add_special", "logprobs_note"):
        if key in api and not isinstance(api[key], str):
            problems.append(f"{src}: [api] {key} = {api[key]!r}: must be a string")
    for key in _FIELDS["server_metrics"]:
        if key in sm and not isinstance(sm[key], str):
            problems.append(f"{src}: [server_metrics] {key} = {sm[key]!r}: must be a string")

    rules: list[Rule] = []
    try:
        rules = load_rules(path)
    except ConfigError as exc:
        problems.append(str(exc))
    known_options = {"ctx", "parallel", "cache_type", "flash_attn", *options}
    for rule in rules:
        for option, values in rule.when.items():
            if option not in known_options:
                problems.append(
                    f"{src}: [[rule]] {rule.name!r}: when {option}: not an option of this template "
                    f"(its options: {', '.join(sorted(known_options))})"
                )
            elif option == "cache_type":
                for v in values:
                    if v not in cache:
                        problems.append(
                            f"{src}: [[rule]] {rule.name!r}: when cache_type {v!r}: not in [cache_type] "
                            f"({', '.join(cache)})"
                        )
    if problems:
        raise ConfigError("\n".join(problems))
    return Template(
        name=str(t.get("name", path.stem)),
        source=src,
        command=command,
        engine=str(t.get("engine", "openai-api")),
        docs=str(t.get("docs", "")),
        ready=str(t.get("ready", "/health")),
        startup_timeout_s=float(timeout),
        memory=memory,
        memory_fraction=None if fraction is None else float(fraction),
        version=version or (),
        weights=str(t.get("weights", "file")),
        cache_type=cache,
        flash_attn={k == "true": v for k, v in flash.items()},
        options=options,
        tokenize=api.get("tokenize"),
        tokenize_field=str(api.get("tokenize_field", "prompt")),
        tokenize_add_special=api.get("tokenize_add_special"),
        prompt=prompt,
        request=dict(api.get("request", {})),
        logprobs=logprobs,
        logprobs_note=str(api.get("logprobs_note", "")),
        metrics_path=sm.get("path"),
        counters=ServerCounters(sm.get("generated_tokens"), sm.get("decode_tokens"), sm.get("decode_seconds")),
        rules=tuple(rules),
    )


def with_overrides(
    template: Template,
    *,
    command: Sequence[str] | None = None,
    ready: str | None = None,
    memory: str | None = None,
    memory_fraction: float | None = None,
    where: str = "[backends.openai-server]",
) -> Template:
    """The template with a study's own settings in place of its fields, checked the same way."""
    problems = []
    if command is not None:
        problems += check_command(command, f"{where} command")
    if ready is not None and not ready.startswith("/"):
        problems.append(f"{where} ready = {ready!r}: must be a path such as /health or /v1/models")
    fraction = memory_fraction if memory_fraction is not None else template.memory_fraction
    mem = memory or template.memory
    final_command = tuple(command) if command is not None else template.command
    if mem == "fraction" and fraction is None:
        problems.append(f"{where} memory = 'fraction': give memory_fraction (template {template.name} has none)")
    if any("{memory_fraction}" in a for a in final_command) and fraction is None:
        problems.append(f"{where}: the command uses {{memory_fraction}}: give memory_fraction")
    if any(a == "{cache_type}" for a in final_command) and not template.cache_type:
        problems.append(f"{where} command uses {{cache_type}} but template {template.name} maps no cache type")
    if any(a == "{flash_attn}" for a in final_command) and not template.flash_attn:
        problems.append(f"{where} command uses {{flash_attn}} but template {template.name} maps no flash_attn")
    if problems:
        raise ConfigError("\n".join(problems))
    return replace(template, command=final_command, ready=ready or template.ready, memory=mem, memory_fraction=fraction)


def render(
    template: Template,
    values: Mapping[str, Any],
    *,
    cache_type: str | None,
    flash_attn: bool | None,
    options: Mapping[str, Any] = {},
) -> list[str]:
    """The argument list of one configuration.

    Args:
        template: A checked template.
        values: Each scalar placeholder's value (``weights``, ``ctx``, ``port``...).
        cache_type: The KV-cache type (a key of ``[cache_type]``), or None when not searched.
        flash_attn: Flash attention on or off, or None when not searched.
        options: Further searched options mapped in ``[options]``.

    Raises:
        ConfigError: A value the template does not map (``check`` refuses these first).
    """
    argv: list[str] = []
    for arg in template.command:
        if arg == "{cache_type}":
            if cache_type is None:
                continue
            if cache_type not in template.cache_type:
                raise ConfigError(
                    f"{template.source}: [cache_type] has no {cache_type!r} "
                    f"(accepted: {', '.join(template.cache_type)})"
                )
            argv += template.cache_type[cache_type]
        elif arg == "{flash_attn}":
            if flash_attn is None:
                continue
            if flash_attn not in template.flash_attn:
                raise ConfigError(f"{template.source}: [flash_attn] has no {str(flash_attn).lower()}")
            argv += template.flash_attn[flash_attn]
        else:
            argv.append(_PLACEHOLDER_RX.sub(lambda m: str(values[m.group(1)]), arg))
    for name, value in sorted(options.items()):
        if name not in template.options:
            raise ConfigError(f"{template.source}: [options] has no {name!r} (accepted: {', '.join(template.options)})")
        argv += [a.replace("{value}", str(value)) for a in template.options[name]]
    return argv
