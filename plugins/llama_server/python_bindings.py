"""llama-cpp-python on autotune's engine build: the in-process engine quality scoring uses.

The bindings are installed without compiling llama.cpp a second time and load the build's
``libllama.so`` through ``LLAMA_CPP_LIB_PATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from autotune._builtin import processes
from autotune_plugins.llama_server.builds import (
    MARKER,
    EngineBuild,
    EngineNotFoundError,
    engines_dir,
    find_llama_server,
)
from autotune_plugins.llama_server.llama_build import LLAMA_CPP_PYTHON_VERSION, EngineBuildError

__all__ = ["import_llama_cpp", "install_python_bindings"]


def install_python_bindings(
    build: EngineBuild,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    log: IO[str] | None = None,
) -> str:
    """Installs llama-cpp-python into this interpreter without compiling llama.cpp again.

    The bindings are ctypes over ``libllama.so``; the sdist's own CMake build of llama.cpp is
    switched off (``-DLLAMA_BUILD=OFF``) and :func:`import_llama_cpp` points them at this
    build's libraries instead. Same sdist, same vendored tree: the ABI matches by construction,
    and a 2-core machine saves a second 8-minute compile.

    Args:
        build: The engine build whose libraries the bindings will load.
        cache_dir: The engines directory (for the downloaded sdist); default :func:`engines_dir`.
        log: Where pip's output goes.

    Returns:
        The installed llama-cpp-python version.

    Raises:
        EngineBuildError: pip failed.
    """
    version = str(build.manifest.get("llama_cpp_python") or LLAMA_CPP_PYTHON_VERSION)
    sdist = engines_dir(cache_dir) / "downloads" / f"llama_cpp_python-{version}.tar.gz"
    source = str(sdist) if sdist.is_file() else f"llama-cpp-python=={version}"
    # With its dependencies (diskcache, jinja2...): a fresh environment has none of them.
    cmd = [sys.executable, "-m", "pip", "install", source]
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
    proc = processes.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    out = proc.stdout.decode("utf-8", "replace")
    if log is not None:
        log.write(f"$ CMAKE_ARGS='{env['CMAKE_ARGS']}' {' '.join(cmd)}\n{out}\n")
        log.flush()
    if proc.returncode != 0:
        raise EngineBuildError(
            f"installing llama-cpp-python {version} bindings failed (exit status {proc.returncode})",
            log_tail="\n".join(out.strip().splitlines()[-15:]),
        )
    return version


INSTALL_HINT = (
    "run `autotune engine build llama.cpp --python` (installs llama-cpp-python on that build, "
    "no second compile) or `pip install 'autotune[llama]'`"
)


def bindings_missing() -> str | None:
    """Why llama-cpp-python cannot be imported (None: it is installed), without importing it."""
    import importlib.util

    if "llama_cpp" in sys.modules or importlib.util.find_spec("llama_cpp") is not None:
        return None
    return f"llama-cpp-python is not installed: {INSTALL_HINT}"


def import_llama_cpp(
    settings: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    arch: str | None = None,
) -> Any:
    """Imports llama-cpp-python, loading the libllama of autotune's engine build.

    Resolution: an explicit ``LLAMA_CPP_LIB_PATH`` (the user's choice, untouched), else the
    libraries of the build :func:`find_llama_server` would pick when the installed bindings
    have that build's version, else whatever library the installed package carries. The
    variable must be set before the first import; once llama_cpp is imported, it is returned
    as it is.

    Args:
        settings: Backend settings (``binary`` pins the build, as for :func:`find_llama_server`).
        cache_dir: The engines directory; default :func:`engines_dir`.
        arch: Preferred build architecture.

    Returns:
        The ``llama_cpp`` module.

    Raises:
        EngineNotFoundError: llama-cpp-python is not installed, or it has no library to load;
            the message says how to install it.
    """
    import importlib
    import importlib.metadata
    import importlib.util

    if "llama_cpp" in sys.modules:
        return sys.modules["llama_cpp"]
    install_hint = INSTALL_HINT
    missing = bindings_missing()
    if missing:
        raise EngineNotFoundError(missing)
    installed = importlib.metadata.version("llama_cpp_python")
    if not os.environ.get("LLAMA_CPP_LIB_PATH"):
        with contextlib.suppress(EngineNotFoundError):
            lib_dir = find_llama_server(settings, cache_dir=cache_dir, arch=arch).parent
            if (lib_dir / "libllama.so").is_file():
                build_version = _build_version_of(lib_dir)
                if build_version in (None, installed):
                    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    try:
        return importlib.import_module("llama_cpp")
    except ImportError as exc:  # a dependency of the bindings is missing
        raise EngineNotFoundError(
            f"llama-cpp-python {installed} is installed but cannot be imported ({exc}): {install_hint}"
        ) from None
    except (OSError, RuntimeError, FileNotFoundError) as exc:
        where = os.environ.get("LLAMA_CPP_LIB_PATH", "the package's own lib/ directory")
        raise EngineNotFoundError(
            f"llama-cpp-python {installed} could not load libllama from {where} ({exc}): {install_hint}"
        ) from None


def _build_version_of(lib_dir: Path) -> str | None:
    """The llama-cpp-python version a build's libraries come from (its engine.json), if known."""
    marker = lib_dir.parent / MARKER
    with contextlib.suppress(OSError, ValueError):
        return json.loads(marker.read_text(encoding="utf-8")).get("llama_cpp_python")
    return None
