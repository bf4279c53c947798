"""Shared fixtures. Plugin autoload is off in tests: each test registers what it needs."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import pytest

# Read by autotune.plugins.load_plugins: tests decide which plugins exist (as llm does).
sys._called_from_test = True  # type: ignore[attr-defined]

REPO = Path(__file__).resolve().parents[1]


def shared_file(relative: str) -> Path:
    """A file of the project's shared/ folder (test data kept outside the repository).

    Looked for under $AUTOTUNE_SHARED, then ../shared beside the checkout (where CI puts it),
    then /work/shared, then tests/data (the small files the tests cannot do without, shipped
    with their licences); the test is skipped when none has it.
    """
    roots = [os.environ.get("AUTOTUNE_SHARED"), REPO.parent / "shared", "/work/shared"]
    shipped = REPO / "tests" / "data" / Path(relative).name
    if shipped.is_file() and not any(root and (Path(root) / relative).is_file() for root in roots):
        return shipped
    for root in roots:
        if root and (Path(root) / relative).is_file():
            return Path(root) / relative
    pytest.skip(f"shared/{relative} is not available on this machine")


@pytest.fixture(autouse=True, scope="session")
def _artifacts_elsewhere(tmp_path_factory):
    """Artifacts made by tests go to a throwaway cache, never the user's ~/.cache/autotune/artifacts
    (subprocesses inherit the variable)."""
    from autotune.modelfiles.artifacts import ARTIFACTS_ENV

    before = os.environ.get(ARTIFACTS_ENV)
    os.environ[ARTIFACTS_ENV] = str(tmp_path_factory.mktemp("artifacts"))
    yield
    if before is None:
        os.environ.pop(ARTIFACTS_ENV, None)
    else:
        os.environ[ARTIFACTS_ENV] = before


@contextlib.contextmanager
def plugin_registered(module: object, name: str, source: str = "autotune"):
    """Register a plugin as its entry point would, and always unregister it afterwards."""
    from autotune import plugins

    plugins.register_plugin(module, name=name, source=source)
    try:
        yield module
    finally:
        plugins.unregister_plugin(name)


@pytest.fixture
def twin_plugin():
    """The built-in digital twin, registered as its entry point would register it."""
    import autotune_plugins.twin as twin

    with plugin_registered(twin, "twin") as module:
        yield module


@pytest.fixture
def engine_plugins():
    """The built-in real engines (llama-server, exllamav2, openai-server), registered as their
    entry points would: what they declare (cache types, formats) is what the core then knows."""
    import autotune_plugins.exllamav2 as exllamav2
    import autotune_plugins.llama_server as llama_server
    import autotune_plugins.openai_server as openai_server

    with (
        plugin_registered(llama_server, "llama-server"),
        plugin_registered(exllamav2, "exllamav2"),
        plugin_registered(openai_server, "openai-server"),
    ):
        yield


@pytest.fixture
def default_study_path() -> Path:
    return REPO / "studies" / "v100-qwen27b.toml"


@pytest.fixture
def tmp_storage(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'study.db'}"


@pytest.fixture
def seven_b(tmp_path) -> Path:
    """A Hugging Face directory of the Qwen2.5-7B shape whose weights `init` never reads."""
    d = tmp_path / "Qwen2.5-7B"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "num_hidden_layers": 28,
                "hidden_size": 3584,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "intermediate_size": 18944,
                "vocab_size": 152064,
                "max_position_embeddings": 32768,
                "tie_word_embeddings": False,
            }
        )
    )
    (d / "model.safetensors").write_bytes(b"not read by init")
    return d
