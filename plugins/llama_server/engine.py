"""``autotune engine build llama.cpp``: building llama.cpp into autotune's cache, and the one
import path for everything about the engine's builds.

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

Who owns what (all of it importable from here, as the backend, synth and scoring do):

* :mod:`~autotune_plugins.llama_server.llama_build`: the pinned sources, CMake, the builder;
* :mod:`~autotune_plugins.llama_server.cuda_toolkit`: which toolkit builds which card, and
  which build runs on which card;
* :mod:`~autotune_plugins.llama_server.builds`: the cache, finding executables, versions,
  :func:`build_supports`;
* :mod:`~autotune_plugins.llama_server.python_bindings`: llama-cpp-python on a build;
* this module: :func:`build_llama_cpp`, which puts them together.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from autotune._builtin import ConfigError
from autotune_plugins.llama_server import cuda_toolkit
from autotune_plugins.llama_server.builds import (
    ENGINE_TOOLS,
    MANIFEST_VERSION,
    MARKER,
    EngineBuild,
    EngineNotFoundError,
    EngineVersion,
    _is_executable,
    build_supports,
    built_engines,
    engine_version,
    engines_dir,
    find_engine_tool,
    find_llama_quantize,
    find_llama_server,
    parse_engine_version,
)
from autotune_plugins.llama_server.cuda_toolkit import cuda_arch_from_cc, resolve_arch
from autotune_plugins.llama_server.llama_build import (
    BENCH_TOOLS,
    BUILD_TARGETS,
    RPC_SERVER,
    LLAMA_CPP_PYTHON_SHA256,
    LLAMA_CPP_PYTHON_VERSION,
    SERVER,
    BuildPlan,
    EngineBuildError,
    _sha256,
    amx_guard_flags,
    arch_tag,
    cmake_build_args,
    cmake_configure_args,
    download_sdist,
    extract_llama_cpp,
    install_outputs,
    sdist_version,
)
from autotune_plugins.llama_server.cmake_builder import Builder, CMakeBuilder
from autotune_plugins.llama_server.python_bindings import import_llama_cpp, install_python_bindings

__all__ = [
    "BENCH_TOOLS",
    "BUILD_TARGETS",
    "RPC_SERVER",
    "ENGINE_TOOLS",
    "LLAMA_CPP_PYTHON_SHA256",
    "LLAMA_CPP_PYTHON_VERSION",
    "MANIFEST_VERSION",
    "MARKER",
    "SERVER",
    "BuildPlan",
    "Builder",
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
    identity = {
        "version": version,
        "sdist": str(sdist.resolve()),
        "sha256": _sha256(sdist) if sdist.is_file() else None,
    }
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
    return EngineBuild(
        plan.install_dir, plan.bin_dir / SERVER, plan.bin_dir / "llama-quantize", plan.bin_dir, manifest, reused=True
    )


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
        raise ConfigError(
            f"--cuda-compiler {cuda_compiler}: the build is CPU-only ({why}); give --cuda-arch, "
            "e.g. --cuda-arch 70, for a CUDA build"
        )
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
        # Adding tools appends: the log of the build they join stays readable.
        with plan.log_path.open("a" if done is not None else "w", encoding="utf-8") as log:
            log.write(f"autotune engine build llama.cpp: llama-cpp-python {version}, arch {arch}, jobs {plan.jobs}\n")
            if sdist_path is None:
                cached = root / "downloads" / f"llama_cpp_python-{version}.tar.gz"
                say(
                    f"using {cached}"
                    if cached.is_file()
                    else f"downloading llama-cpp-python {version} (sdist) with pip"
                )
                sdist_path = download_sdist(version, root / "downloads", log)
                if version == LLAMA_CPP_PYTHON_VERSION and _sha256(sdist_path) != LLAMA_CPP_PYTHON_SHA256:
                    raise EngineBuildError(
                        f"{sdist_path}: sha256 differs from the pinned {LLAMA_CPP_PYTHON_SHA256}; "
                        "the index served another file: delete it and retry, or pass --sdist"
                    )
            commit = _prepared_source(sdist_path, plan, version, say)
            plan = BuildPlan(plan.version, plan.arch, plan.install_dir, plan.jobs, commit)
            say(
                f"building llama.cpp{' ' + commit if commit else ''} for {arch_tag(arch)} with {plan.jobs} jobs "
                f"(log: {plan.log_path})"
            )
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
        record.update(
            compiler=compiler.path, source=compiler.source, version=f"{compiler.version[0]}.{compiler.version[1]}"
        )
    return record
