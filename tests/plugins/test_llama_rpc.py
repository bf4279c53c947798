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

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import cpu_spec
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_gguf
from autotune.hardware.placement import CardsRequest, resolve_placement
from autotune_plugins.llama_server import memory, rpc, split
from autotune_plugins.llama_server.backend import LlamaServerBackend, parse_log
from autotune_plugins.llama_server.formats import gguf_file_weights
from tests.conftest import shared_file
from tests.engine_fixtures import cpu_build

MiB = 2**20


@pytest.fixture(scope="module")
def build():
    found = cpu_build()
    if not rpc.binary_beside(found.server).is_file():
        pytest.skip(
            f"{rpc.binary_beside(found.server)} is missing: this llama.cpp build predates GGML_RPC; "
            "rebuild with `autotune engine build llama.cpp --force`"
        )
    return found


@pytest.fixture()
def stories(tmp_path) -> Path:
    dst = tmp_path / "stories260K.gguf"
    shutil.copy(shared_file("models/stories260K.gguf"), dst)
    return dst


def context(model: Path, n: int, build) -> StudyContext:
    placement = resolve_placement(CardsRequest(("cpu",) * n, (1.0,), (0.0,)))
    return StudyContext(
        gpu=cpu_spec(),
        model=model_from_gguf(model),
        workload=Workload(16, 8),
        vram_budget_bytes=placement.total_budget_bytes,
        protocol=Protocol(warmup_runs=0, min_runs=1, max_runs=1),
        settings={
            "threads": 1,
            "startup_timeout_s": 60,
            "binary": str(build.server),
            "pin_cores": False,
            "startup_facts": True,
        },
        base_dir=model.parent,
        for_gpu=False,
        placement=placement,
    )


def per_device(facts: dict, key: str, endpoints: list[str]) -> list[float]:
    """A buffer's MiB per RPC device, in the study's device order: each rpc-server serves one
    device, its RPC0, named with the server's endpoint (``RPC0[127.0.0.1:PORT]``)."""
    found = facts.get(key, {})
    return [sum(mib for name, mib in found.items() if name.endswith(f"[{e}]")) for e in endpoints]


# (devices, split mode, -ts, ctx, parallel, ubatch, flash attention)
CASES = [
    (2, "layer", "1,1", 256, 1, 512, True),
    (2, "layer", "3,1", 512, 2, 512, True),  # device 1 holds only the output layer
    (2, "layer", "1,1", 1024, 1, 256, False),
    (2, "layer", "2,3", 256, 4, 64, True),
    (3, "layer", "1,1,1", 1024, 1, 128, True),
    (3, "layer", "2,1,1", 512, 1, 512, True),
    (2, "none", None, 512, 2, 512, True),
]


@pytest.mark.parametrize(
    "n, mode, ts, ctx, parallel, ub, fa",
    CASES,
    ids=[f"{c[0]}dev-{c[1]}-{c[2]}-c{c[3]}x{c[4]}-ub{c[5]}-fa{int(c[6])}" for c in CASES],
)
def test_each_device_s_buffers_match_the_engine_s_log(build, stories, n, mode, ts, ctx, parallel, ub, fa):
    """Weights and KV cache exact per device (to the log's 0.01 MiB); each device's total never
    under the log by more than 5% (the judge must not admit what does not fit), and over it by
    at most the CPU compute model's own margin plus what a device with few layers does not
    copy (see the figures in split.pipeline_copies_bytes)."""
    import autotune_plugins.llama_server.startup_facts as llama_startup

    llama_startup._STARTUP_FACTS.clear()  # each case its own launch
    c = context(stories, n, build)
    options = {
        "cache_type": "f16",
        "flash_attn": fa,
        "split_mode": mode,
        "ubatch": ub,
        **({"tensor_split": ts} if ts else {}),
    }
    config = TrialConfig("llama-server", stories.name, ctx, parallel, tuple(sorted(options.items())))
    backend = LlamaServerBackend()
    model = model_from_gguf(stories)
    weights = gguf_file_weights(stories)
    estimate = split.device_estimate(model, weights, config, c, None, cuda=False)
    with backend._rpc_devices(c, stories.parent) as endpoints:
        facts = backend.startup_facts(config, c, False, stories.parent, 60)
    logged = {k: per_device(facts, k, endpoints) for k in ("model_buffer_mib", "kv_buffer_mib", "compute_buffer_mib")}
    assert sum(logged["model_buffer_mib"]) > 0, f"no buffer lines in the log: {facts}"
    # The model's compute buffer of a device, to take off its total: what split.estimate adds.
    cells, ubatch = 256 * -(-ctx // 256), min(ub, ctx * parallel)
    compute = memory.CPU_BUFFERS.bytes(model, cells, ubatch, fa)
    if mode == "layer":
        compute += split.pipeline_copies_bytes(model, cells, ubatch, fa)
        holds = {d for d in split.layer_devices(len(weights.per_layer_bytes), None, split.parse_ts(ts, n))[:-1]}
    else:
        holds = {0}
    for d in range(n):
        predicted = estimate.per_device_bytes[d] / MiB
        fixed = predicted - (compute / MiB if d in holds else 0)
        assert fixed == pytest.approx(logged["model_buffer_mib"][d] + logged["kv_buffer_mib"][d], abs=0.015), (d, facts)
        total = logged["model_buffer_mib"][d] + logged["kv_buffer_mib"][d] + logged["compute_buffer_mib"][d]
        assert predicted >= 0.95 * total - 0.01, (d, predicted, total, facts)
        assert predicted <= 1.6 * total + 0.05, (d, predicted, total, facts)


STUDY = """
[study]
name = "rpc"
seed = 0
sampler = "grid"
baseline = false
finish_top = 0

[hardware]
gpus = ["cpu", "cpu"]
vram_budget_gib = 1

[model]
ref = "stories260K.gguf"

[workload]
prompt_tokens = 16
output_tokens = 8

[measure]
warmup_runs = 0
min_runs = 1
max_runs = 1
max_seconds = 10

[[candidates]]
backend = "llama-server"
weights = ["stories260K.gguf"]

[space]
ctx = [256]
parallel = [1]
cache_type = ["f16"]
flash_attn = [true]

[backends.llama-server]
threads = 1
pin_cores = false
startup_timeout_s = 60
binary = "{binary}"
"""


def test_a_study_across_two_rpc_devices_searches_split_mode_and_ts(build, stories, tmp_path):
    """The study file names two CPU devices and no split dimension: split mode (layer, none,
    tensor) and -ts (from the two budgets) are searched; every trial runs llama-server on both
    devices."""
    import optuna

    from autotune.study.records import TrialRecord

    study = tmp_path / "rpc.toml"
    study.write_text(STUDY.replace("{binary}", str(build.server)), encoding="utf-8")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "from autotune.cli import main; main()",
            "study",
            str(study),
            "--storage",
            f"sqlite:///{tmp_path / 'rpc.db'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    said = run.stdout + run.stderr
    assert "2 devices, memory budget 1.50 GiB in all: device 0: CPU" in said, said[:600]
    assert "9 trials: 7 complete, 2 pruned, 0 failed" in said, said[-2000:]
    trials = optuna.load_study(study_name="rpc", storage=f"sqlite:///{tmp_path / 'rpc.db'}").get_trials()
    measured = [TrialRecord.of(t) for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    seen = set()
    for r in measured:
        argv = r.engine_facts["argv"]
        options = dict(r.config or {})
        assert argv[argv.index("-sm") + 1] == options["split_mode"]
        endpoints = argv[argv.index("--rpc") + 1].split(",")
        assert len(endpoints) == 2 and all(e.startswith("127.0.0.1:") for e in endpoints)
        # The deploy line is the measured command, with the deploy port and rpc-server's ports.
        deploy = r.deploy_command.split("  # ")[0].split()
        assert deploy[deploy.index("-sm") + 1] == options["split_mode"]
        assert deploy[deploy.index("--rpc") + 1] == "127.0.0.1:50052,127.0.0.1:50053"
        assert [a for a in deploy if a.startswith("-")] == [a for a in argv if a.startswith("-")]
        seen.add((options["split_mode"], options.get("tensor_split") if options["split_mode"] != "none" else None))
    # layer and tensor with each -ts candidate, and none once (its other -ts values are refused
    # unlaunched).
    assert seen == {(mode, ts) for mode in ("layer", "tensor") for ts in ("1,1", "3,2", "2,3")} | {("none", None)}, seen
