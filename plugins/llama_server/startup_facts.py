"""llama.cpp's start-up facts: the buffers it logs by device, the layers offloaded, the KV
cells, read from a short launch of their own at ``-lv 4`` (the measured launch runs at the
default verbosity, as deployed, which does not print them) and remembered per weights file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune._builtin import processes
from autotune.api import StudyContext, TrialConfig
from autotune_plugins.llama_server import split
from autotune_plugins.llama_server.engine_defaults import ENGINE_DEFAULTS
from autotune_plugins.llama_server.server import parse_log

__all__ = ["STARTUP_LOG_VERBOSITY", "WEIGHTS_FACTS", "startup_facts"]

# libllama's INFO lines (buffer sizes, offloaded layers) print at llama-server's "trace" level, 4
# (common/log.cpp, common_log_get_verbosity); the default, 3, leaves them out.
STARTUP_LOG_VERBOSITY = 4
# Start-up facts that depend only on the weights file, -ngl, --n-cpu-moe and the devices (--fit off):
# true of every configuration of that file, unlike the cache and compute buffers.
WEIGHTS_FACTS = frozenset({"model_buffer_mib", "offloaded_layers", "total_layers", "spilled"})
# (weights file, its mtime and size, -ngl, devices, binary, default-launch config) ->
# (the configuration launched, its start-up facts): one verbose launch per weights file.
_STARTUP_FACTS: dict[tuple[Any, ...], tuple[str, dict[str, Any]]] = {}


def startup_facts(
    backend: Any, config: TrialConfig, ctx: StudyContext, has_gpu: bool, log_dir: Path, startup_s: float
) -> dict[str, Any]:
    """What llama.cpp logs at start (buffer sizes by device, layers offloaded, KV cells),
    from a short launch of its own at ``-lv 4``: the measured launch runs at the default
    verbosity, which does not print them.

    One such launch per weights file, GPU layers and devices (per configuration for the
    default launch, whose ``--fit on`` decides the offload itself), made with the first
    configuration that needs it and remembered for the process. Every trial of that file
    gets the facts of the weights (model buffers, offloaded layers); the cache and compute
    buffers only the configuration that was launched, whose figures they are
    (``startup_facts_of`` names it in the others).

    Raises:
        BackendError: the launch failed (the engine's own words, at the verbose level).
    """
    path = backend.weights_path(config.weights, ctx)
    try:
        st = path.stat()
    except OSError:
        return {}  # the measured launch says what is wrong with the file
    ngl = (backend.layers_of(config, ctx, has_gpu), config.option("n_cpu_moe", 0))
    # The split decides each device's buffers, the model's too (split.py).
    ngl = (*ngl, *split.flags(config), split.rpc_device_count(ctx))
    key = (
        str(path.resolve()),
        st.st_mtime_ns,
        st.st_size,
        ngl,
        backend.cuda_devices(ctx, has_gpu),
        str(backend.binary(ctx).absolute()),
        config.key if config.option(ENGINE_DEFAULTS) else None,
    )
    hit = _STARTUP_FACTS.get(key)
    if hit is None:
        server = backend.launch(config, ctx, has_gpu, log_dir, verbose=True)
        try:
            backend.wait_ready(server, startup_s)
            facts = parse_log(server.log())
        finally:
            server.close()
            processes.stop(server.proc)
        facts.setdefault("spilled", False)
        if not has_gpu and not split.rpc_device_count(ctx):
            # Nowhere else to put a layer: nothing spilled. A build with the RPC backend logs
            # "offloaded 0/N layers to GPU" even then (it supports offload, to RPC devices).
            facts["spilled"] = False
        hit = _STARTUP_FACTS[key] = (config.key, facts)
    launched, facts = hit
    if launched == config.key:
        return dict(facts)
    return {**{k: v for k, v in facts.items() if k in WEIGHTS_FACTS}, "startup_facts_of": launched}
