"""Models that do not fit the card (issue 27): gpu_layers, n_cpu_moe, ubatch and batch as
llama-server's search dimensions; their rules, flags and the memory model's GPU/host split.

No engine here: the split is checked against llama.cpp's H200 start-up figures by
bench/offload_memory_check.py, and against a CPU engine by test_llama_memory.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from autotune.engine.backend import TrialConfig
from autotune.modelfiles.models import model_from_gguf
from autotune_plugins.llama_server import memory
from autotune_plugins.llama_server.backend import LlamaServerBackend
from autotune_plugins.llama_server.formats import gguf_file_weights
from autotune_plugins.llama_server.synth import SynthSpec, write_model
from tests.conftest import shared_file
from tests.plugins.test_llama_server_backend import cfg, make_ctx

MiB = 2**20
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
    context_length=8192,
)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("offload")
    shutil.copy(shared_file("models/stories260K.gguf"), root / "stories260K.gguf")
    write_model(MOE, root / "moe.gguf", vocab_from=root / "stories260K.gguf", seed=0)
    return root


def test_the_dimensions_are_offered_only_when_named(files):
    b = LlamaServerBackend()
    assert {p.name for p in b.parameters({})} == {"cache_type", "flash_attn"}  # today's space, unchanged
    params = {
        p.name: p
        for p in b.parameters(
            {"gpu_layers": ["all", 3, -1, 2.5], "n_cpu_moe": [0, 2, -1, "x"], "batch": [1024, 0], "ubatch": [256]}
        )
    }
    assert params["gpu_layers"].choices == ("all", 3)
    assert params["n_cpu_moe"].choices == (0, 2)
    assert params["batch"].choices == (1024,) and params["ubatch"].choices == (256,)


def test_flags_are_what_was_measured(files):
    b = LlamaServerBackend()
    c = make_ctx(files / "moe.gguf")
    plain = b.server_argv(cfg("moe.gguf"), c, binary="llama-server", port=1, has_gpu=True)
    assert "-ngl" in plain and plain[plain.index("-ngl") + 1] == "999"
    assert "--n-cpu-moe" not in plain and "-b" not in plain
    argv = b.server_argv(
        cfg("moe.gguf", gpu_layers=3, n_cpu_moe=2, batch=1024, ubatch=256),
        c,
        binary="llama-server",
        port=1,
        has_gpu=True,
    )
    assert argv[argv.index("-ngl") + 1] == "3" and argv[argv.index("--n-cpu-moe") + 1] == "2"
    assert argv[argv.index("-b") + 1] == "1024" and argv[argv.index("-ub") + 1] == "256"
    deployed = b.deploy_command(cfg("moe.gguf", gpu_layers=3, n_cpu_moe=2), c)
    assert "-ngl 3" in deployed and "--n-cpu-moe 2" in deployed
    every = b.server_argv(cfg("moe.gguf", gpu_layers="all"), c, binary="llama-server", port=1, has_gpu=True)
    assert every[every.index("-ngl") + 1] == "999"


def test_rules_refuse_what_llama_cpp_ignores_or_clamps(files):
    b = LlamaServerBackend()
    moe, dense = make_ctx(files / "moe.gguf"), make_ctx(files / "stories260K.gguf")
    n = model_from_gguf(files / "moe.gguf").n_layers
    assert b.check(cfg("moe.gguf", n_cpu_moe=n, gpu_layers=n + 1, ubatch=512, batch=512), moe) == []
    assert b.check(cfg("moe.gguf", n_cpu_moe=n + 1), moe) == [
        f"n_cpu_moe {n + 1} exceeds the model's {n} layers: the same as n_cpu_moe = {n}"
    ]
    (why,) = b.check(cfg("moe.gguf", gpu_layers=n + 2), moe)
    assert f"gpu_layers {n + 2} exceeds the model's {n} layers" in why and '"all"' in why
    (why,) = b.check(cfg("stories260K.gguf", n_cpu_moe=1), dense)
    assert why.startswith("n_cpu_moe 1: the model is dense")
    assert b.check(cfg("stories260K.gguf", n_cpu_moe=0), dense) == []
    (why,) = b.check(cfg("moe.gguf", ubatch=1024, batch=512), moe)
    assert why.startswith("ubatch 1024 exceeds batch 512")
    (why,) = b.check(cfg("moe.gguf", ubatch=4096), moe)  # -b defaults to 2048
    assert why.startswith("ubatch 4096 exceeds batch 2048")


def test_placement_follows_llama_cpp():
    # i_gpu_start = max(n_layer + 1 - ngl, 0): the head from ngl 1, then the last layers
    assert memory.placement(28, 0) == (range(28, 28), False)
    assert memory.placement(28, 1) == (range(28, 28), True)
    assert memory.placement(28, 7) == (range(22, 28), True)
    assert memory.placement(28, 29) == memory.placement(28, 999) == memory.placement(28, None) == (range(0, 28), True)


def test_the_split_moves_bytes_between_the_card_and_the_host(files):
    path = files / "moe.gguf"
    model, w = model_from_gguf(path), gguf_file_weights(path)
    assert model.is_moe and all(e > 0 for e in w.per_layer_expert_bytes)
    assert all(e < layer for e, layer in zip(w.per_layer_expert_bytes, w.per_layer_bytes))

    def est(**kw):
        return memory.estimate(model, w, 1024, 1, "f16", True, **kw)

    whole = est()
    assert whole.host_bytes == w.embedding_bytes and whole.weights_bytes == w.gpu_bytes
    assert whole.host_buffers_bytes == 512 * (2 * model.hidden_size * 4 + 1024 * 2)
    for k in range(model.n_layers + 1):
        e = est(n_cpu_moe=k)
        moved = sum(w.per_layer_expert_bytes[:k])
        # the first k layers' experts go to the host, nothing else moves; the card's weights
        # and the host's add up to the file (tensor for tensor)
        assert (e.weights_bytes, e.host_bytes) == (whole.weights_bytes - moved, whole.host_bytes + moved)
        assert e.kv_bytes == whole.kv_bytes
        # a staged host expert matrix never shrinks the card's compute buffer (on this tiny
        # model its activations dwarf the matrix, so the peak is the whole-GPU one)
        assert e.buffers_bytes >= whole.buffers_bytes
    assert est(n_cpu_moe=99).weights_bytes == est(n_cpu_moe=model.n_layers).weights_bytes
    # -ngl 2 of 4 layers: the head and the last layer on the card, its cache too
    e = est(gpu_layers=2)
    assert e.weights_bytes == w.per_layer_bytes[3] + w.output_bytes + w.other_bytes
    assert (
        e.kv_bytes == whole.kv_bytes // 4 and e.host_bytes == w.total_bytes - e.weights_bytes + 3 * whole.kv_bytes // 4
    )
    none = est(gpu_layers=0)
    assert none.weights_bytes == 0 and none.kv_bytes == 0 and none.host_bytes == w.total_bytes + whole.kv_bytes
    assert est(gpu_layers=0, ubatch=16).buffers_bytes < none.buffers_bytes  # below 32 tokens nothing is staged
    assert est(ubatch=1024, batch=256).buffers_bytes == est(ubatch=256).buffers_bytes  # -ub is clamped to -b


def test_the_backend_estimates_the_configurations_split(files, monkeypatch):
    from autotune_plugins.llama_server import backend as lsb

    monkeypatch.setattr(lsb, "_has_gpu", lambda: True)
    b = LlamaServerBackend()
    c = make_ctx(files / "moe.gguf")
    whole = b.estimate_memory(cfg("moe.gguf"), c)
    assert b.estimate_memory(cfg("moe.gguf", gpu_layers="all", n_cpu_moe=0), c).weights_bytes == whole.weights_bytes
    some = b.estimate_memory(cfg("moe.gguf", n_cpu_moe=2), c)
    assert some.weights_bytes < whole.weights_bytes and some.host_bytes > whole.host_bytes
    zero = b.estimate_memory(cfg("moe.gguf", gpu_layers=0), c)
    assert zero.weights_bytes == 0 and zero.overhead_bytes > 0  # a CUDA context all the same


def test_the_judge_checks_the_host_part_against_host_memory(files, monkeypatch):
    from autotune.hardware import gpus as hardware
    from autotune.study.admission import ADMITTED, OVER_BUDGET, Admission
    from autotune_plugins.llama_server import backend as lsb

    monkeypatch.setattr(lsb, "_has_gpu", lambda: True)
    b = LlamaServerBackend()
    c = make_ctx(files / "moe.gguf")
    on_host = cfg("moe.gguf", gpu_layers=0)
    host = b.estimate_memory(on_host, c)
    need = host.host_bytes + host.host_buffers_bytes
    monkeypatch.setattr(hardware, "host_memory_bytes", lambda: need)
    assert Admission.for_backend(b, c).judge(on_host).kind == ADMITTED  # exactly full: fits
    monkeypatch.setattr(hardware, "host_memory_bytes", lambda: need - 1)
    verdict = Admission.for_backend(b, c).judge(on_host)
    assert verdict.kind == OVER_BUDGET and "in host memory >" in verdict.reason
    # the whole model on the card leaves only the embeddings and pinned buffers on the host
    assert Admission.for_backend(b, c).judge(cfg("moe.gguf")).kind == ADMITTED


def test_the_split_against_the_h200_probe():
    """bench/offload_memory_check.py's table, held: the recorded H200 launches (no GPU here)."""
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("offload_memory_check", REPO / "bench" / "offload_memory_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    rows = check.rows()
    assert len(rows) == 19

    def err(pair):
        return abs(pair[0] - pair[1]) / pair[1] if pair[1] else abs(pair[0])

    for probe, case, model, kv, compute, host, logged, nvml in rows:
        assert err(model) < 0.0005 and err(kv) < 0.0005, (probe, case)  # the log's 2 decimals
        if "q30a3b12" in probe:  # the MoE: every GPU buffer, and NVML within 2%
            assert err(compute) < 0.02 and err(logged) < 0.002 and err(nvml) < 0.02, (probe, case)
        else:  # dense: never under the compute buffer; NVML's unexplained share grows with host layers
            assert -0.001 < (compute[0] - compute[1]) / compute[1] < 0.08 and err(logged) < 0.04, (probe, case)
            assert nvml[1] is None or err(nvml) < 0.07, (probe, case)


def test_the_lightest_split_is_one_the_judge_admits(files, monkeypatch):
    from autotune.hardware import gpus as hardware
    from autotune.engine.backend import Param
    from autotune.study.admission import ADMITTED, OVER_BUDGET, Admission
    from autotune_plugins.llama_server import backend as lsb

    monkeypatch.setattr(lsb, "_has_gpu", lambda: True)
    b = LlamaServerBackend()
    c = make_ctx(files / "moe.gguf")
    whole = b.estimate_memory(cfg("moe.gguf", gpu_layers="all"), c)
    # Room on the host for the embeddings and buffers, not for the layers -ngl 0 leaves there:
    # the smaller card footprint (-ngl 0) is refused, so the lightest is the whole model.
    monkeypatch.setattr(hardware, "host_memory_bytes", lambda: whole.host_bytes + whole.host_buffers_bytes)
    judge = Admission.for_backend(b, c)
    params = [Param("gpu_layers", (0, "all")), Param("cache_type", ("f16",)), Param("flash_attn", (True,))]
    config, verdict = judge.lightest(TrialConfig("llama-server", "moe.gguf", 256, 1), params)
    assert config.option("gpu_layers") == "all" and verdict.kind == ADMITTED
    monkeypatch.setattr(hardware, "host_memory_bytes", lambda: 1)
    config, verdict = Admission.for_backend(b, c).lightest(TrialConfig("llama-server", "moe.gguf", 256, 1), params)
    assert verdict.kind == OVER_BUDGET
    assert "never fit: even ctx 256 x 1 is infeasible: predicted" in judge.never_fits(config, verdict)
    assert "in host memory >" in judge.never_fits(config, verdict)
