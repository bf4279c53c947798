"""Finding the llama.cpp engine from tests: skip on a developer's machine without a build,
fail in CI, where `.ci/run` builds it first and sets AUTOTUNE_REQUIRE_ENGINE=1.

A missing build must never turn CI's engine tests into silent skips.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import pytest

from autotune.errors import AutotuneError


def engine_required() -> bool:
    return os.environ.get("AUTOTUNE_REQUIRE_ENGINE") == "1"


def missing(what: str) -> NoReturn:
    """Skip (developer machine) or fail (CI) because ``what`` is missing."""
    message = f"{what}: run `autotune engine build llama.cpp --cpu --python` first"
    if engine_required():
        pytest.fail(f"AUTOTUNE_REQUIRE_ENGINE=1 but {message}", pytrace=False)
    pytest.skip(message)


def llama_server_binary() -> Path:
    from autotune_plugins.llama_server import engine

    try:
        return engine.find_llama_server({})
    except AutotuneError as exc:
        missing(f"no llama-server ({exc})")


def cpu_build() -> Any:
    """The CPU build (runs anywhere), else any complete build."""
    from autotune_plugins.llama_server import engine

    builds = engine.built_engines()
    if not builds:
        missing("no llama.cpp build")
    return next((b for b in builds if b.manifest.get("arch") == "cpu"), builds[0])


def llama_cpp_module() -> Any:
    """llama-cpp-python, loading the engine build's libllama."""
    from autotune_plugins.llama_server import engine

    try:
        return engine.import_llama_cpp({})
    except AutotuneError as exc:
        missing(str(exc))
