"""The twin's partial offload and mixture of experts (issue 27, item 4): the physics' pieces, the
twin-llama.cpp options, and the twin against the H200 offload probe (bench/results/offload_probe_h200).

The tolerances are where the data is (bench/twin_offload_check.py prints every point): dense
offload within 25% (held out: 1.18 at worst), MoE decode within 40% with experts placed by
n_cpu_moe (1.35 at worst), MoE prefill with every expert on the GPU within 30% (the MMQ tiles'
padding), and MoE prefill with host experts held to its order and to what explains its size: the
probe's prompt routes a ubatch to a steady share of the experts, not all of them. docs/twin.md
says why.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune_plugins.twin import TwinLlamaCpp, evidence, load_constants, offload, physics

PROBE = evidence.OFFLOAD


@pytest.fixture(scope="module")
def checked() -> list[tuple[evidence.Figure, float]]:
    engines, host, _ = load_constants()
    return evidence.h200_offload_predicted(engines, host)


def _ratios(checked, *, moe: bool, metric: str, role: str = "check", ngl: bool | None = None) -> dict[str, float]:
    return {
        f.id: pred / f.value
        for f, pred in checked
        if f.scenario.model.is_moe == moe
        and f.metric == metric
        and f.role == role
        and (ngl is None or isinstance(f.scenario.gpu_layers, int) == ngl)
    }


# ------------------------------------------------------------------------------ the physics' pieces


def test_distinct_experts_is_k_for_one_token_and_all_of_them_for_a_large_batch():
    m = evidence.moe_probe_model()
    assert physics.distinct_experts(m, 1) == pytest.approx(8)
    assert physics.distinct_experts(m, 4) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 4))
    assert 8 < physics.distinct_experts(m, 4) < 32  # overlaps: fewer than 4 x 8
    assert physics.distinct_experts(m, 512) == pytest.approx(128, rel=1e-9)
    # Active parameters: the non-expert ones and 8 of 128 experts per layer.
    experts = m.n_layers * physics.expert_params_per_layer(m)
    assert physics.active_linear_params(m) == pytest.approx(physics.linear_params(m) - experts * 120 / 128)


def test_the_moe_weights_match_the_probe_files_logged_buffers():
    """The qwen3moe GGUF's bytes (the plan with the experts stacked, plus the F32 router) against
    what llama.cpp logged for the file: all of it (n_cpu_moe 0) and its non-expert part on the
    GPU (n_cpu_moe 12, the head and 12 layers' attention and router)."""
    model = evidence.moe_probe_model()
    w = evidence.moe_gguf_weights(model, "Q4_K_M")
    runs = {
        json.dumps(r["case"], sort_keys=True): r["buffers_mib"]
        for r in map(json.loads, (PROBE / "offload_moe.jsonl").read_text().splitlines())
    }
    all_gpu = runs[json.dumps({"ncmoe": "0", "ub": "512"}, sort_keys=True)]
    assert w.total_bytes / 2**20 == pytest.approx(all_gpu["CUDA0 model"] + all_gpu["CPU_Mapped model"], rel=0.005)
    s = evidence.offload_scenario("q30a3b12-Q4_K_M.gguf", {"ncmoe": "12"}, 512, 64)
    where = physics.placement(s, model.n_layers)
    no_experts = runs[json.dumps({"ncmoe": "12", "ub": "512"}, sort_keys=True)]["CUDA0 model"]
    assert where.gpu_expert_bytes == 0
    assert where.gpu_dense_bytes / 2**20 == pytest.approx(no_experts, rel=0.05)


def test_ngl_counts_the_output_head_as_llama_cpp_does():
    s = evidence.offload_scenario("q7b-Q4_K_M.gguf", {"ngl": "7"}, 512, 64)
    k = load_constants()[0]["llama.cpp"]
    mem = physics.memory(s, k)
    assert physics.gpu_layer_split(s, k, mem) == 6
    assert physics.placement(s, 6).head_on_gpu
    none = replace(s, gpu_layers=0)
    assert physics.gpu_layer_split(none, k, mem) == 0 and not physics.placement(none, 0).head_on_gpu
    assert physics.gpu_layer_split(replace(s, gpu_layers=29), k, mem) == 28


def test_experts_on_the_host_slow_decode_and_a_larger_ubatch_speeds_prefill_only_with_host_weights():
    engines, host, _ = load_constants()
    k = engines["llama.cpp"]
    base = evidence.offload_scenario("q30a3b12-Q4_K_M.gguf", {}, 1477, 64)
    speeds = [physics.predict(replace(base, n_cpu_moe=n), k, host) for n in (0, 4, 8, 12)]
    assert all(a.decode_tok_s > b.decode_tok_s for a, b in zip(speeds, speeds[1:]))
    assert [p.host_expert_layers for p in speeds] == [0, 4, 8, 12]
    on_host = replace(base, n_cpu_moe=12)
    assert (
        physics.predict(replace(on_host, ubatch=2048), k, host).prefill_tok_s
        > 2 * physics.predict(on_host, k, host).prefill_tok_s
    )  # 3 crossings of the experts -> 1
    # Every expert on the GPU: a larger ubatch fills more of each expert's 128-column tile.
    small, large = (physics.predict(replace(base, ubatch=ub), k, host).prefill_tok_s for ub in (512, 2048))
    assert 1.5 < large / small < 2.5
    dense = evidence.offload_scenario("q7b-Q4_K_M.gguf", {}, 1477, 64)
    assert physics.predict(replace(dense, ubatch=2048), k, host).prefill_tok_s == pytest.approx(
        physics.predict(dense, k, host).prefill_tok_s, rel=1e-9
    )  # no experts, nothing crosses
    # More streams route to more experts: an 8-stream step reads more expert bytes than one.
    one = physics.step_terms(base, k, host, 1, 1500, base.model.n_layers)["memory"]
    eight = physics.step_terms(base, k, host, 8, 1500, base.model.n_layers)["memory"]
    assert eight > 2 * one


# ------------------------------------------------------------------------------ against the H200 probe


def test_dense_offload_points_within_25_percent(checked):
    for metric in ("decode_tok_s", "prefill_tok_s"):
        ratios = _ratios(checked, moe=False, metric=metric)
        assert len(ratios) == 7, metric  # ngl 7/14/28/999, ub 2048, --fit free and held
        bad = {k: round(r, 2) for k, r in ratios.items() if abs(r - 1) > 0.25}
        assert not bad, bad
        fitted = _ratios(checked, moe=False, metric=metric, role="fit")
        assert len(fitted) == 2 and all(abs(r - 1) < 0.05 for r in fitted.values())


def test_moe_decode_within_40_percent_with_experts_placed_by_n_cpu_moe(checked):
    ratios = _ratios(checked, moe=True, metric="decode_tok_s", ngl=False)
    assert len(ratios) == 12
    bad = {k: round(r, 2) for k, r in ratios.items() if abs(r - 1) > 0.40}
    assert not bad, bad
    # Whole MoE layers on the host (-ngl 6): the twin misses the CPU's cost of running a MoE
    # layer's many small operations (1.77x too fast on the one point measured).
    (whole,) = _ratios(checked, moe=True, metric="decode_tok_s", ngl=True).values()
    assert 1.0 < whole < 2.0


def test_moe_prefill_keeps_the_measured_order_and_its_host_experts_imply_a_steady_routed_share(checked):
    """With every expert on the GPU the twin is within 30% (the tiles' padding: 0.75 and 1.25).
    With host experts the twin copies all 128 experts per ubatch, as uniform routing would, and
    is 2-7x slow; what each point implies instead, at the dense crossings' rate, is a share of
    the experts that depends on the ubatch's size and not on how many layers' experts cross
    (0.12-0.22 per 512 tokens, 0.30-0.36 per 1477): the probe's prompt routes to few experts
    (bench/twin_probe_routing.py), not a faster link. The order holds: more experts on the
    host, slower; a larger ubatch, faster."""
    moe = {
        (f.scenario.n_cpu_moe, f.scenario.ubatch): (f.value, pred)
        for f, pred in checked
        if f.scenario.model.is_moe
        and f.metric == "prefill_tok_s"
        and f.source.endswith("offload_moe.jsonl")
        and f.scenario.gpu_layers == "all"
        and f.id.count("ncmoe=")
    }
    for ub in (512, 2048):
        measured = [moe[(n, ub)][0] for n in (0, 4, 8, 12)]
        twin = [moe[(n, ub)][1] for n in (0, 4, 8, 12)]
        assert measured == sorted(measured, reverse=True) and twin == sorted(twin, reverse=True)
        assert abs(moe[(0, ub)][1] / moe[(0, ub)][0] - 1) < 0.30
    for n in (4, 8, 12):
        assert moe[(n, 2048)][0] > moe[(n, 512)][0] and moe[(n, 2048)][1] > moe[(n, 512)][1]
    engines, host, _ = load_constants()
    shares: dict[int, list[float]] = {}
    for f, _pred in checked:
        share = evidence.implied_routed_share(f, engines["llama.cpp"], host)
        if share is not None:
            shares.setdefault(f.scenario.ubatch, []).append(share)
    assert sorted(shares) == [512, 2048] and len(shares[512]) == 6 and len(shares[2048]) == 3
    for ub, values in shares.items():
        assert 0.05 < min(values) and max(values) < 0.5 and max(values) / min(values) < 2.0, (ub, values)
    assert max(shares[512]) < min(shares[2048])  # more tokens per ubatch, more experts named


def test_llama_cpp_tiles_experts_against_the_whole_ubatch_and_offloads_from_32_tokens():
    assert [offload.mmq_tile_columns(b, 128) for b in (1, 8, 9, 100, 128, 512, 1477)] == [8, 8, 16, 104, 128, 128, 128]
    model = evidence.moe_probe_model()  # 8 of 128 experts: 32 tokens per expert in a 512-token ubatch
    assert offload.expert_tile_factor(model, 512, 128) == pytest.approx(4.0, rel=0.02)
    assert 1.3 < offload.expert_tile_factor(model, 1477, 128) < 1.5  # 92 per expert, a few need 2 tiles
    assert offload.expert_tile_factor(model, 512, 0) == 1.0
    assert offload.ubatch_sizes(1477, 512) == [512, 512, 453] and offload.ubatch_sizes(10, 512) == [10]
    engines, host, _ = load_constants()
    k = engines["llama.cpp"]
    on_host = replace(evidence.offload_scenario("q30a3b12-Q4_K_M.gguf", {}, 1477, 64), n_cpu_moe=12)
    # Under 32 tokens the CPU multiplies its experts, per token; from 32 the ubatch copies them over.
    cpu = physics.prefill_tok_s(replace(on_host, ubatch=31), k, host, on_host.model.n_layers)
    gpu = physics.prefill_tok_s(replace(on_host, ubatch=32), k, host, on_host.model.n_layers)
    assert cpu != gpu and cpu > 0 and gpu > 0
    # Decode: a 32-stream step copies the host experts it routes to instead of reading them on the CPU.
    n = on_host.model.n_layers
    t31 = physics.step_terms(on_host, k, host, 31, 1500, n)["host"]
    t32 = physics.step_terms(on_host, k, host, 32, 1500, n)["host"]
    routed = physics.placement(on_host, n).host_expert_bytes * physics.distinct_experts(on_host.model, 32) / 128
    assert t32 == pytest.approx(
        routed / (on_host.gpu.pcie_gb_s * 1e9 * host.host_pcie_efficiency)
        + 2 * 32 * on_host.model.hidden_size * 2 / (on_host.gpu.pcie_gb_s * 1e9),
        rel=1e-6,
    )
    assert t31 != pytest.approx(t32, rel=0.05)


# ------------------------------------------------------------------------------ twin-llama.cpp


def _moe_ctx(**settings) -> StudyContext:
    g = get_gpu("h200")
    return StudyContext(
        gpu=g,
        model=evidence.moe_probe_model(),
        workload=Workload(512, 64),
        vram_budget_bytes=g.vram_bytes,
        protocol=Protocol(warmup_runs=0, min_runs=1, max_runs=1),
        settings=settings,
    )


def _cfg(**options) -> TrialConfig:
    return TrialConfig(
        "twin-llama.cpp",
        "gguf:Q4_K_M",
        4096,
        1,
        tuple(sorted({"cache_type": "f16", "flash_attn": True, **options}.items())),
    )


def test_twin_llama_cpp_searches_gpu_layers_n_cpu_moe_and_ubatch():
    twin = TwinLlamaCpp()
    params = {
        p.name: p.choices
        for p in twin.parameters(
            {"gpu_layers": ["all", 10, -1, "most"], "n_cpu_moe": [0, 4, -2], "ubatch": [512, 2048, 0]}
        )
    }
    assert params["gpu_layers"] == ("all", 10) and params["n_cpu_moe"] == (0, 4) and params["ubatch"] == (512, 2048)
    assert {p.name for p in twin.parameters({})} == {"cache_type", "flash_attn"}
    ctx = _moe_ctx(host_threads=16)
    none, some = twin.run(_cfg(n_cpu_moe=0), ctx), twin.run(_cfg(n_cpu_moe=8, ubatch=2048), ctx)
    assert some.attrs["host_expert_layers"] == 8 and none.attrs["host_expert_layers"] == 0
    assert some.metrics["decode_tok_s"].median < none.metrics["decode_tok_s"].median
    line = twin.deploy_command(_cfg(n_cpu_moe=8, ubatch=2048, gpu_layers=10), ctx)
    assert " -ngl 10 --n-cpu-moe 8 -ub 2048 " in line and "3 of 12 layers run on the CPU" in line
    assert " -ngl 99 " in twin.deploy_command(_cfg(gpu_layers=13), ctx)  # 12 layers and the head: all
    # The trial's gpu_layers beats the setting; -ngl 0 runs everything on the host.
    assert twin.run(_cfg(gpu_layers=0), _moe_ctx(gpu_layers="all")).attrs["host_layers"] == 12


def test_twin_llama_cpp_refuses_experts_on_a_dense_model_and_bad_values():
    twin = TwinLlamaCpp()
    g = get_gpu("h200")
    dense = StudyContext(
        gpu=g,
        model=evidence.get_model("qwen2.5-7b"),
        workload=Workload(512, 64),
        vram_budget_bytes=g.vram_bytes,
        protocol=Protocol(),
        settings={},
    )
    # The rule of rules.toml, the same the llama-server backend checks (one place for both).
    assert any("n_cpu_moe 4: the model is dense" in r for r in twin.check(_cfg(n_cpu_moe=4), dense))
    assert any("ubatch 0" in r for r in twin.check(_cfg(ubatch=0), dense))
    assert any("gpu_layers 'auto'" in r for r in twin.check(_cfg(gpu_layers="auto"), dense))
    assert not twin.check(_cfg(n_cpu_moe=4, gpu_layers=13, ubatch=1024), _moe_ctx())


def test_host_threads_bound_the_host_only_when_known():
    engines, host, _ = load_constants()
    s = evidence.offload_scenario("q7b-Q4_K_M.gguf", {"ngl": "0"}, 512, 64)
    bounded = physics.host_rate(s, host)
    assert bounded == pytest.approx(16 * host.host_thread_gb_s * 1e9)
    assert physics.host_rate(replace(s, host_threads=None), host) == pytest.approx(
        s.gpu.host_mem_gb_s * 1e9 * host.host_bw_efficiency
    )
    assert math.isfinite(physics.predict(replace(s, host_threads=None), engines["llama.cpp"], host).decode_tok_s)


def test_the_twin_speaking_for_llama_server_is_told_its_threads():
    # On the H200 offload grids the twin, not told the server's -t 16, read host experts at the
    # whole host's bandwidth and over-predicted decode 2.7-4x (bench/results/offload_grids_h200).
    from autotune_plugins.llama_server.backend import LlamaServerBackend
    from autotune.study.predictor import predictor_for

    real, twin = LlamaServerBackend(), TwinLlamaCpp()
    config = replace(_cfg(n_cpu_moe=8), backend=real.name)
    for threads in (2, 16):
        ctx = _moe_ctx(threads=threads)
        predictor, predicted = predictor_for(real, config, ctx, {real.name: real, twin.name: twin})
        assert predictor is twin
        told = twin.predictor.predict(replace(config, backend=twin.name), _moe_ctx(host_threads=threads))
        assert predicted["decode_tok_s"] == pytest.approx(told["decode_tok_s"])
    untold = twin.predictor.predict(replace(config, backend=twin.name), _moe_ctx())
    assert predicted["decode_tok_s"] < untold["decode_tok_s"]
