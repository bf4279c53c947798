"""Running a llama.cpp build: the builder protocol and CMake's, with progress read from ninja's and make's step lines."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Protocol
from autotune._builtin import processes
from autotune_plugins.llama_server import cuda_toolkit
from autotune_plugins.llama_server.llama_build import (
    DEBIAN_PACKAGES,
    BuildPlan,
    EngineBuildError,
    amx_guard_flags,
    cmake_build_args,
    cmake_configure_args,
    install_outputs,
)


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
        missing: list[str] = []  # keys of DEBIAN_PACKAGES
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
            packages = "; ".join(f"{labels.get(m, m)}: apt-get install {DEBIAN_PACKAGES[m]}" for m in missing)
            raise EngineBuildError(f"cannot build llama.cpp: {names_} not found on PATH (Debian/Ubuntu: {packages})")
        if found_nvcc:
            # Minutes before CMake would stop on "nvcc fatal : Unsupported gpu architecture".
            self.cuda = cuda_toolkit.inspect_cuda_compiler(*found_nvcc)
            cuda_toolkit.check_cuda_archs(plan.arch.split(";"), self.cuda)
        self.host_flags = amx_guard_flags(self._which(self.c_compiler or "") or self.c_compiler)

    def _run(self, cmd: list[str], log: IO[str], progress: Callable[[int, int, str], None] | None, step: str) -> None:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        proc = processes.start(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            text=True,
            errors="replace",
            bufsize=1,
        )
        assert proc.stdout is not None
        tail: list[str] = []
        try:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line.rstrip()])[-25:]
                if progress is not None:
                    m = _NINJA_STEP.match(line)
                    if m:
                        progress(int(m.group(1)), int(m.group(2)), line.rstrip())
                    elif m := _MAKE_STEP.match(line):
                        progress(int(m.group(1)), 100, line.rstrip())
            rc = proc.wait()
        finally:
            processes.stop(proc)  # an interrupted build's compilers, and what a finished one left running
        log.flush()
        if rc != 0:
            errors = [t for t in tail if "error" in t.lower()]
            hint = f": {errors[-1].strip()}" if errors else ""
            raise EngineBuildError(
                f"llama.cpp {step} failed (exit status {rc}){hint}; full log: {log.name}", log_tail="\n".join(tail)
            )

    def build(self, plan: BuildPlan, log: IO[str], progress: Callable[[int, int, str], None] | None = None) -> None:
        generator = "Ninja" if self._which("ninja") else None
        cache = plan.build_dir / "CMakeCache.txt"
        if cache.is_file():
            text = cache.read_text(errors="replace")
            same_generator = f"CMAKE_GENERATOR:INTERNAL={generator or 'Unix Makefiles'}" in text
            if not same_generator:
                # CMake refuses to switch generators in an existing tree.
                shutil.rmtree(plan.build_dir)
        configure = cmake_configure_args(
            plan, generator=generator, cuda_compiler=self.cuda_compiler, host_flags=self.host_flags, env=self.env
        )
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
