"""The engine build a study names is the one it runs (issue 39 item 6): with
``[backends.llama-server] binary`` set, the header, every record and the resume's comparability
check read that binary's --version line, not the cached build's."""

from __future__ import annotations

import sys
from pathlib import Path

from autotune.engine.backend import StudyContext, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_gguf
from autotune_plugins.llama_server import engine
from autotune_plugins.llama_server.backend import LlamaServerBackend
from tests.conftest import shared_file


def versioned(directory: Path, build: int, commit: str) -> Path:
    """An executable that answers --version with its own build number."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "llama-server"
    path.write_text(f"#!{sys.executable}\nimport sys\nprint('version: {build} ({commit})', file=sys.stderr)\n")
    path.chmod(0o755)
    return path


def ctx_with(**settings) -> StudyContext:
    model = shared_file("models/stories260K.gguf")
    return StudyContext(
        gpu=get_gpu("t4"),
        model=model_from_gguf(model),
        workload=Workload(32, 16),
        vram_budget_bytes=15 * 2**30,
        protocol=Protocol(),
        settings=settings,
        base_dir=model.parent,
    )


def test_the_configured_binary_names_the_build_not_the_cached_one(tmp_path, monkeypatch):
    cached = versioned(tmp_path / "cache", 1111, "aaa1111")
    configured = versioned(tmp_path / "mine", 2222, "bbb2222")
    real_find = engine.find_llama_server

    def find(settings=None, **kwargs):  # the cached build wherever the study names none
        return Path(settings["binary"]) if settings and settings.get("binary") else cached

    monkeypatch.setattr(engine, "find_llama_server", find)
    backend = LlamaServerBackend()
    mine = backend.engine_build(ctx_with(binary=str(configured)))
    assert "2222" in mine and "1111" not in mine
    assert "1111" in backend.engine_build(ctx_with())
    assert "1111" in backend.engine_build(None)  # no study: the build found without settings
    monkeypatch.setattr(engine, "find_llama_server", real_find)
    # Where no build is cached and none is on PATH, the configured one is still named.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert "2222" in LlamaServerBackend().engine_build(ctx_with(binary=str(configured)))


def test_the_header_and_the_resume_check_read_the_configured_build(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from autotune.study.comparable import engines_of

    configured = versioned(tmp_path / "mine", 3333, "ccc3333")
    backend = LlamaServerBackend()
    ctx = ctx_with(binary=str(configured))
    prepared = SimpleNamespace(
        space=SimpleNamespace(entries={"llama-server": SimpleNamespace(backend=backend)}),
        contexts={"llama-server": ctx},
    )
    assert "3333" in engines_of(prepared)["llama-server"]
