"""A tiny synthetic mixture of experts on a real CPU llama-server (issue 27, CI's share): the
offload flags reach the engine and leave its buffers as the memory model says, the rules refuse
what llama.cpp would ignore or clamp, and a study with n_cpu_moe, ubatch and batch in its space
runs end to end. On a CPU build the flags move nothing (every buffer is host memory already):
what they do to a GPU's memory is checked against the H200 probe (bench/offload_memory_check.py,
tests/plugins/test_llama_offload.py), their speed by the H200 runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from autotune.toolkit import processes
from autotune.engine.backend import TrialConfig
from autotune.config import load_study_config
from autotune.modelfiles.models import model_from_gguf
from autotune_plugins.llama_server import memory
from autotune_plugins.llama_server.backend import LlamaServerBackend, parse_log
from autotune_plugins.llama_server.formats import gguf_file_weights
from autotune_plugins.llama_server.synth import SynthSpec, write_model
from tests.conftest import plugin_registered, shared_file
from tests.engine_fixtures import cpu_build
from tests.plugins.test_llama_server_backend import make_ctx, servers_on

MiB = 2**20
# 4 layers of 16 experts, 4 used: a few MiB, a start-up of about a second.
MOE = SynthSpec(
    arch="qwen3moe",
    n_layers=4,
    hidden=256,
    n_heads=4,
    n_kv_heads=2,
    ffn=512,
    head_size=64,
    experts=16,
    experts_used=4,
    expert_ffn=256,
    context_length=4096,
)


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory) -> Path:
    cpu_build()  # skips (or fails in CI) without an engine
    root = tmp_path_factory.mktemp("moe-study")
    shutil.copy(shared_file("models/stories260K.gguf"), root / "stories260K.gguf")
    return write_model(MOE, root / "moe.gguf", vocab_from=root / "stories260K.gguf", seed=0).path


def test_the_engine_takes_the_offload_flags_and_its_buffers_are_the_models(moe_file):
    b = LlamaServerBackend()
    c = make_ctx(moe_file)
    model, weights = model_from_gguf(moe_file), gguf_file_weights(moe_file)
    config = TrialConfig(
        "llama-server",
        moe_file.name,
        1024,
        2,
        (
            ("batch", 256),
            ("cache_type", "f16"),
            ("flash_attn", True),
            ("gpu_layers", 3),
            ("n_cpu_moe", 2),
            ("ubatch", 128),
        ),
    )
    assert b.check(config, c) == []
    argv = b.server_argv(config, c, binary="llama-server", port=1, has_gpu=False)
    assert " -ngl 3 " in " ".join(argv) and "--n-cpu-moe 2" in " ".join(argv) and "-b 256" in " ".join(argv)
    server = b.launch(config, c, False, moe_file.parent, verbose=True)
    try:
        b.wait_ready(server, 60)
        logged = parse_log(server.log())
    finally:
        processes.stop(server.proc)
    assert servers_on(moe_file) == []
    predicted = memory.estimate(
        model, weights, 1024, 2, "f16", True, ubatch=128, batch=256, gpu=False, gpu_layers=3, n_cpu_moe=2
    )
    # The log prints MiB with 2 decimals: equal to that rounding.
    assert abs(sum(logged["model_buffer_mib"].values()) * MiB - predicted.weights_bytes) <= 0.006 * MiB
    assert abs(sum(logged["kv_buffer_mib"].values()) * MiB - predicted.kv_bytes) <= 0.006 * MiB
    assert logged["kv_cells"] == memory.LAYOUT.cells(1024, 2)
    compute = sum(logged["compute_buffer_mib"].values()) * MiB
    assert abs(predicted.buffers_bytes - compute) <= 0.006 * MiB, (predicted.buffers_bytes / MiB, compute / MiB)


def test_a_moe_study_searches_experts_and_micro_batches(moe_file, monkeypatch):
    import autotune_plugins.llama_server as llama_server
    from autotune.study.runner import run_study

    monkeypatch.setattr("autotune_plugins.llama_server.backend._has_gpu", lambda: False)
    study = moe_file.parent / "moe.toml"
    study.write_text(
        f"""[study]
name = "moe"
sampler = "grid"
baseline = false
finish_top = 0

[hardware]
gpu = "t4"

[model]
ref = "{moe_file}"

[workload]
prompt_tokens = 16
output_tokens = 8

[measure]
warmup_runs = 0
min_runs = 1
max_runs = 1

[[candidates]]
backend = "llama-server"
weights = ["{moe_file}"]

[space]
ctx = [256]
parallel = [1]
cache_type = ["f16"]
flash_attn = [true]
n_cpu_moe = [0, 2, 5]
ubatch = [64, 256]
batch = [128]

[backends.llama-server]
threads = 1
startup_timeout_s = 60
""",
        encoding="utf-8",
    )
    events = []
    with plugin_registered(llama_server, "llama_server"):
        summary = run_study(
            load_study_config(study),
            n_trials=6,
            storage=f"sqlite:///{moe_file.parent / 'moe.db'}",
            callback=events.append,
        )
    by = {(e.config["n_cpu_moe"], e.config["ubatch"]): e for e in events}
    # n_cpu_moe 5 and ubatch 256 break a rule in every configuration: refused once, before the
    # search, with the rule's reason (issue 41), not pruned trial by trial.
    assert set(by) == {(0, 64), (2, 64)} and all(e.state == "COMPLETE" for e in by.values()), [
        (k, e.state, e.reason) for k, e in by.items()
    ]
    excluded = "\n".join(summary.extra["excluded_before_search"])
    assert (
        "[space] n_cpu_moe = 5: refused in every configuration of this study: n_cpu_moe 5 exceeds the model's "
        "4 layers" in excluded
    )
    assert (
        "[space] ubatch = 256: refused in every configuration of this study: ubatch 256 exceeds batch 128" in excluded
    )
    deploy = summary.best["deploy_command"]
    assert "--n-cpu-moe" in deploy and "-b 128" in deploy and "-ub 64" in deploy  # as measured
    assert servers_on(moe_file) == []
