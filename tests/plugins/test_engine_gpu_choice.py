"""Each real engine is shown the study's one card, as the user's CUDA_VISIBLE_DEVICES names it:
the card autotune's telemetry reads (tests/test_gpu_mapping.py), and no other."""

from __future__ import annotations

import pytest

from autotune.engine.backend import StudyContext, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import resolve_model

from autotune_plugins.exllamav2.backend import ExLlamaV2Backend
from autotune_plugins.llama_server.backend import LlamaServerBackend


def study_ctx(gpu_index: int) -> StudyContext:
    return StudyContext(
        gpu=get_gpu("h200"),
        model=resolve_model("qwen2.5-27b-article"),
        workload=Workload(prompt_tokens=64, output_tokens=16),
        vram_budget_bytes=100 * 2**30,
        protocol=Protocol(),
        gpu_index=gpu_index,
    )


@pytest.mark.parametrize(
    "visible, gpu_index, engine_sees",
    [
        (None, 1, "1"),  # unset: CUDA's own number, in the order the engine inherits
        ("2", 0, "2"),  # the README's one-worker-per-GPU recipe, kept as written
        ("3, GPU-8f2c", 1, "GPU-8f2c"),  # several shown: only the study's one, not a split over both
    ],
)
def test_both_engines_see_the_study_s_one_card(monkeypatch, visible, gpu_index, engine_sees):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    ctx = study_ctx(gpu_index)
    assert LlamaServerBackend.cuda_devices(ctx, has_gpu=True) == engine_sees
    assert ExLlamaV2Backend.worker_env(ctx)["CUDA_VISIBLE_DEVICES"] == engine_sees


def test_a_gpu_index_past_the_shown_cards_is_a_preflight_problem(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    (problem,) = ExLlamaV2Backend().preflight(study_ctx(2))
    assert "CUDA_VISIBLE_DEVICES='1' shows 1 GPU(s) but [hardware] gpu_index is 2" in problem
