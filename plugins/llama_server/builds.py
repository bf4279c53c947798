"""The cache of llama.cpp builds: where it is, what each build holds, and finding executables.

A build's directory (see :mod:`autotune_plugins.llama_server.engine`) counts only once its
``engine.json`` exists. :func:`find_llama_server` resolves the binary a study uses,
:func:`find_engine_tool` the tools built beside it, :func:`engine_version` reads its
``--version`` and :func:`build_supports` tells whether a build can run on a card.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune._builtin import processes
from autotune._builtin import ConfigError, EngineUnavailableError, engine_environment
from autotune_plugins.llama_server import cuda_toolkit
from autotune_plugins.llama_server.cuda_toolkit import cuda_arch_from_cc, resolve_arch
from autotune_plugins.llama_server.llama_build import BUILD_TARGETS, LLAMA_CPP_PYTHON_VERSION, MARKER, SERVER
from autotune_plugins.shared.engine_cache import engines_dir

__all__ = [
    "ENGINE_TOOLS",
    "MARKER",
    "EngineBuild",
    "EngineNotFoundError",
    "EngineVersion",
    "build_supports",
    "built_engines",
    "engine_version",
    "engines_dir",
    "find_engine_tool",
    "find_llama_quantize",
    "find_llama_server",
    "parse_engine_version",
]

ENGINE_TOOLS = BUILD_TARGETS
# 2 adds "tools" (every executable built) and "cuda" (the toolkit and its architectures).
# Readers accept 1: a build made before has a server as good as a new one's.
MANIFEST_VERSION = 2


class EngineNotFoundError(EngineUnavailableError):
    """No ``llama-server`` (or tool) could be found, or the one configured is missing or does
    not run: every trial would fail the same way, so it is the core's "engine unavailable"
    (exit status 2, the message names the remedy)."""


# --------------------------------------------------------------------------------------
# Cache directory
# --------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineVersion:
    """What ``llama-server --version`` says.

    Attributes:
        build_number: llama.cpp build number (the N of release tag bN); 0 when built outside git.
        commit: Short commit hash, or None when the binary says "unknown".
        release: The version string of newer builds ("0.5.0-dev"); None for older ones.
        compiler: "GNU 12.2.0" etc., from "built with ... for ...".
        target: "Linux x86_64" etc.
        raw: The whole output, for the study's metadata.
    """

    build_number: int | None
    commit: str | None
    release: str | None = None
    compiler: str | None = None
    target: str | None = None
    raw: str = ""

    @property
    def label(self) -> str:
        """One short line for reports and trial attributes, e.g. "llama.cpp b6100 (abc1234)"."""
        parts = ["llama.cpp"]
        if self.release:
            parts.append(self.release)
        if self.build_number:
            parts.append(f"b{self.build_number}")
        if self.commit:
            parts.append(f"({self.commit})")
        return " ".join(parts)


@dataclass(frozen=True)
class EngineBuild:
    """A finished (or reused) build.

    Attributes:
        install_dir: The build's cache directory.
        server: Path of ``llama-server``.
        quantize: Path of ``llama-quantize``.
        lib_dir: Directory of ``libllama.so``: the value for ``LLAMA_CPP_LIB_PATH``.
        manifest: The contents of ``engine.json``.
        reused: True when a complete build was found and nothing was built.
    """

    install_dir: Path
    server: Path
    quantize: Path
    lib_dir: Path
    manifest: Mapping[str, Any] = field(default_factory=dict)
    reused: bool = False

    def tool(self, name: str) -> Path | None:
        """The path of one of :data:`ENGINE_TOOLS` in this build, or None when it lacks it
        (builds made before autotune built the benchmarks)."""
        path = self.install_dir / "bin" / name
        return path if _is_executable(path) else None

    @property
    def missing_tools(self) -> list[str]:
        return [t for t in BUILD_TARGETS if self.tool(t) is None]


# --------------------------------------------------------------------------------------
# Version
# --------------------------------------------------------------------------------------

# Newer llama.cpp (common/build-info.cpp.in): "version: 0.5.0-dev (build 1234, commit abc1234)".
_VERSION_NEW = re.compile(r"version:\s*(\S+)\s*\(build\s+(\d+),\s*commit\s+(\w+)\)")
# Older llama.cpp: "version: 1234 (abc1234)".
_VERSION_OLD = re.compile(r"version:\s*(\d+)\s*\((\w+)\)")
_BUILT_WITH = re.compile(r"built with (.+?) for (.+?)\s*$", re.MULTILINE)


def parse_engine_version(text: str) -> EngineVersion | None:
    """Parses the output of ``llama-server --version`` (either format llama.cpp has used).

    Args:
        text: stdout and stderr of the command together; llama.cpp prints build info on stderr,
            and lines such as "load_backend: loaded CPU backend" may come first.

    Returns:
        The parsed version, or None when no "version:" line is found.
    """
    commit: str | None
    m = _VERSION_NEW.search(text)
    if m:
        release, build, commit = m.group(1), int(m.group(2)), m.group(3)
    else:
        m = _VERSION_OLD.search(text)
        if not m:
            return None
        release, build, commit = None, int(m.group(1)), m.group(2)
    if commit == "unknown":
        commit = None
    built = _BUILT_WITH.search(text)
    return EngineVersion(
        build_number=build,
        commit=commit,
        release=release,
        compiler=built.group(1) if built else None,
        target=built.group(2) if built else None,
        raw=text.strip(),
    )


def engine_version(binary: str | os.PathLike[str], timeout_s: float = 30.0) -> EngineVersion:
    """Runs ``binary --version`` and parses what it prints.

    Args:
        binary: A llama.cpp executable (``llama-server``, ``llama-quantize`` prints no version).
        timeout_s: Bound on the call; initialising a CUDA backend can take seconds.

    Returns:
        The engine's version.

    Raises:
        EngineNotFoundError: The binary is missing or cannot run (e.g. a shared library is
            missing); the message quotes its output.
    """
    path = Path(binary)
    try:
        proc = processes.run(
            [str(path), "--version"],
            env=engine_environment(),  # an engine, like the server it is: no storage URL, no tokens
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # build info goes to stderr
            stdin=subprocess.DEVNULL,
            timeout_s=timeout_s,
        )
    except FileNotFoundError:
        raise EngineNotFoundError(f"{path}: no such executable") from None
    except PermissionError:
        raise EngineNotFoundError(f"{path}: not executable") from None
    except subprocess.TimeoutExpired:
        raise EngineNotFoundError(f"{path} --version: no answer after {timeout_s:.0f}s") from None
    text = proc.stdout.decode("utf-8", "replace")
    parsed = parse_engine_version(text)
    if parsed is None:
        tail = " | ".join(text.strip().splitlines()[-3:]) or "no output"
        raise EngineNotFoundError(f"{path} --version: exit status {proc.returncode}, no 'version:' line ({tail})")
    return parsed


# --------------------------------------------------------------------------------------
# Finding the binary
# --------------------------------------------------------------------------------------


def built_engines(cache_dir: str | os.PathLike[str] | None = None) -> list[EngineBuild]:
    """Complete builds in the cache (those whose ``engine.json`` exists), newest first.

    Args:
        cache_dir: The engines directory; default :func:`engines_dir`.
    """
    root = engines_dir(cache_dir)
    found = []
    for marker in root.glob(f"llama.cpp-*/{MARKER}"):
        try:
            manifest = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # a half-written or foreign file: not a usable build
        install = marker.parent
        server = install / "bin" / "llama-server"
        if not _is_executable(server):
            continue
        found.append(EngineBuild(install, server, install / "bin" / "llama-quantize", install / "bin", manifest))
    return sorted(found, key=lambda b: (b.install_dir / MARKER).stat().st_mtime, reverse=True)


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _preferred_build(builds: list[EngineBuild], arch: str | None) -> EngineBuild | None:
    """The build to use: one for this machine's GPUs, else any CUDA one, else the CPU one."""
    if not builds:
        return None
    if arch is None and any(b.manifest.get("arch") != "cpu" for b in builds):
        # Only ask NVML when there is a choice to make: it costs a driver round trip.
        try:
            arch = resolve_arch("auto")
        except ConfigError:
            arch = None

    def rank(b: EngineBuild) -> tuple[int, int]:
        built_arch = str(b.manifest.get("arch", ""))
        pinned = 0 if b.manifest.get("llama_cpp_python") == LLAMA_CPP_PYTHON_VERSION else 1
        if arch and built_arch == arch:
            return (0, pinned)
        if arch == "cpu":
            return (1 if built_arch == "cpu" else 3, pinned)
        if arch and set(arch.split(";")) <= set(built_arch.split(";")):
            return (1, pinned)
        return (2 if built_arch != "cpu" else 3, pinned)

    return min(builds, key=rank)


def _resolve_explicit(value: str, source: str, name: str) -> Path:
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / name
    if not _is_executable(path):
        raise EngineNotFoundError(f"{source} = {value!r}: no executable {name} there")
    return path


def find_llama_server(
    settings: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    arch: str | None = None,
) -> Path:
    """Finds the ``llama-server`` a study should run.

    Resolution order: the backend setting ``binary``, the environment variable
    ``AUTOTUNE_LLAMA_SERVER``, a build made by ``autotune engine build llama.cpp`` (one for the
    detected GPUs first), then ``llama-server`` on ``PATH``. An explicit setting or variable
    that points nowhere is an error rather than a silent fallback: measuring a different engine
    than the one asked for would mislabel every trial.

    Args:
        settings: The backend's settings from the study file; ``binary`` may name the
            executable or the directory holding it.
        cache_dir: The engines directory; default :func:`engines_dir`.
        arch: Prefer the build for this architecture ("cpu", "70"); None asks NVML.

    Returns:
        The path of the executable.

    Raises:
        EngineNotFoundError: None found, or the setting or variable names a missing file; the
            message lists what to do.
    """
    return _find_tool("llama-server", settings, "AUTOTUNE_LLAMA_SERVER", cache_dir=cache_dir, arch=arch)


def find_llama_quantize(
    settings: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    arch: str | None = None,
) -> Path:
    """Finds ``llama-quantize`` like :func:`find_llama_server` (setting ``quantize_binary``,
    variable ``AUTOTUNE_LLAMA_QUANTIZE``, then next to the resolved server, cache, ``PATH``).

    Args:
        settings: Backend settings, as for :func:`find_llama_server`.
        cache_dir: The engines directory; default :func:`engines_dir`.
        arch: Preferred build architecture.

    Returns:
        The path of the executable.

    Raises:
        EngineNotFoundError: None found.
    """
    settings = settings or {}
    if settings.get("quantize_binary"):
        return _resolve_explicit(str(settings["quantize_binary"]), "setting quantize_binary", "llama-quantize")
    if os.environ.get("AUTOTUNE_LLAMA_QUANTIZE"):
        return _resolve_explicit(os.environ["AUTOTUNE_LLAMA_QUANTIZE"], "AUTOTUNE_LLAMA_QUANTIZE", "llama-quantize")
    # A quantizer from the same tree as the server writes files that server reads.
    with contextlib.suppress(EngineNotFoundError):
        beside = find_llama_server(settings, cache_dir=cache_dir, arch=arch).parent / "llama-quantize"
        if _is_executable(beside):
            return beside
    return _find_tool("llama-quantize", {}, None, cache_dir=cache_dir, arch=arch)


def find_engine_tool(
    name: str,
    settings: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    arch: str | None = None,
) -> Path:
    """Finds one of llama.cpp's executables of the same tree as the server a study runs.

    ``llama-bench`` and ``llama-batched-bench`` are looked for only beside the server
    :func:`find_llama_server` resolves: a benchmark from another tree would calibrate
    against another engine.

    Args:
        name: One of :data:`ENGINE_TOOLS`.
        settings: Backend settings, as for :func:`find_llama_server`.
        cache_dir: The engines directory; default :func:`engines_dir`.
        arch: Preferred build architecture.

    Returns:
        The path of the executable.

    Raises:
        ConfigError: ``name`` is not a tool autotune builds.
        EngineNotFoundError: No server, or none of this tool beside it; the message says how
            to add it.
    """
    if name not in ENGINE_TOOLS:
        raise ConfigError(f"engine tool {name!r}: autotune builds {', '.join(ENGINE_TOOLS)}")
    if name == SERVER:
        return find_llama_server(settings, cache_dir=cache_dir, arch=arch)
    if name == "llama-quantize":
        return find_llama_quantize(settings, cache_dir=cache_dir, arch=arch)
    server = find_llama_server(settings, cache_dir=cache_dir, arch=arch)
    beside = server.parent / name
    if _is_executable(beside):
        return beside
    manifest, _ = _manifest_of(server)
    if manifest is not None:
        tag = str(manifest.get("arch", "cpu")).replace(";", ",")
        raise EngineNotFoundError(
            f"{name}: the llama.cpp build in {server.parent.parent} predates autotune building it: run "
            f"`autotune engine build llama.cpp --cuda-arch {tag}`, which compiles only what is missing"
        )
    raise EngineNotFoundError(
        f"{name}: none beside {server}; build it from the same llama.cpp tree, or use `autotune engine build llama.cpp`"
    )


def _manifest_of(binary: Path) -> tuple[dict[str, Any] | None, Path]:
    """The engine.json of the autotune build holding ``binary`` (in its bin/), if it is one,
    and the build's directory (else the binary's)."""
    for marker in (binary.parent.parent / MARKER, binary.parent / MARKER):
        with contextlib.suppress(OSError, ValueError):
            manifest = json.loads(marker.read_text(encoding="utf-8"))
            if isinstance(manifest, dict):
                return manifest, marker.parent
    return None, binary.parent


def build_supports(build: EngineBuild | str | os.PathLike[str], compute_capability: str | None) -> str | None:
    """Whether a llama.cpp build can run on a card, from what the build recorded.

    A CPU-only build on a machine with a card silently measures the CPU; a build without
    kernels for the card fails every trial with "no kernel image is available"; a build for
    an older architecture runs through PTX compiled for that one, without the kernels
    llama.cpp has for the card: none of these measures what the study asks.

    Args:
        build: An :class:`EngineBuild`, its directory, or an executable (``llama-server``).
        compute_capability: The card's "major.minor" ("7.0"); None or "" for no card.

    Returns:
        None when the build fits (or nothing is known against it: a binary autotune did not
        build and whose libraries do not tell), else why not and the remedy, in one line.
    """
    if not compute_capability or compute_capability in ("0.0",):
        return None
    card = cuda_arch_from_cc(compute_capability)
    if isinstance(build, EngineBuild):
        manifest, where = dict(build.manifest), build.install_dir
    else:
        path = Path(build)
        manifest, where = _manifest_of(path / "bin" / SERVER if path.is_dir() else path)
    remedy = (
        f"build for it with `autotune engine build llama.cpp --cuda-arch {card}`"
        f"{cuda_toolkit.toolkit_note(card)}, or set the backend setting binary to a build for it"
    )
    if manifest is None:
        # Not autotune's: its shared libraries, when it has them beside it, tell the backends.
        if (any(where.glob("libggml-base.so*")) or any(where.glob("libggml.so*"))) and not any(
            where.glob("libggml-cuda.so*")
        ):
            return f"llama.cpp in {where} has no CUDA backend (no libggml-cuda.so): {remedy}"
        return None
    built = str(manifest.get("arch", ""))
    label = cuda_toolkit.card_arch_label(card)
    if built == "cpu":
        return f"the llama.cpp build in {where} is CPU-only: on this card, {label}, it would measure the CPU; {remedy}"
    archs = [a for a in built.split(";") if a]
    if any(cuda_toolkit.card_runs_code(a, card) for a in archs):
        return None
    shown = ", ".join(f"sm_{a}" for a in archs)
    older = [a for a in archs if cuda_toolkit.arch_number(a) < cuda_toolkit.arch_number(card)]
    why = (
        f"it would run through PTX JIT-compiled for {shown}, without llama.cpp's kernels for this card"
        if older and not any(a[-1:].isalpha() for a in older)
        else "it has no kernels this card can run"
    )
    return f"the llama.cpp build in {where} was built for {shown}, not {label}: {why}; {remedy}"


def _find_tool(
    name: str,
    settings: Mapping[str, Any] | None,
    env_var: str | None,
    *,
    cache_dir: str | os.PathLike[str] | None,
    arch: str | None,
) -> Path:
    settings = settings or {}
    if settings.get("binary"):
        return _resolve_explicit(str(settings["binary"]), "setting binary", name)
    if env_var and os.environ.get(env_var):
        return _resolve_explicit(os.environ[env_var], env_var, name)
    build = _preferred_build(built_engines(cache_dir), arch)
    if build is not None and _is_executable(build.install_dir / "bin" / name):
        return build.install_dir / "bin" / name
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    hint = (
        f"set the backend setting binary = '/path/to/{name}'"
        if env_var is None
        else (f"set the backend setting binary = '/path/to/{name}' or {env_var}")
    )
    raise EngineNotFoundError(
        f"{name} not found (no build in {engines_dir(cache_dir)}, none on PATH): "
        f"run `autotune engine build llama.cpp`, or {hint}"
    )
