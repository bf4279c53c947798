"""What a study may set in ``[backends.llama-server]``, and the check of each value: read by
``LlamaServerBackend.settings`` (``autotune plugins`` lists them), refused with the file, the
field and what is accepted; the speculative-decoding settings are :mod:`.speculation`'s."""

from __future__ import annotations

from typing import Any

from autotune.api import Setting
from autotune_plugins.llama_server import declarations, speculation
from autotune_plugins.llama_server.scoring import DEFAULT_SCORING_CTX
from autotune_plugins.shared.common_settings import REQUEST_TIMEOUT_S, STABILITY_METRIC, positive, tcp_port

__all__ = ["SETTINGS"]


INT32_MAX = declarations.INT32_MAX  # llama.cpp's -ngl, -ub, -b, --n-cpu-moe are C ints (std::stoi)


def _gpu_layers_problem(value: Any) -> str | None:
    if isinstance(value, str):
        return None if value == "all" else f'use "all" or a number of layers 0..{INT32_MAX}'
    return None if 0 <= value <= INT32_MAX else f'use "all" or a number of layers 0..{INT32_MAX}'


def _host_problem(value: Any) -> str | None:
    return None if value.strip() and not any(c.isspace() for c in value) else "must be an address such as 127.0.0.1"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "binary",
        str,
        None,
        "llama-server executable or its directory (default: AUTOTUNE_LLAMA_SERVER, "
        "else the newest `autotune engine build llama.cpp`, else PATH)",
    ),
    Setting(
        "threads", int, None, "CPU threads of the engine, -t (default: every core, os.cpu_count())", check=positive
    ),
    Setting(
        "gpu_layers",
        (str, int),
        "all",
        'layers on the GPU, -ngl: "all" (-ngl 999) or a number; '
        "0 on a machine without a GPU; a [space] gpu_layers overrides it",
        check=_gpu_layers_problem,
    ),
    Setting(
        "host",
        str,
        "127.0.0.1",
        'address llama-server listens on, --host ("0.0.0.0": every interface)',
        check=_host_problem,
    ),
    Setting("port", int, 8080, "port of the deploy command, --port (trials use a free port)", check=tcp_port),
    Setting(
        "pin_cores",
        bool,
        True,
        "when the machine has more cores than threads, pin llama-server to "
        "threads cores and autotune's load generator to the others",
    ),
    Setting(
        "startup_facts",
        bool,
        False,
        "record llama.cpp's start-up buffer sizes with each trial, from a short "
        "launch of their own at -lv 4 per weights file, after the measured one "
        "(the measured launch is at the default verbosity, as deployed)",
    ),
    Setting("startup_timeout_s", float, 120.0, "bound on loading the model, seconds", check=positive),
    REQUEST_TIMEOUT_S,
    STABILITY_METRIC,
    Setting(
        "scoring_ctx", int, DEFAULT_SCORING_CTX, "context of the in-process scorer for quality metrics", check=positive
    ),
    *speculation.SETTINGS,
)
