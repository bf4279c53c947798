"""Building and finding llama.cpp's ``llama-server`` and tools: ``autotune engine build llama.cpp``.

The sources are the llama.cpp tree vendored in the llama-cpp-python source distribution on
PyPI, pinned to :data:`LLAMA_CPP_PYTHON_VERSION`. PyPI is reachable from machines that cannot
reach GitHub, pip honours the user's index and proxy settings, and the same tree yields a
``libllama.so`` that llama-cpp-python of that very version can load through
``LLAMA_CPP_LIB_PATH``.

A build goes into a cache directory keyed by version and GPU architecture::

    ~/.cache/autotune/engines/            (or $XDG_CACHE_HOME/autotune, $AUTOTUNE_CACHE_DIR)
        downloads/llama_cpp_python-0.3.36.tar.gz
        llama.cpp-0.3.36-sm_70/
            src/          the vendored llama.cpp tree (also the vocab-only GGUFs synth uses)
            build/        the CMake build tree, kept so that a rebuild is incremental
            bin/          llama-server, llama-quantize, llama-bench, llama-batched-bench
                          and their shared libraries
            build.log     every command run and everything it printed
            engine.json   written last: its presence means the build is complete

:func:`find_llama_server` resolves the binary a study uses, :func:`find_engine_tool` the tools
built beside it, :func:`engine_version` reads its ``--version`` and :func:`build_supports`
tells whether a build can run on a card.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from autotune.errors import AutotuneError, ConfigError
from autotune_plugins.llama_server import cuda_toolkit

__all__ = [
    "BUILD_TARGETS",
    "ENGINE_TOOLS",
    "LLAMA_CPP_PYTHON_SHA256",
    "LLAMA_CPP_PYTHON_VERSION",
    "BuildPlan",
    "CMakeBuilder",
    "EngineBuild",
    "EngineBuildError",
    "EngineNotFoundError",
    "EngineVersion",
    "amx_guard_flags",
    "arch_tag",
    "build_llama_cpp",
    "build_supports",
    "built_engines",
    "cmake_build_args",
    "cmake_configure_args",
    "cuda_arch_from_cc",
    "download_sdist",
    "engine_version",
    "engines_dir",
    "extract_llama_cpp",
    "find_engine_tool",
    "find_llama_quantize",
    "find_llama_server",
    "import_llama_cpp",
    "install_outputs",
    "install_python_bindings",
    "parse_engine_version",
    "resolve_arch",
    "sdist_version",
]

# The pinned source. 0.3.36 vendors llama.cpp ggml-org/llama.cpp@0c1e57098 (its CHANGELOG.md),
# which knows llama, qwen2, qwen3 and qwen3.5; it is inside the range of autotune's `llama`
# extra (llama-cpp-python>=0.3.16,<0.4), so the bindings and the built libllama.so can match.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# sha256 of llama_cpp_python-0.3.36.tar.gz as PyPI served it (76,589,250 bytes).
LLAMA_CPP_PYTHON_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

# Only what autotune runs: the server it measures, the quantizer `autotune synth` calls, and
# llama.cpp's own benchmarks, against which autotune's measurement path is calibrated
# (bench/calibrate_llama_cpu.py). Building every tool would roughly double a 2-core build; the
# two benchmarks are one source file each over libraries the server already links, measured
# at BENCH_TARGETS_SECONDS on 2 cores.
SERVER = "llama-server"
BENCH_TOOLS = ("llama-bench", "llama-batched-bench")
BUILD_TARGETS = (SERVER, "llama-quantize", *BENCH_TOOLS)
ENGINE_TOOLS = BUILD_TARGETS

MARKER = "engine.json"
# 2 adds "tools" (every executable built) and "cuda" (the toolkit and its architectures).
# Readers accept 1: a build made before has a server as good as a new one's.
MANIFEST_VERSION = 2

# Debian packages that provide each tool, for the error messages.
_DEBIAN_PACKAGES = {
    "cmake": "cmake",
    "c++": "g++ (or build-essential)",
    "cc": "gcc (or build-essential)",
    "ninja": "ninja-build",
    "make": "make (or build-essential)",
    "nvcc": "nvidia-cuda-toolkit (or NVIDIA's cuda-toolkit-12-x from its apt repository)",
}


class EngineBuildError(AutotuneError):
    """Building the engine failed; the message says which step and what to do.

    Attributes:
        log_tail: The last lines of the build log, when there is one.
    """

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


class EngineNotFoundError(AutotuneError):
    """No ``llama-server`` could be found, or the one configured does not exist."""


# --------------------------------------------------------------------------------------
# Cache directory
# --------------------------------------------------------------------------------------


def engines_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory holding built engines.

    Args:
        cache_dir: An explicit directory (``--cache-dir``); it is used as is.

    Returns:
        ``cache_dir``, else ``$AUTOTUNE_CACHE_DIR/engines``, else
        ``$XDG_CACHE_HOME/autotune/engines``, else ``~/.cache/autotune/engines``.
    """
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("AUTOTUNE_CACHE_DIR"):
        return Path(os.environ["AUTOTUNE_CACHE_DIR"]).expanduser() / "engines"
    # An empty XDG_CACHE_HOME means "unset" (XDG Base Directory spec).
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "autotune" / "engines"


# --------------------------------------------------------------------------------------
# Architecture
# --------------------------------------------------------------------------------------

_ARCH_RE = re.compile(r"^\d{2,3}[a-z]?$")


def cuda_arch_from_cc(compute_capability: str) -> str:
    """The CMake CUDA architecture of an NVML compute capability.

    Args:
        compute_capability: "major.minor", as :class:`autotune.hardware.DetectedGpu` has it.

    Returns:
        E.g. "70" for "7.0" (V100), "90" for "9.0" (H100).

    Raises:
        ConfigError: The value is not "major.minor".
    """
    m = re.fullmatch(r"(\d+)\.(\d+)", compute_capability.strip())
    if not m:
        raise ConfigError(f"compute capability {compute_capability!r}: use 'major.minor', e.g. 7.0")
    return f"{int(m.group(1))}{int(m.group(2))}"


def resolve_arch(spec: str, gpus: Sequence[Any] | None = None) -> str:
    """Turns ``--cuda-arch`` into "cpu" or a CMake architecture list such as "70" or "70;86".

    The first pitfall of building llama.cpp for an old card is a binary without kernels for it
    (the V100 is sm_70, which recent CUDA defaults leave out): "auto" asks NVML for the compute
    capability of every visible card, so the build has exactly their architectures.

    Args:
        spec: "auto", "cpu", or architectures separated by commas or semicolons ("70", "70,86",
            "90a").
        gpus: Detected GPUs (objects with ``compute_capability``); None detects them with
            :func:`autotune.hardware.detect_gpus`.

    Returns:
        "cpu" or the architectures joined by ";", sorted and without duplicates.

    Raises:
        ConfigError: An architecture is not a number like 70 or 90a.
    """
    spec = spec.strip().lower()
    if spec == "cpu":
        return "cpu"
    if spec == "auto":
        if gpus is None:
            from autotune.hardware import detect_gpus

            gpus = detect_gpus()
        archs = {cuda_arch_from_cc(g.compute_capability) for g in gpus if g.compute_capability not in ("", "0.0")}
        # No NVIDIA card (or no driver): a CPU build is the only one that can run here.
        return ";".join(sorted(archs, key=_arch_key)) if archs else "cpu"
    parts = [p.strip().removeprefix("sm_") for p in re.split(r"[,;]", spec) if p.strip()]
    bad = [p for p in parts if not _ARCH_RE.match(p)]
    if not parts or bad:
        raise ConfigError(
            f"--cuda-arch {spec!r}: use auto, cpu, or CUDA architectures such as 70, 86 or 90 "
            "(compute capability without the dot), separated by commas"
        )
    return ";".join(sorted(set(parts), key=_arch_key))


def _arch_key(arch: str) -> tuple[int, str]:
    digits = re.match(r"\d+", arch)
    return (int(digits.group(0)) if digits else 0, arch)


def arch_tag(arch: str) -> str:
    """The cache directory suffix of an architecture: "cpu", "sm_70" or "sm_70+86"."""
    return "cpu" if arch == "cpu" else "sm_" + "+".join(arch.split(";"))


# --------------------------------------------------------------------------------------
# Plan and result
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildPlan:
    """What one build produces and where.

    Attributes:
        version: llama-cpp-python version whose vendored llama.cpp is built.
        arch: "cpu" or CMake CUDA architectures ("70", "70;86").
        install_dir: ``<engines>/llama.cpp-<version>-<tag>``.
        jobs: Parallel compile jobs.
        commit: llama.cpp commit of the sources, when known (baked into ``--version``).
    """

    version: str
    arch: str
    install_dir: Path
    jobs: int
    commit: str | None = None

    @property
    def tag(self) -> str:
        return arch_tag(self.arch)

    @property
    def src_dir(self) -> Path:
        return self.install_dir / "src"

    @property
    def build_dir(self) -> Path:
        return self.install_dir / "build"

    @property
    def bin_dir(self) -> Path:
        return self.install_dir / "bin"

    @property
    def log_path(self) -> Path:
        return self.install_dir / "build.log"

    @property
    def marker_path(self) -> Path:
        return self.install_dir / MARKER


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
        proc = subprocess.run(
            [str(path), "--version"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # build info goes to stderr
            stdin=subprocess.DEVNULL,
            timeout=timeout_s,
            check=False,
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
        raise EngineNotFoundError(
            f"{path} --version: exit status {proc.returncode}, no 'version:' line ({tail})"
        )
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
    raise EngineNotFoundError(f"{name}: none beside {server}; build it from the same llama.cpp tree, or use "
                              "`autotune engine build llama.cpp`")


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
    remedy = (f"build for it with `autotune engine build llama.cpp --cuda-arch {card}`"
              f"{cuda_toolkit.toolkit_note(card)}, or set the backend setting binary to a build for it")
    if manifest is None:
        # Not autotune's: its shared libraries, when it has them beside it, tell the backends.
        if (any(where.glob("libggml-base.so*")) or any(where.glob("libggml.so*"))) \
                and not any(where.glob("libggml-cuda.so*")):
            return f"llama.cpp in {where} has no CUDA backend (no libggml-cuda.so): {remedy}"
        return None
    built = str(manifest.get("arch", ""))
    label = cuda_toolkit.card_arch_label(card)
    if built == "cpu":
        return f"the llama.cpp build in {where} is CPU-only: on this card, {label}, it would measure the CPU; {remedy}"
    archs = [a for a in built.split(";") if a]
    if any(_runs_natively(a, card) for a in archs):
        return None
    shown = ", ".join(f"sm_{a}" for a in archs)
    older = [a for a in archs if _arch_number(a) < _arch_number(card)]
    why = (f"it would run through PTX JIT-compiled for {shown}, without llama.cpp's kernels for this card"
           if older and not any(a[-1:].isalpha() for a in older) else "it has no kernels this card can run")
    return f"the llama.cpp build in {where} was built for {shown}, not {label}: {why}; {remedy}"


def _arch_number(arch: str) -> int:
    m = re.match(r"\d+", arch)
    return int(m.group(0)) if m else 0


def _runs_natively(built: str, card: str) -> bool:
    """Whether machine code built for ``built`` ("80", "90a") runs on a ``card`` ("86").

    CUDA's binary compatibility: code for X.y runs on X.z with z >= y; arch-specific code
    ("90a") only on that very architecture.
    """
    b, c = _arch_number(built), _arch_number(card)
    if built[-1:] == "a":
        return b == c
    return b // 10 == c // 10 and b % 10 <= c % 10


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
    hint = f"set the backend setting binary = '/path/to/{name}'" if env_var is None else (
        f"set the backend setting binary = '/path/to/{name}' or {env_var}"
    )
    raise EngineNotFoundError(
        f"{name} not found (no build in {engines_dir(cache_dir)}, none on PATH): "
        f"run `autotune engine build llama.cpp`, or {hint}"
    )


# --------------------------------------------------------------------------------------
# llama-cpp-python on the same build: the in-process engine for scoring
# --------------------------------------------------------------------------------------


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
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          env=env, check=False)
    out = proc.stdout.decode("utf-8", "replace")
    if log is not None:
        log.write(f"$ CMAKE_ARGS='{env['CMAKE_ARGS']}' {' '.join(cmd)}\n{out}\n")
        log.flush()
    if proc.returncode != 0:
        raise EngineBuildError(f"installing llama-cpp-python {version} bindings failed (exit status "
                               f"{proc.returncode})", log_tail="\n".join(out.strip().splitlines()[-15:]))
    return version


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
    install_hint = ("run `autotune engine build llama.cpp --python` (installs llama-cpp-python on that build, "
                    "no second compile) or `pip install 'autotune[llama]'`")
    if importlib.util.find_spec("llama_cpp") is None:
        raise EngineNotFoundError(f"llama-cpp-python is not installed: {install_hint}")
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
        raise EngineNotFoundError(f"llama-cpp-python {installed} is installed but cannot be imported ({exc}): "
                                  f"{install_hint}") from None
    except (OSError, RuntimeError, FileNotFoundError) as exc:
        where = os.environ.get("LLAMA_CPP_LIB_PATH", "the package's own lib/ directory")
        raise EngineNotFoundError(f"llama-cpp-python {installed} could not load libllama from {where} ({exc}): "
                                  f"{install_hint}") from None


def _build_version_of(lib_dir: Path) -> str | None:
    """The llama-cpp-python version a build's libraries come from (its engine.json), if known."""
    marker = lib_dir.parent / MARKER
    with contextlib.suppress(OSError, ValueError):
        return json.loads(marker.read_text(encoding="utf-8")).get("llama_cpp_python")
    return None


# --------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sdist_version(sdist: Path) -> str:
    """The llama-cpp-python version of a source distribution (file or extracted directory).

    Read from ``PKG-INFO``; the file name is the fallback for archives without one.

    Raises:
        ConfigError: Not a llama-cpp-python sdist.
    """
    if sdist.is_dir():
        info = sdist / "PKG-INFO"
        text = info.read_text(encoding="utf-8", errors="replace") if info.is_file() else ""
    else:
        text = ""
        try:
            with tarfile.open(sdist) as tar:
                for member in tar:
                    if member.name.count("/") == 1 and member.name.endswith("/PKG-INFO"):
                        f = tar.extractfile(member)
                        text = f.read().decode("utf-8", "replace") if f else ""
                        break
        except (tarfile.TarError, OSError) as exc:
            raise ConfigError(f"--sdist {sdist}: not a readable .tar.gz ({exc})") from None
    m = re.search(r"^Version:\s*(\S+)", text, re.MULTILINE)
    if m:
        return m.group(1)
    m = re.match(r"llama_cpp_python-(\d[\w.]*?)(?:\.tar\.gz)?$", sdist.name)
    if m:
        return m.group(1)
    raise ConfigError(f"--sdist {sdist}: not a llama-cpp-python source distribution (no PKG-INFO version)")


def download_sdist(version: str, dest: Path, log: IO[str] | None = None) -> Path:
    """Downloads ``llama_cpp_python-<version>.tar.gz`` with pip into ``dest``.

    pip is used (not a URL) so that the user's index, mirror, proxy and certificate settings
    apply. Preparing an sdist's metadata imports its build backend (scikit-build-core), which
    pip installs into an isolated environment; ``--no-build-isolation`` would require it in ours.

    Args:
        version: The llama-cpp-python version.
        dest: Download directory; an archive already there is reused.
        log: Where pip's output goes.

    Returns:
        The archive's path.

    Raises:
        EngineBuildError: pip failed (typically no network); the message says to pass --sdist.
    """
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / f"llama_cpp_python-{version}.tar.gz"
    if target.is_file() and (version != LLAMA_CPP_PYTHON_VERSION or _sha256(target) == LLAMA_CPP_PYTHON_SHA256):
        return target
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={version}", "-d", str(dest)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    out = proc.stdout.decode("utf-8", "replace")
    if log is not None:
        log.write(f"$ {' '.join(cmd)}\n{out}\n")
        log.flush()
    if proc.returncode != 0 or not target.is_file():
        tail = "\n".join(out.strip().splitlines()[-15:])
        raise EngineBuildError(
            f"could not download llama-cpp-python=={version} with pip (exit status {proc.returncode}); "
            f"without network, fetch it elsewhere with `pip download --no-deps --no-binary :all: "
            f"llama-cpp-python=={version}` and pass --sdist PATH",
            log_tail=tail,
        )
    return target


def _llama_commit_from_text(head: str | None, changelog: str | None, version: str) -> str | None:
    if head and re.fullmatch(r"[0-9a-f]{7,40}", head.strip()):
        return head.strip()[:9]
    if changelog:
        # "## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098"
        section = re.search(rf"^## \[{re.escape(version)}\](.*?)(?=^## \[|\Z)", changelog, re.MULTILINE | re.DOTALL)
        if section:
            m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1))
            if m:
                return m.group(1)[:9]
    return None


def extract_llama_cpp(sdist: Path, src_dir: Path, version: str) -> str | None:
    """Extracts ``vendor/llama.cpp`` of an sdist (archive or directory) into ``src_dir``.

    The submodule's ``.git`` link is left out: it points into the sdist's ``.git``, which is not
    extracted, and a dangling link would make llama.cpp's CMake scripts warn; the commit is
    passed to CMake explicitly instead.

    Args:
        sdist: ``llama_cpp_python-X.tar.gz`` or its extracted directory.
        src_dir: Destination; replaced if present.
        version: The sdist's version (to find its CHANGELOG entry).

    Returns:
        The llama.cpp commit (short hash) when the sdist records it, else None.

    Raises:
        ConfigError: The sdist has no ``vendor/llama.cpp``.
    """
    if src_dir.exists():
        shutil.rmtree(src_dir)
    tmp = src_dir.with_name(src_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    head = changelog = None
    if sdist.is_dir():
        vendor = sdist / "vendor" / "llama.cpp"
        if not (vendor / "CMakeLists.txt").is_file():
            raise ConfigError(f"--sdist {sdist}: no vendor/llama.cpp/CMakeLists.txt in it")
        shutil.copytree(vendor, tmp, symlinks=True, ignore=lambda d, names: [".git"] if Path(d) == vendor else [])
        head_file = sdist / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
        head = head_file.read_text().strip() if head_file.is_file() else None
        cl = sdist / "CHANGELOG.md"
        changelog = cl.read_text(encoding="utf-8", errors="replace") if cl.is_file() else None
    else:
        tmp.mkdir(parents=True)
        found = False
        with tarfile.open(sdist) as tar:
            for member in tar:
                parts = member.name.split("/", 1)
                if len(parts) != 2:
                    continue
                rel = parts[1]
                if rel == ".git/modules/vendor/llama.cpp/HEAD" and member.isfile():
                    f = tar.extractfile(member)
                    head = f.read().decode() if f else None
                elif rel == "CHANGELOG.md" and member.isfile():
                    f = tar.extractfile(member)
                    changelog = f.read().decode("utf-8", "replace") if f else None
                elif rel.startswith("vendor/llama.cpp/") and rel != "vendor/llama.cpp/.git":
                    inner = rel[len("vendor/llama.cpp/"):]
                    if not inner:
                        continue
                    if inner == "CMakeLists.txt":
                        found = True
                    member.name = inner
                    _extract_member(tar, member, tmp)
        if not found:
            shutil.rmtree(tmp)
            raise ConfigError(f"--sdist {sdist}: no vendor/llama.cpp/CMakeLists.txt in it")
    tmp.rename(src_dir)
    return _llama_commit_from_text(head, changelog, version)


def _extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path) -> None:
    # The "data" filter (Python 3.11.4+, PEP 706) refuses absolute paths, links leaving the tree
    # and device files: an sdist is downloaded data, not trusted input.
    if hasattr(tarfile, "data_filter"):
        tar.extract(member, dest, filter="data")
    else:  # pragma: no cover - Python < 3.11.4
        if member.name.startswith("/") or ".." in Path(member.name).parts:
            raise ConfigError(f"unsafe path in sdist: {member.name}")
        tar.extract(member, dest)


# --------------------------------------------------------------------------------------
# CMake
# --------------------------------------------------------------------------------------


def _cmake_options(src_dir: Path) -> str:
    """The text of the top-level CMakeLists.txt, to tell which options this tree knows."""
    path = src_dir / "CMakeLists.txt"
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def cmake_configure_args(
    plan: BuildPlan,
    *,
    generator: str | None = "Ninja",
    known_options: str | None = None,
    cuda_compiler: str | None = None,
    host_flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """The ``cmake`` configure command for a plan.

    Args:
        plan: The build.
        generator: "Ninja", or None for CMake's default (Unix Makefiles).
        known_options: Text in which an option must appear to be passed (the top-level
            CMakeLists.txt); None reads it from ``plan.src_dir``. Options a tree does not know
            are left out, so that older and newer trees both configure without warnings.
        cuda_compiler: ``nvcc`` to use when it is not on PATH.
        host_flags: Extra C/C++ compiler flags (see :func:`amx_guard_flags`).
        env: The build's environment: its CFLAGS and CXXFLAGS are kept ahead of ``host_flags``
            (CMake reads them only when CMAKE_C_FLAGS is not given).

    Returns:
        The argument list, starting with "cmake".
    """
    text = _cmake_options(plan.src_dir) if known_options is None else known_options
    args = ["cmake", "-S", str(plan.src_dir), "-B", str(plan.build_dir)]
    if generator:
        args += ["-G", generator]
    args += [
        "-DCMAKE_BUILD_TYPE=Release",
        # libllama.so and the libggml*.so beside the binaries, loadable by llama-cpp-python
        # through LLAMA_CPP_LIB_PATH; $ORIGIN rpaths keep bin/ relocatable after the copy.
        "-DBUILD_SHARED_LIBS=ON",
        "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
    ]
    if plan.arch == "cpu":
        args.append("-DGGML_CUDA=OFF")
    else:
        args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={plan.arch}"]
        if cuda_compiler:
            args.append(f"-DCMAKE_CUDA_COMPILER={cuda_compiler}")
    wanted = {
        # Downloading models over HTTP(S) is not autotune's business, and libcurl/libssl
        # headers would be two more build dependencies.
        "LLAMA_CURL": "OFF",
        "LLAMA_OPENSSL": "OFF",
        "LLAMA_BUILD_TESTS": "OFF",
        "LLAMA_BUILD_EXAMPLES": "OFF",
        # The web UI is fetched from Hugging Face at build time unless turned off; autotune
        # only needs the HTTP API, and the build must work offline.
        "LLAMA_USE_PREBUILT_UI": "OFF",
        "LLAMA_BUILD_UI": "OFF",
    }
    args += [f"-D{name}={value}" for name, value in wanted.items() if name in text]
    if host_flags:
        env = env or {}
        for lang, var in (("C", "CFLAGS"), ("CXX", "CXXFLAGS")):
            flags = " ".join([*env.get(var, "").split(), *host_flags])
            args.append(f"-DCMAKE_{lang}_FLAGS={flags}")
    if plan.commit:
        # Outside git the tree would report "build 0, commit unknown"; the sdist records the
        # commit, which is what identifies the engine in a study's metadata.
        args += [f"-DLLAMA_BUILD_COMMIT={plan.commit}", "-DLLAMA_BUILD_NUMBER=0"]
    return args


AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


def amx_guard_flags(compiler: str | None, cpuinfo: str | None = None) -> list[str]:
    """Compiler flags that keep Intel AMX out of a ``-march=native`` build, when needed.

    llama.cpp builds its CPU backend with ``-march=native`` (GGML_NATIVE), which on a CPU with
    AMX (Sapphire Rapids and later) compiles ggml's AMX matmul path. In the llama.cpp of
    llama-cpp-python 0.3.36 that path dies of SIGILL (``tilezero``) on the first Q4_0/Q8_0
    matmul, measured here on a Xeon VM; upstream has it as ggml-org/llama.cpp#28756 and
    PR #26954 (an invalid tile config, and XTILEDATA permission requested on the main thread
    only). GCC and Clang honour ``-mno-amx-*`` whatever its position relative to ``-march``.

    Args:
        compiler: The C compiler CMake will use; flags it rejects are not returned (a
            compiler too old to know AMX cannot emit it either).
        cpuinfo: Text of /proc/cpuinfo (tests); None reads it.

    Returns:
        The flags, or [] when the host has no AMX or is not x86-64.
    """
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
    if not re.search(r"^flags\s*:.*\bamx_(tile|int8|bf16)\b", cpuinfo, re.MULTILINE):
        return []
    if not compiler:
        return []
    probe = subprocess.run([compiler, *AMX_FLAGS, "-E", "-x", "c", os.devnull], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, check=False)
    return list(AMX_FLAGS) if probe.returncode == 0 else []


def cmake_build_args(plan: BuildPlan, targets: Sequence[str] = BUILD_TARGETS) -> list[str]:
    """The ``cmake --build`` command: only ``targets``, ``plan.jobs`` at a time."""
    return ["cmake", "--build", str(plan.build_dir), "--config", "Release", "-j", str(plan.jobs),
            "--target", *targets]


class Builder(Protocol):
    """What :func:`build_llama_cpp` needs from a builder (the real one is :class:`CMakeBuilder`)."""

    def check_tools(self, plan: BuildPlan) -> None:
        """Raise EngineBuildError naming the missing tool and its package, and ConfigError for a
        CUDA compiler that cannot target ``plan.arch``, before downloading."""

    def build(self, plan: BuildPlan, log: IO[str], progress: Callable[[int, int, str], None] | None) -> None:
        """Build ``plan.src_dir`` and put ``llama-server``, ``llama-quantize`` and their shared
        libraries into ``plan.bin_dir``."""


# "[12/345] Building CXX object ..." (ninja), "[ 12%] Building ..." (make).
_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_STEP = re.compile(r"^\[\s*(\d+)%\]")


class CMakeBuilder:
    """Configures and builds with CMake (Ninja when installed), then copies the outputs.

    Args:
        env: The build's environment; default this process's.
        cuda_compiler: ``nvcc`` to use (``--cuda-compiler``); default ``$CUDACXX``, ``nvcc`` on
            PATH, /usr/local/cuda/bin/nvcc.
    """

    def __init__(self, env: Mapping[str, str] | None = None, cuda_compiler: str | os.PathLike[str] | None = None):
        self.env = dict(os.environ if env is None else env)
        self.requested_cuda_compiler = cuda_compiler
        self.cuda_compiler: str | None = None
        self.cuda: cuda_toolkit.CudaCompiler | None = None  # for engine.json
        self.c_compiler: str | None = None
        self.host_flags: list[str] = []
        self.configure_args: list[str] = []  # what the last build ran, for engine.json

    def _which(self, name: str) -> str | None:
        return shutil.which(name, path=self.env.get("PATH"))

    def check_tools(self, plan: BuildPlan) -> None:
        missing: list[str] = []  # keys of _DEBIAN_PACKAGES
        if not self._which("cmake"):
            missing.append("cmake")
        for kind, var, names in (("c++", "CXX", ("c++", "g++", "clang++")), ("cc", "CC", ("cc", "gcc", "clang"))):
            chosen = self.env.get(var)
            if chosen:
                found = self._which(chosen) or (chosen if Path(chosen).is_file() else None)
            else:
                found = next((n for n in names if self._which(n)), None)
            if not found:
                missing.append(kind)
            elif kind == "cc":
                self.c_compiler = found
        if not self._which("ninja") and not self._which("make"):
            missing.append("ninja")
        found_nvcc = None
        if plan.arch != "cpu":
            found_nvcc = cuda_toolkit.find_cuda_compiler(self.requested_cuda_compiler, self.env)
            if not found_nvcc:
                missing.append("nvcc")
            else:
                self.cuda_compiler = found_nvcc[0]
        if missing:
            labels = {"c++": "a C++ compiler", "cc": "a C compiler", "ninja": "ninja or make"}
            names_ = ", ".join(labels.get(m, m) for m in missing)
            packages = "; ".join(f"{labels.get(m, m)}: apt-get install {_DEBIAN_PACKAGES[m]}" for m in missing)
            raise EngineBuildError(f"cannot build llama.cpp: {names_} not found on PATH (Debian/Ubuntu: {packages})")
        if found_nvcc:
            # Minutes before CMake would stop on "nvcc fatal : Unsupported gpu architecture".
            self.cuda = cuda_toolkit.inspect_cuda_compiler(*found_nvcc)
            cuda_toolkit.check_cuda_archs(plan.arch.split(";"), self.cuda)
        self.host_flags = amx_guard_flags(self._which(self.c_compiler or "") or self.c_compiler)

    def _run(self, cmd: list[str], log: IO[str], progress: Callable[[int, int, str], None] | None, step: str) -> None:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, text=True, errors="replace", bufsize=1)
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            log.write(line)
            tail = (tail + [line.rstrip()])[-25:]
            if progress is not None:
                m = _NINJA_STEP.match(line)
                if m:
                    progress(int(m.group(1)), int(m.group(2)), line.rstrip())
                elif (m := _MAKE_STEP.match(line)):
                    progress(int(m.group(1)), 100, line.rstrip())
        rc = proc.wait()
        log.flush()
        if rc != 0:
            errors = [t for t in tail if "error" in t.lower()]
            hint = f": {errors[-1].strip()}" if errors else ""
            raise EngineBuildError(f"llama.cpp {step} failed (exit status {rc}){hint}; full log: {log.name}",
                                   log_tail="\n".join(tail))

    def build(self, plan: BuildPlan, log: IO[str], progress: Callable[[int, int, str], None] | None = None) -> None:
        generator = "Ninja" if self._which("ninja") else None
        cache = plan.build_dir / "CMakeCache.txt"
        if cache.is_file():
            text = cache.read_text(errors="replace")
            same_generator = f"CMAKE_GENERATOR:INTERNAL={generator or 'Unix Makefiles'}" in text
            if not same_generator:
                # CMake refuses to switch generators in an existing tree.
                shutil.rmtree(plan.build_dir)
        configure = cmake_configure_args(plan, generator=generator, cuda_compiler=self.cuda_compiler,
                                         host_flags=self.host_flags, env=self.env)
        self.configure_args = configure
        try:
            self._run(configure, log, None, "configure")
        except EngineBuildError:
            if not cache.is_file():
                raise
            # A tree left by an interrupted or older configure can poison the cache: retry clean.
            log.write("\nconfigure failed in an existing build tree; retrying in a fresh one\n")
            shutil.rmtree(plan.build_dir)
            self._run(configure, log, None, "configure")
        self._run(cmake_build_args(plan), log, progress, "build")
        install_outputs(plan.build_dir / "bin", plan.bin_dir)


def install_outputs(built_bin: Path, bin_dir: Path, targets: Sequence[str] = BUILD_TARGETS) -> None:
    """Copies the built executables and every shared library beside them into ``bin_dir``.

    Symbolic links (libllama.so -> libllama.so.0) are copied as links, so that the
    ``$ORIGIN`` rpaths of the executables still resolve.
    """
    if bin_dir.exists():
        shutil.rmtree(bin_dir)
    bin_dir.mkdir(parents=True)
    missing = [t for t in targets if not (built_bin / t).is_file()]
    if missing:
        raise EngineBuildError(f"the build finished without {', '.join(missing)} in {built_bin}")
    for item in sorted(built_bin.iterdir()):
        if item.name in targets or ".so" in item.name:
            shutil.copy2(item, bin_dir / item.name, follow_symlinks=False)


# --------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(install_dir: Path) -> Iterator[None]:
    """Serialise builds of one directory: two processes building into it would corrupt it."""
    install_dir.mkdir(parents=True, exist_ok=True)
    with open(install_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


SOURCE_MARKER = ".autotune-source.json"


def _prepared_source(sdist: Path, plan: BuildPlan, version: str, say: Callable[[str], None]) -> str | None:
    """Extracts the sources unless ``src/`` already holds this very sdist's tree.

    Skipping the extraction of an unchanged tree keeps a redone build incremental and saves
    unpacking 3,700 files; the marker names the archive by content, so a different sdist of
    the same version is extracted afresh.
    """
    identity = {"version": version, "sdist": str(sdist.resolve()),
                "sha256": _sha256(sdist) if sdist.is_file() else None}
    marker = plan.src_dir / SOURCE_MARKER
    with contextlib.suppress(OSError, ValueError):
        recorded = json.loads(marker.read_text(encoding="utf-8"))
        if recorded.get("identity") == identity:
            return recorded.get("commit")
    say(f"extracting vendor/llama.cpp from {sdist.name}")
    commit = extract_llama_cpp(sdist, plan.src_dir, version)
    marker.write_text(json.dumps({"identity": identity, "commit": commit}), encoding="utf-8")
    return commit


def _read_build(plan: BuildPlan) -> EngineBuild | None:
    if not plan.marker_path.is_file() or not _is_executable(plan.bin_dir / "llama-server"):
        return None
    try:
        manifest = json.loads(plan.marker_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return EngineBuild(plan.install_dir, plan.bin_dir / SERVER, plan.bin_dir / "llama-quantize",
                       plan.bin_dir, manifest, reused=True)


def build_llama_cpp(
    cuda_arch: str = "auto",
    *,
    jobs: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    sdist: str | os.PathLike[str] | None = None,
    force: bool = False,
    builder: Builder | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    status: Callable[[str], None] | None = None,
    gpus: Sequence[Any] | None = None,
    cuda_compiler: str | os.PathLike[str] | None = None,
) -> EngineBuild:
    """Builds llama.cpp's :data:`BUILD_TARGETS` into the cache, or reuses a build.

    A directory counts as built only when ``engine.json`` exists; it is written last, after
    the binaries ran ``--version``, so an interrupted build is redone (incrementally: the CMake
    tree is kept). A complete build made before autotune built the benchmarks keeps its
    directory (the cache key is unchanged) and gets only the missing executables compiled;
    until then its server stays in use.

    Args:
        cuda_arch: "auto" (the detected cards, or CPU without one), "cpu", or architectures
            such as "70" or "70,86".
        jobs: Parallel compile jobs; default the number of CPUs.
        cache_dir: The engines directory; default :func:`engines_dir`.
        sdist: A llama-cpp-python sdist (``.tar.gz`` or extracted) to build instead of
            downloading the pinned one; its version keys the cache directory.
        force: Rebuild even when a complete build exists.
        builder: What configures and compiles; default :class:`CMakeBuilder` (tests inject one).
        progress: Called with (steps done, steps total, line) while compiling.
        status: Called with a one-line description of each phase.
        gpus: Detected GPUs for "auto"; None asks NVML.
        cuda_compiler: The ``nvcc`` for a CUDA build (see :class:`CMakeBuilder`); an error
            for a CPU build, which has no use for one.

    Returns:
        The build.

    Raises:
        EngineBuildError: A tool is missing, the download or the build failed.
        ConfigError: A bad ``cuda_arch``, ``sdist`` or ``cuda_compiler``, or a CUDA compiler
            that cannot target the architecture.
    """
    say = status or (lambda _msg: None)
    arch = resolve_arch(cuda_arch, gpus)
    if cuda_compiler and arch == "cpu":
        why = "no NVIDIA card was detected" if cuda_arch.strip().lower() == "auto" else "a CPU build was asked for"
        raise ConfigError(f"--cuda-compiler {cuda_compiler}: the build is CPU-only ({why}); give --cuda-arch, "
                          "e.g. --cuda-arch 70, for a CUDA build")
    sdist_path = Path(sdist).expanduser() if sdist else None
    if sdist_path is not None and not sdist_path.exists():
        raise ConfigError(f"--sdist {sdist}: no such file or directory")
    version = sdist_version(sdist_path) if sdist_path is not None else LLAMA_CPP_PYTHON_VERSION
    if sdist_path is not None and sdist_path.is_file() and version == LLAMA_CPP_PYTHON_VERSION:
        digest = _sha256(sdist_path)
        if digest != LLAMA_CPP_PYTHON_SHA256:
            raise ConfigError(
                f"--sdist {sdist_path}: sha256 {digest} differs from PyPI's llama_cpp_python-"
                f"{version}.tar.gz ({LLAMA_CPP_PYTHON_SHA256}); download it again"
            )
    root = engines_dir(cache_dir)
    plan = BuildPlan(version, arch, root / f"llama.cpp-{version}-{arch_tag(arch)}", max(1, jobs or os.cpu_count() or 1))
    builder = builder or CMakeBuilder(cuda_compiler=cuda_compiler)

    with _locked(plan.install_dir):
        done = None if force else _read_build(plan)
        if done is not None and not done.missing_tools:
            say(f"reusing the build in {plan.install_dir}")
            return done
        if done is not None:
            # Its marker stays until the new one is written: if adding the tools fails, the
            # server it has keeps working.
            say(f"adding {', '.join(done.missing_tools)} to the build in {plan.install_dir} (the rest is up to date)")
        else:
            plan.marker_path.unlink(missing_ok=True)
        builder.check_tools(plan)
        started = time.monotonic()
        with plan.log_path.open("w", encoding="utf-8") as log:
            log.write(f"autotune engine build llama.cpp: llama-cpp-python {version}, arch {arch}, jobs {plan.jobs}\n")
            if sdist_path is None:
                cached = root / "downloads" / f"llama_cpp_python-{version}.tar.gz"
                say(f"using {cached}" if cached.is_file() else f"downloading llama-cpp-python {version} (sdist) with pip")
                sdist_path = download_sdist(version, root / "downloads", log)
                if version == LLAMA_CPP_PYTHON_VERSION and _sha256(sdist_path) != LLAMA_CPP_PYTHON_SHA256:
                    raise EngineBuildError(
                        f"{sdist_path}: sha256 differs from the pinned {LLAMA_CPP_PYTHON_SHA256}; "
                        "the index served another file: delete it and retry, or pass --sdist"
                    )
            commit = _prepared_source(sdist_path, plan, version, say)
            plan = BuildPlan(plan.version, plan.arch, plan.install_dir, plan.jobs, commit)
            say(f"building llama.cpp{' ' + commit if commit else ''} for {arch_tag(arch)} with {plan.jobs} jobs "
                f"(log: {plan.log_path})")
            builder.build(plan, log, progress)
        server = plan.bin_dir / SERVER
        try:
            version_info = engine_version(server)
        except EngineNotFoundError as exc:
            raise EngineBuildError(f"the built llama-server does not run: {exc}") from None
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "engine": "llama.cpp",
            "llama_cpp_python": version,
            "llama_cpp_commit": commit,
            "arch": arch,
            "tag": arch_tag(arch),
            "jobs": plan.jobs,
            "build_seconds": round(time.monotonic() - started, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "server": str(server),
            "quantize": str(plan.bin_dir / "llama-quantize"),
            "lib_dir": str(plan.bin_dir),
            "version": asdict(version_info),
            "cmake_args": list(getattr(builder, "configure_args", None) or []),
            "tools": {t: str(plan.bin_dir / t) for t in BUILD_TARGETS if _is_executable(plan.bin_dir / t)},
            "cuda": _cuda_record(getattr(builder, "cuda", None), arch),
        }
        # Write-then-rename: a crash while writing must not leave a marker that says "done".
        tmp = plan.marker_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        tmp.replace(plan.marker_path)
    return EngineBuild(plan.install_dir, server, plan.bin_dir / "llama-quantize", plan.bin_dir, manifest, reused=False)


def _cuda_record(compiler: cuda_toolkit.CudaCompiler | None, arch: str) -> dict[str, Any] | None:
    """What :func:`build_supports` and a reader of engine.json need to know of a CUDA build."""
    if arch == "cpu":
        return None
    record: dict[str, Any] = {"archs": arch.split(";")}
    if compiler is not None:
        record.update(compiler=compiler.path, source=compiler.source,
                      version=f"{compiler.version[0]}.{compiler.version[1]}")
    return record
