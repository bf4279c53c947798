"""Shared fixtures. Plugin autoload is off in tests: each test registers what it needs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Read by autotune.plugins.load_plugins: tests decide which plugins exist (as llm does).
sys._called_from_test = True  # type: ignore[attr-defined]

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def twin_plugin():
    """The built-in digital twin, registered as its entry point would register it."""
    import autotune_plugins.twin as twin

    from autotune import plugins

    plugins.register_plugin(twin, name="twin", source="autotune")
    try:
        yield twin
    finally:
        plugins.unregister_plugin("twin")


@pytest.fixture
def default_study_path() -> Path:
    return REPO / "studies" / "v100-qwen27b.toml"


@pytest.fixture
def tmp_storage(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'study.db'}"
