"""One memory model per engine: the twin of llama.cpp predicts with llama-server's own (the one
within ~1% of NVML on an H200), and each twin engine takes its formula from its own description."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.errors import BackendError, ConfigError
from autotune.engine.formats import weights_for
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import get_model, model_from_gguf
from autotune_plugins.llama_server.backend import LlamaServerBackend
from autotune.engine.model import engine_models
from autotune_plugins.exllamav2.engine_model import buffer_bytes as exl2_buffer_bytes
from autotune_plugins.twin import TwinExllamaV2, TwinLlamaCpp, TwinVllm, _constants_doc, load_constants, physics

from tests.conftest import REPO

GiB = 2**30
STORIES = REPO / "tests" / "data" / "stories260K.gguf"


def context(gpu: str, model, tmp_path, **settings) -> StudyContext:
    g = get_gpu(gpu)
    return StudyContext(
        gpu=g,
        model=get_model(model) if isinstance(model, str) else model,
        workload=Workload(512, 128),
        vram_budget_bytes=g.vram_bytes,
        protocol=Protocol(),
        settings=settings,
        base_dir=tmp_path,
        for_gpu=True,
    )


# (card, model, weights, ctx, parallel, cache type, flash attention)
SAME = [
    ("h200", "qwen2.5-7b", "gguf:Q4_K_M", 4096, 4, "q8_0", True),  # issue 25's example
    ("h200", "qwen2.5-7b", "gguf:Q4_K_M", 4096, 4, "f16", False),
    ("h200", "qwen2.5-7b", "gguf:Q4_K_M", 4096, 1, "q4_0", True),
    ("h200", "qwen2.5-7b", "gguf:Q8_0", 600, 2, "f16", True),  # 2 slots of 768 cells each
    ("v100-16gb", "qwen2.5-27b-article", "gguf:Q4_K_M", 8192, 1, "f16", False),
    ("v100-16gb", "qwen2.5-27b-article", "gguf:Q3_K_M", 4096, 8, "q8_0", True),
    ("h200", "stories260K", str(STORIES), 256, 2, "f16", True),  # a real file's tensors
]


@pytest.mark.parametrize("gpu, model, weights, ctx, parallel, cache, fa", SAME)
def test_the_twin_and_llama_server_give_the_same_bytes(gpu, model, weights, ctx, parallel, cache, fa, tmp_path):
    study = context(gpu, model_from_gguf(STORIES) if model == "stories260K" else model, tmp_path)
    options = (("cache_type", cache), ("flash_attn", fa))
    twin = TwinLlamaCpp().estimate_memory(TrialConfig("twin-llama.cpp", weights, ctx, parallel, options), study)
    real = LlamaServerBackend().estimate_memory(TrialConfig("llama-server", weights, ctx, parallel, options), study)
    assert twin == real  # every part, and the notes that explain them


def test_the_issues_example_is_llama_servers_figure(engine_plugins):
    # qwen2.5-7b Q4_K_M, ctx 4096 x 4 slots, q8_0, flash attention: the twin's own formulas said
    # 4.89 GiB (a 256 MiB context, no mask); llama-server's model, within ~1% of NVML, says 5.26.
    m = get_model("qwen2.5-7b")
    s = physics.Scenario(
        "llama.cpp", get_gpu("h200"), m, weights_for(m, "gguf:Q4_K_M"), 4096, 4, "q8_0", True, 512, 128
    )
    k = load_constants()[0]["llama.cpp"]
    assert physics.memory(s, k).total_bytes / GiB == pytest.approx(5.26, abs=0.005)


def test_each_twin_engine_has_its_own_plugins_memory_model_and_constants():
    """The twin reads each engine's memory model and constants from that engine's plugin (its
    engine model), none from another engine's: one place per engine."""
    models = engine_models()
    owners = {name: type(m).memory.__module__ for name, m in models.items() if m.twin_name}
    assert owners == {
        "llama.cpp": "autotune_plugins.llama_server.engine_model",
        "exllamav2": "autotune_plugins.exllamav2.engine_model",
        "vllm": "autotune_plugins.openai_server.engine_model",
        "exllamav3": "autotune_plugins.exllamav3.engine_model",
    }
    for name, m in models.items():
        assert m.constants_file.parent == Path(sys.modules[type(m).__module__].__file__).parent
    doc = _constants_doc()
    broken = {**doc, "engines": {**doc["engines"], "vllm": {**doc["engines"]["vllm"], "memory_model": "exllama"}}}
    with pytest.raises(
        ConfigError,
        match=r"openai_server/engine_model.toml: \[constants\]: .*memory_model.*; accepted: "
        r"weight_bw_efficiency, ",
    ):
        load_constants(broken)


def test_twin_vllm_reserves_its_share_of_the_card_not_exllamav2s_scratch(tmp_path):
    vllm = TwinVllm()
    study = context("a100-80gb", "qwen2.5-7b", tmp_path)
    on = TrialConfig("twin-vllm", "gguf:Q4_K_M", 8192, 4, (("cache_type", "auto"), ("flash_attn", True)))
    off = replace(on, options=(("cache_type", "auto"), ("flash_attn", False)))
    mem_on, mem_off = vllm.estimate_memory(on, study), vllm.estimate_memory(off, study)
    # vLLM's footprint is --gpu-memory-utilization of the card, whatever the configuration needs.
    assert mem_on.total_bytes == int(0.9 * study.gpu.vram_bytes)
    # ExLlamaV2's formula sizes a 2048-token chunk's scratch and, unfused, its scores over the
    # cache: vLLM's estimate holds neither, and does not move with flash attention.
    exl2_scratch = exl2_buffer_bytes(vllm.scenario(on, study))
    assert exl2_scratch > 0 and mem_on.buffers_bytes == 0 and mem_on == mem_off
    assert exl2_buffer_bytes(vllm.scenario(off, study)) > exl2_scratch
    # The same configuration on twin-exllamav2 is sized by the other formula.
    exl2 = TwinExllamaV2().estimate_memory(
        TrialConfig("twin-exllamav2", "exl2:4.0", 8192, 4, (("cache_type", "fp16"), ("flash_attn", True))), study
    )
    assert exl2.buffers_bytes == exl2_buffer_bytes(
        TwinExllamaV2().scenario(
            TrialConfig("twin-exllamav2", "exl2:4.0", 8192, 4, (("cache_type", "fp16"), ("flash_attn", True))), study
        )
    )
    # A smaller share is a smaller footprint, and one that cannot hold the weights does not start.
    half = context("a100-80gb", "qwen2.5-7b", tmp_path, gpu_memory_utilization=0.5)
    assert vllm.estimate_memory(on, half).total_bytes == int(0.5 * study.gpu.vram_bytes)
    assert "--gpu-memory-utilization 0.5" in vllm.deploy_command(on, half)
    tiny = context("a100-80gb", "qwen2.5-7b", tmp_path, gpu_memory_utilization=0.05)
    with pytest.raises(BackendError, match="more than gpu_memory_utilization 0.05"):
        vllm.run(on, tiny)
