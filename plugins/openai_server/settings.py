"""What a study may set in ``[backends.openai-server]``, and the check of each value: read by
``OpenAIServerBackend.settings`` (``autotune plugins`` lists them), refused with the file, the
field and what is accepted."""

from __future__ import annotations

import re
import shlex
from typing import Any

from autotune.api import Setting
from autotune_plugins.openai_server.templates import shipped
from autotune_plugins.shared.common_settings import REQUEST_TIMEOUT_S, STABILITY_METRIC, positive, tcp_port

__all__ = ["SETTINGS"]


def _fraction(value: Any) -> str | None:
    return None if 0 < value <= 1 else "must be in (0, 1]"


def _args_problem(value: Any) -> str | None:
    if isinstance(value, list) and not all(isinstance(v, str) for v in value):
        return "must be a list of strings (one per argument) or one string split as a shell would"
    if isinstance(value, str):
        try:
            shlex.split(value)
        except ValueError as exc:
            return f"cannot be split into arguments ({exc})"
    return None


def _variable_problem(value: Any) -> str | None:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return (
            "must be the name of an environment variable (letters, digits, '_'), not the key itself: "
            "export the key under that name"
        )
    return None


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "template",
        str,
        "llama-server",
        "a shipped template (" + ", ".join(shipped()) + ") or a template TOML file, relative to the study file",
    ),
    Setting(
        "command",
        (str, list),
        None,
        "the server's command with placeholders, in place of the template's "
        "(a list of arguments; a string is split as a shell would, never run "
        "by one)",
        check=_args_problem,
    ),
    Setting("executable", str, None, "the engine's executable, in place of the command's first argument"),
    Setting("extra_args", (str, list), None, "arguments added after the template's command", check=_args_problem),
    Setting(
        "api_key_env",
        str,
        None,
        "the name (never the value) of an environment variable holding the "
        "server's API key: sent as 'Authorization: Bearer' with every request and handed to the engine "
        "under that name (vLLM reads VLLM_API_KEY, llama-server LLAMA_API_KEY)",
        check=_variable_problem,
    ),
    Setting("ready", str, None, "the health path polled until it answers 200 (default: the template's)"),
    Setting(
        "startup_timeout_s",
        float,
        None,
        "bound on the server's start, seconds (default: the template's)",
        check=positive,
    ),
    REQUEST_TIMEOUT_S,
    Setting(
        "memory",
        str,
        None,
        "memory model: 'fraction' (the engine pre-allocates memory_fraction of the "
        "card) or 'measured' (default: the template's)",
        choices=("fraction", "measured"),
    ),
    Setting(
        "memory_fraction",
        float,
        None,
        "the share of the card a pre-allocating engine takes (default: the template's)",
        check=_fraction,
    ),
    Setting("host", str, "127.0.0.1", "address of the deploy command's server, {host} (trials use 127.0.0.1)"),
    Setting("port", int, 8000, "port of the deploy command, {port} (trials use a free port)", check=tcp_port),
    STABILITY_METRIC,
    Setting("scoring_ctx", int, 2048, "context of the server that quality metrics score through", check=positive),
)
