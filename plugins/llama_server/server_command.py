"""llama-server's command line, built in one place: each trial launches it and the deploy line
prints it, so what was measured is what is deployed. The default launch and llama.cpp's own
``--fit`` choice (the baselines) leave the engine's defaults alone; every other configuration
names each flag it searches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune._builtin import EngineUnavailableError, loopback
from autotune.api import StudyContext, TrialConfig, deploy_line
from autotune_plugins.llama_server import engine, rpc, speculation, split
from autotune_plugins.llama_server.engine_defaults import ENGINE_DEFAULTS, FIT
from autotune_plugins.llama_server.server import BUILD_REMEDY

__all__ = ["deploy_command", "flags", "server_argv"]


def flags(config: TrialConfig, ngl: int) -> list[str]:
    """The searched flags of ``config`` at ``-ngl ngl``; a dimension the space leaves out is not named."""
    cache = config.option("cache_type", "f16")
    out = [
        "-c",
        str(config.ctx * config.parallel),
        "-np",
        str(config.parallel),
        "-ngl",
        str(ngl),
        "-fa",
        "on" if config.option("flash_attn", True) else "off",
        "-ctk",
        cache,
        "-ctv",
        cache,
    ]
    ub = config.option("ubatch")
    if ub is not None:
        out += ["-ub", str(int(ub))]
    b = config.option("batch")
    if b is not None:
        out += ["-b", str(int(b))]
    moe = config.option("n_cpu_moe")
    if moe is not None:
        out += ["--n-cpu-moe", str(int(moe))]
    return out + split.flags(config)


def server_argv(
    backend: Any, config: TrialConfig, ctx: StudyContext, *, binary: str, port: int, has_gpu: bool
) -> list[str]:
    """The one place the server's command line is built: trials launch it, deploy prints it."""
    # A CPU study's RPC devices (split.py) are devices like cards: every launch is given them.
    devices = rpc.endpoints_flag(backend._rpc_endpoints(ctx))
    has_gpu = has_gpu or bool(devices)
    if config.option(ENGINE_DEFAULTS) == FIT:
        # llama.cpp's own choice (``baselines``): the user's -c/-np, --fit on and no -ngl, so
        # the fitting decides the offload; a study without a GPU keeps -ngl 0 as everywhere.
        return [
            binary,
            "-m",
            str(backend.weights_path(config.weights, ctx)),
            "-c",
            str(config.ctx * config.parallel),
            "-np",
            str(config.parallel),
            "--fit",
            "on",
            *(() if has_gpu else ("-ngl", "0")),
            *devices,
            "--host",
            str(backend.value(ctx, "host")),
            "--port",
            str(port),
            "--no-webui",
        ]
    if config.option(ENGINE_DEFAULTS):
        # The default launch (``default_launch``): no -c/-np/-ngl/-fa/-ctk/-t/--fit, so the engine's
        # own defaults apply (-ngl auto, --fit on: it chooses its offload, and where even that
        # cannot run, its log's reason is the failure's); a study without a GPU keeps -ngl 0 as
        # everywhere. --host/--port/--no-webui only say where it listens.
        return [
            binary,
            "-m",
            str(backend.weights_path(config.weights, ctx)),
            *(() if has_gpu else ("-ngl", "0")),
            *devices,
            "--host",
            str(backend.value(ctx, "host")),
            "--port",
            str(port),
            "--no-webui",
        ]
    # At the engine's default log verbosity, as deployed: -lv 4, which the start-up buffer
    # sizes need, logs trace lines per request and slot, and cost 9% of the aggregate at 8
    # slots on an H200 (bench/results/llama_verbosity). Those sizes come from a launch of
    # their own (startup_facts).
    return [
        binary,
        "-m",
        str(backend.weights_path(config.weights, ctx)),
        *flags(config, backend.layers_of(config, ctx, has_gpu)),
        *speculation.flags(config, lambda w: backend.weights_path(w, ctx), backend.resolved_settings(ctx)),
        *devices,
        "-t",
        str(backend.threads(ctx)),
        "--fit",
        "off",
        "--host",
        str(backend.value(ctx, "host")),
        "--port",
        str(port),
        "--no-webui",
    ]


def deploy_command(backend: Any, config: TrialConfig, ctx: StudyContext) -> str:
    has_gpu = backend._on_gpu(ctx)
    notes = [
        f"every flag but -m, -c, -np and --fit{'' if has_gpu else ' (and -ngl 0: no GPU)'} at "
        f"llama-server's default{': --fit chooses the offload' if has_gpu else ''}"
        if config.option(ENGINE_DEFAULTS) == FIT
        else f"every flag but -m{'' if has_gpu else ' (and -ngl 0: no GPU)'} at llama-server's default"
        if config.option(ENGINE_DEFAULTS)
        else f"-c is shared by the slots: ctx {config.ctx} x {config.parallel} slots"
    ]
    try:
        binary = str(backend.binary(ctx).absolute())
    except EngineUnavailableError:
        given = backend.value(ctx, "binary")
        binary = str(Path(given).expanduser().absolute()) if given else "llama-server"
        notes.append(
            f"llama-server not found: {BUILD_REMEDY}; it installs under "
            f"{engine.engines_dir()}/llama.cpp-<version>-<arch>/bin/"
        )
    argv = server_argv(backend, config, ctx, binary=binary, port=int(backend.value(ctx, "port")), has_gpu=has_gpu)
    host = str(backend.value(ctx, "host"))
    if loopback(host):
        notes.append(f'listens on {host} only; to serve other machines set [backends.llama-server] host = "0.0.0.0"')
    else:
        notes.append(f"listens on {host}")
    if split.rpc_device_count(ctx):
        notes.append(
            "its devices are rpc-servers, one per [hardware] gpus entry, started first: "
            + "; ".join(
                f"{rpc.binary_beside(Path(binary))} -H {e.replace(':', ' -p ')}" for e in backend._rpc_endpoints(ctx)
            )
        )
    devices = backend.cuda_devices(ctx, has_gpu)
    return deploy_line(argv, notes, None if devices is None else {"CUDA_VISIBLE_DEVICES": devices})
