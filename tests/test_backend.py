"""The backend contract's shared pieces: paths the study file names, the quality reference."""

from __future__ import annotations

from pathlib import Path

from autotune.engine.backend import StudyContext, Workload, quality_reference
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import get_model
from tests.fake_backends import FakeBackend


def ctx(base_dir) -> StudyContext:
    return StudyContext(
        gpu=get_gpu("t4"),
        model=get_model("qwen2.5-7b"),
        workload=Workload(10, 10),
        vram_budget_bytes=2**30,
        protocol=Protocol(),
        base_dir=base_dir,
    )


def test_paths_are_absolute_and_relative_to_the_study_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = ctx(Path("studies"))
    assert c.path("models/a.gguf") == tmp_path / "studies" / "models" / "a.gguf"
    assert c.path("/data/b.gguf") == Path("/data/b.gguf")
    assert c.path("~/c.gguf") == Path.home() / "c.gguf"


def test_the_default_quality_reference_is_the_most_precise_searched_setting(engine_plugins):
    # FakeBackend declares no cache types: the installed backends' (llama-server's here) rank its names.
    b = FakeBackend()
    assert quality_reference(
        b, {"cache_type": ("q4_0", "f16", "q8_0"), "flash_attn": (False, True), "mode": ("x", "y")}
    ) == {"cache_type": "f16", "flash_attn": True, "mode": "x"}
    assert quality_reference(b, {"flash_attn": (False,)}) == {"flash_attn": False}
    # A cache name the catalog does not know keeps the first searched value.
    assert quality_reference(b, {"cache_type": ("mystery",)}) == {"cache_type": "mystery"}
