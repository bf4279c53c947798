"""Compiling llama.cpp: its pinned sources, the CMake build and the executables it installs.

The sources are the llama.cpp tree vendored in the llama-cpp-python source distribution on
PyPI, pinned to :data:`LLAMA_CPP_PYTHON_VERSION`. PyPI is reachable from machines that cannot
reach GitHub, pip honours the user's index and proxy settings, and the same tree yields a
``libllama.so`` that llama-cpp-python of that very version can load through
``LLAMA_CPP_LIB_PATH``. :func:`autotune_plugins.llama_server.engine.build_llama_cpp` drives
these steps and keeps the results in autotune's cache.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from autotune._builtin import processes
from autotune.api import AutotuneError
from autotune._builtin import ConfigError

__all__ = [
    "BENCH_TOOLS",
    "BUILD_TARGETS",
    "LLAMA_CPP_PYTHON_SHA256",
    "LLAMA_CPP_PYTHON_VERSION",
    "MARKER",
    "RPC_SERVER",
    "SERVER",
    "BuildPlan",
    "Builder",
    "CMakeBuilder",
    "EngineBuildError",
    "amx_guard_flags",
    "arch_tag",
    "cmake_build_args",
    "cmake_configure_args",
    "download_sdist",
    "extract_llama_cpp",
    "install_outputs",
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
# two benchmarks are one source file each over libraries the server already links: adding
# them took 17 s (19 CPU-s) on 2 cores, beside 1,058 s for the server and quantizer.
SERVER = "llama-server"
BENCH_TOOLS = ("llama-bench", "llama-batched-bench")
# llama.cpp's RPC backend (GGML_RPC) and its server: an rpc-server process on 127.0.0.1 is one
# more device to llama-server (--rpc HOST:PORT), so a CPU-only machine runs llama-server across
# several devices for real: split mode, -ts and the per-device memory model are tested without
# GPUs (issue 40). One C++ file over the ggml libraries; the target's name in this tree.
RPC_SERVER = "ggml-rpc-server"
BUILD_TARGETS = (SERVER, "llama-quantize", *BENCH_TOOLS, RPC_SERVER)

# Written last into a build's directory: its presence means the build is complete.
MARKER = "engine.json"

# Debian packages that provide each tool, for the error messages.
DEBIAN_PACKAGES = {
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
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"llama-cpp-python=={version}",
        "-d",
        str(dest),
    ]
    proc = processes.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
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
                    inner = rel[len("vendor/llama.cpp/") :]
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
        # The RPC backend: remote (or local) processes as extra devices (RPC_SERVER above).
        # The top-level CMakeLists names it in its deprecation table (LLAMA_RPC -> GGML_RPC).
        "GGML_RPC": "ON",
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
    probe = processes.run(
        [compiler, *AMX_FLAGS, "-E", "-x", "c", os.devnull],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    return list(AMX_FLAGS) if probe.returncode == 0 else []


def cmake_build_args(plan: BuildPlan, targets: Sequence[str] = BUILD_TARGETS) -> list[str]:
    """The ``cmake --build`` command: only ``targets``, ``plan.jobs`` at a time."""
    return ["cmake", "--build", str(plan.build_dir), "--config", "Release", "-j", str(plan.jobs), "--target", *targets]


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
