"""The llama_server plugin's engine builder: resolution, versions, CMake arguments, caching."""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner

from autotune import plugins
from autotune.errors import ConfigError
from autotune_plugins.llama_server import cuda_toolkit, engine, llama_build
from tests.conftest import plugin_registered
from autotune_plugins.llama_server.engine import (
    BuildPlan,
    CMakeBuilder,
    EngineBuildError,
    EngineNotFoundError,
    build_llama_cpp,
    cmake_configure_args,
    engine_version,
    find_llama_server,
    parse_engine_version,
    resolve_arch,
)

NEW_VERSION = "version: 0.5.0-dev (build 6123, commit 0c1e570)\nbuilt with GNU 12.2.0 for Linux x86_64\n"
OLD_VERSION = "version: 4567 (abcdef12)\nbuilt with cc (Debian 12.2.0) 12.2.0 for x86_64-linux-gnu\n"


@pytest.fixture
def llama_plugin():
    """The plugin registered as its entry point will register it."""
    import autotune_plugins.llama_server as module

    with plugin_registered(module, "llama_server"):
        yield module


@pytest.fixture
def cli(llama_plugin):
    @click.group()
    def group():
        """A fresh group, so the real CLI keeps its commands."""

    plugins.add_commands(group)
    return group


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No variable of the user's may point the code at a real engine or cache."""
    for var in ("AUTOTUNE_LLAMA_SERVER", "AUTOTUNE_LLAMA_QUANTIZE", "AUTOTUNE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return tmp_path


def fake_exe(path: Path, output: str = NEW_VERSION, to_stderr: bool = True) -> Path:
    """An executable shell script that prints ``output`` (on stderr, as llama.cpp does)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    redirect = " >&2" if to_stderr else ""
    path.write_text(f"#!/bin/sh\ncat{redirect} <<'EOF'\n{output}EOF\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_build_dir(
    root: Path,
    arch: str = "cpu",
    version: str = engine.LLAMA_CPP_PYTHON_VERSION,
    tools: tuple[str, ...] = engine.BUILD_TARGETS,
) -> Path:
    """A complete build in an engines directory, as build_llama_cpp leaves it (``tools``
    narrower for one made before autotune built the benchmarks)."""
    install = root / f"llama.cpp-{version}-{engine.arch_tag(arch)}"
    fake_exe(install / "bin" / "llama-server")
    for tool in tools:
        if tool != "llama-server":
            fake_exe(install / "bin" / tool, "usage\n")
    (install / engine.MARKER).write_text(
        json.dumps({"arch": arch, "llama_cpp_python": version, "tag": engine.arch_tag(arch)})
    )
    return install


# ------------------------------------------------------------------ resolution order


def test_find_llama_server_resolution_order(clean_env, monkeypatch):
    tmp = clean_env
    cache = tmp / "cache"
    setting = fake_exe(tmp / "setting" / "llama-server")
    env_exe = fake_exe(tmp / "env" / "llama-server")
    built = fake_build_dir(cache) / "bin" / "llama-server"
    on_path = fake_exe(tmp / "path-dir" / "llama-server")
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.setenv("AUTOTUNE_LLAMA_SERVER", str(env_exe))

    assert find_llama_server({"binary": str(setting)}, cache_dir=cache) == setting
    assert find_llama_server({}, cache_dir=cache) == env_exe
    monkeypatch.delenv("AUTOTUNE_LLAMA_SERVER")
    assert find_llama_server({}, cache_dir=cache, arch="cpu") == built
    assert find_llama_server(None, cache_dir=tmp / "no-cache") == on_path


def test_find_llama_server_setting_may_name_a_directory(clean_env):
    exe = fake_exe(clean_env / "engine" / "llama-server")
    assert find_llama_server({"binary": str(exe.parent)}, cache_dir=clean_env / "c") == exe


def test_find_llama_server_explicit_but_missing_is_an_error(clean_env, monkeypatch):
    fake_build_dir(clean_env / "cache")  # a fallback exists, and must not be used silently
    with pytest.raises(EngineNotFoundError, match=r"setting binary = '/nowhere/llama-server'"):
        find_llama_server({"binary": "/nowhere/llama-server"}, cache_dir=clean_env / "cache")
    monkeypatch.setenv("AUTOTUNE_LLAMA_SERVER", "/nowhere/either")
    with pytest.raises(EngineNotFoundError, match="AUTOTUNE_LLAMA_SERVER"):
        find_llama_server({}, cache_dir=clean_env / "cache")


def test_find_llama_server_none_says_what_to_do(clean_env):
    with pytest.raises(EngineNotFoundError, match=r"autotune engine build llama.cpp.*AUTOTUNE_LLAMA_SERVER"):
        find_llama_server({}, cache_dir=clean_env / "cache")


def test_incomplete_build_is_not_used(clean_env):
    install = fake_build_dir(clean_env / "cache")
    (install / engine.MARKER).unlink()  # interrupted: binaries present, marker missing
    with pytest.raises(EngineNotFoundError):
        find_llama_server({}, cache_dir=clean_env / "cache")


def test_build_for_the_detected_gpu_is_preferred(clean_env):
    cache = clean_env / "cache"
    fake_build_dir(cache, "cpu")
    sm70 = fake_build_dir(cache, "70")
    sm90 = fake_build_dir(cache, "90")
    assert find_llama_server({}, cache_dir=cache, arch="70") == sm70 / "bin" / "llama-server"
    assert find_llama_server({}, cache_dir=cache, arch="90") == sm90 / "bin" / "llama-server"
    assert find_llama_server({}, cache_dir=cache, arch="cpu").parent.parent.name.endswith("-cpu")


def test_find_llama_quantize_beside_the_server(clean_env):
    server = fake_exe(clean_env / "engine" / "llama-server")
    quant = fake_exe(clean_env / "engine" / "llama-quantize")
    assert engine.find_llama_quantize({"binary": str(server)}, cache_dir=clean_env / "c") == quant


def test_engines_dir_honours_environment(clean_env, monkeypatch):
    assert engine.engines_dir() == clean_env / "home" / ".cache" / "autotune" / "engines"
    monkeypatch.setenv("XDG_CACHE_HOME", str(clean_env / "xdg"))
    assert engine.engines_dir() == clean_env / "xdg" / "autotune" / "engines"
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(clean_env / "at"))
    assert engine.engines_dir() == clean_env / "at" / "engines"
    assert engine.engines_dir(clean_env / "explicit") == clean_env / "explicit"


# ------------------------------------------------------------------ versions


def test_parse_new_version_format():
    v = parse_engine_version("load_backend: loaded CPU backend from ./libggml-cpu.so\n" + NEW_VERSION)
    assert (v.release, v.build_number, v.commit) == ("0.5.0-dev", 6123, "0c1e570")
    assert (v.compiler, v.target) == ("GNU 12.2.0", "Linux x86_64")
    assert v.label == "llama.cpp 0.5.0-dev b6123 (0c1e570)"


def test_parse_old_version_format():
    v = parse_engine_version(OLD_VERSION)
    assert (v.release, v.build_number, v.commit) == (None, 4567, "abcdef12")
    assert v.label == "llama.cpp b4567 (abcdef12)"


def test_parse_version_unknown_commit_and_garbage():
    assert parse_engine_version("version: 0 (unknown)\n").commit is None
    assert parse_engine_version("error: unknown argument --version") is None


def test_engine_version_runs_the_binary_and_reads_stderr(tmp_path):
    exe = fake_exe(tmp_path / "llama-server", OLD_VERSION, to_stderr=True)
    v = engine_version(exe)
    assert v.build_number == 4567 and v.commit == "abcdef12"
    assert "built with" in v.raw


def test_engine_version_errors(tmp_path):
    with pytest.raises(EngineNotFoundError, match="no such executable"):
        engine_version(tmp_path / "missing")
    bad = fake_exe(tmp_path / "bad", "error while loading shared libraries: libllama.so.0\n")
    with pytest.raises(EngineNotFoundError, match="libllama.so.0"):
        engine_version(bad)


# ------------------------------------------------------------------ architectures and CMake

# A top-level CMakeLists.txt that knows every option the builder may pass.
KNOWN = (
    "option(LLAMA_CURL) option(LLAMA_OPENSSL) LLAMA_BUILD_TESTS LLAMA_BUILD_EXAMPLES LLAMA_USE_PREBUILT_UI LLAMA_BUILD_UI "
    "llama_option_depr(WARNING LLAMA_RPC GGML_RPC)"
)


def gpu(cc: str) -> SimpleNamespace:
    return SimpleNamespace(compute_capability=cc)


def plan_for(arch: str, tmp_path: Path) -> BuildPlan:
    return BuildPlan("0.3.36", arch, tmp_path / f"llama.cpp-0.3.36-{engine.arch_tag(arch)}", 2, "0c1e570")


def test_cmake_args_cpu(tmp_path):
    args = cmake_configure_args(plan_for("cpu", tmp_path), known_options=KNOWN)
    assert args[:7] == [
        "cmake",
        "-S",
        str(tmp_path / "llama.cpp-0.3.36-cpu" / "src"),
        "-B",
        str(tmp_path / "llama.cpp-0.3.36-cpu" / "build"),
        "-G",
        "Ninja",
    ]
    for flag in (
        "-DGGML_CUDA=OFF",
        "-DBUILD_SHARED_LIBS=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_COMMIT=0c1e570",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_RPC=ON",
    ):
        assert flag in args
    assert not [a for a in args if "CUDA_ARCHITECTURES" in a]
    # The RPC backend's server is built and installed with the rest (issue 40: several devices
    # on a CPU-only machine).
    assert engine.RPC_SERVER in engine.BUILD_TARGETS


@pytest.mark.parametrize(("cc", "arch"), [("7.0", "70"), ("9.0", "90"), ("8.6", "86")])
def test_cmake_args_cuda_from_compute_capability(tmp_path, cc, arch):
    resolved = resolve_arch("auto", gpus=[gpu(cc)])
    assert resolved == arch
    args = cmake_configure_args(plan_for(resolved, tmp_path), known_options=KNOWN)
    assert "-DGGML_CUDA=ON" in args
    assert f"-DCMAKE_CUDA_ARCHITECTURES={arch}" in args
    assert plan_for(resolved, tmp_path).install_dir.name == f"llama.cpp-0.3.36-sm_{arch}"


def test_cmake_args_skip_options_the_tree_does_not_know(tmp_path):
    args = cmake_configure_args(plan_for("cpu", tmp_path), known_options="LLAMA_BUILD_TESTS", generator=None)
    assert "-DLLAMA_BUILD_TESTS=OFF" in args
    assert "-DLLAMA_CURL=OFF" not in args and "-G" not in args


AMX_CPUINFO = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"


def test_amx_is_kept_out_of_native_builds(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_build.platform, "machine", lambda: "x86_64")
    accepting = fake_exe(tmp_path / "cc", "")
    rejecting = fake_exe(tmp_path / "old-cc", "")
    rejecting.write_text(rejecting.read_text() + "exit 1\n")
    assert engine.amx_guard_flags(str(accepting), AMX_CPUINFO) == ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    assert engine.amx_guard_flags(str(accepting), "flags\t\t: fpu avx2 avx512f\n") == []
    assert engine.amx_guard_flags(str(rejecting), AMX_CPUINFO) == []  # too old to emit AMX anyway
    args = cmake_configure_args(
        plan_for("cpu", tmp_path), known_options=KNOWN, host_flags=["-mno-amx-tile"], env={"CFLAGS": "-O2 -g"}
    )
    assert "-DCMAKE_C_FLAGS=-O2 -g -mno-amx-tile" in args and "-DCMAKE_CXX_FLAGS=-mno-amx-tile" in args


def test_resolve_arch():
    assert resolve_arch("auto", gpus=[]) == "cpu"  # no GPU: the only build that runs here
    assert resolve_arch("auto", gpus=[gpu("8.6"), gpu("7.0"), gpu("8.6")]) == "70;86"
    assert resolve_arch("cpu") == "cpu"
    assert resolve_arch("90,70") == "70;90"
    assert resolve_arch("sm_70") == "70"
    with pytest.raises(ConfigError, match=r"--cuda-arch 'volta'"):
        resolve_arch("volta")


# ------------------------------------------------------------------ sdist handling


def make_sdist(tmp_path: Path, version: str = "9.9.9") -> Path:
    """A minimal llama-cpp-python sdist: PKG-INFO, CHANGELOG, the submodule HEAD and a tree."""
    top = f"llama_cpp_python-{version}"
    files = {
        f"{top}/PKG-INFO": f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {version}\n",
        f"{top}/CHANGELOG.md": f"## [{version}]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@abcdef123456\n",
        f"{top}/.git/modules/vendor/llama.cpp/HEAD": "0c1e57098bba43ac29e6e3b677cdceebdd22334f\n",
        f"{top}/vendor/llama.cpp/CMakeLists.txt": KNOWN,
        f"{top}/vendor/llama.cpp/.git": "gitdir: ../../.git/modules/vendor/llama.cpp\n",
        f"{top}/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf": "not really",
    }
    path = tmp_path / f"{top}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_llama_cpp(tmp_path):
    sdist = make_sdist(tmp_path)
    assert engine.sdist_version(sdist) == "9.9.9"
    commit = engine.extract_llama_cpp(sdist, tmp_path / "src", "9.9.9")
    assert commit == "0c1e57098"  # the submodule HEAD wins over the CHANGELOG
    assert (tmp_path / "src" / "CMakeLists.txt").read_text() == KNOWN
    assert (tmp_path / "src" / "models" / "ggml-vocab-qwen2.gguf").is_file()
    assert not (tmp_path / "src" / ".git").exists()  # a dangling gitdir link would confuse CMake


class FakeBuilder:
    """Writes fake binaries instead of compiling; counts its calls."""

    def __init__(self, fail: bool = False):
        self.calls = 0
        self.fail = fail

    def check_tools(self, plan):
        pass

    def build(self, plan, log, progress):
        self.calls += 1
        assert (plan.src_dir / "CMakeLists.txt").is_file()
        log.write("fake build\n")
        if progress:
            progress(1, 1, "[1/1] Linking CXX executable bin/llama-server")
        if self.fail:
            fake_exe(plan.bin_dir / "llama-server")  # left behind by the "interrupted" build
            raise EngineBuildError("llama.cpp build failed (exit status 1)")
        fake_exe(plan.bin_dir / "llama-server")
        for tool in engine.BUILD_TARGETS[1:]:
            fake_exe(plan.bin_dir / tool, "usage\n")


def test_build_then_reuse(tmp_path):
    sdist = make_sdist(tmp_path)
    builder = FakeBuilder()
    first = build_llama_cpp("cpu", cache_dir=tmp_path / "engines", sdist=sdist, builder=builder, jobs=3)
    assert builder.calls == 1 and not first.reused
    assert first.install_dir == tmp_path / "engines" / "llama.cpp-9.9.9-cpu"
    manifest = json.loads((first.install_dir / "engine.json").read_text())
    assert manifest["arch"] == "cpu" and manifest["jobs"] == 3 and manifest["llama_cpp_commit"] == "0c1e57098"
    assert manifest["tools"]["llama-bench"] == str(first.install_dir / "bin" / "llama-bench")
    assert set(manifest["tools"]) == set(engine.BUILD_TARGETS) and manifest["cuda"] is None
    assert manifest["version"]["build_number"] == 6123
    assert "fake build" in (first.install_dir / "build.log").read_text()

    again = build_llama_cpp("cpu", cache_dir=tmp_path / "engines", sdist=sdist, builder=builder)
    assert builder.calls == 1 and again.reused and again.server == first.server

    build_llama_cpp("cpu", cache_dir=tmp_path / "engines", sdist=sdist, builder=builder, force=True)
    assert builder.calls == 2


def test_unchanged_sources_are_not_extracted_again(tmp_path, monkeypatch):
    sdist = make_sdist(tmp_path)
    calls = []
    real = engine.extract_llama_cpp
    monkeypatch.setattr(engine, "extract_llama_cpp", lambda *a: calls.append(a) or real(*a))
    build_llama_cpp("cpu", cache_dir=tmp_path / "e", sdist=sdist, builder=FakeBuilder())
    second = build_llama_cpp("cpu", cache_dir=tmp_path / "e", sdist=sdist, builder=FakeBuilder(), force=True)
    assert len(calls) == 1  # the rebuild reused src/, so CMake's tree stays incremental
    assert second.manifest["llama_cpp_commit"] == "0c1e57098"


def test_interrupted_build_is_redone(tmp_path):
    sdist = make_sdist(tmp_path)
    with pytest.raises(EngineBuildError):
        build_llama_cpp("cpu", cache_dir=tmp_path / "e", sdist=sdist, builder=FakeBuilder(fail=True))
    install = tmp_path / "e" / "llama.cpp-9.9.9-cpu"
    assert (install / "bin" / "llama-server").exists() and not (install / "engine.json").exists()
    builder = FakeBuilder()
    result = build_llama_cpp("cpu", cache_dir=tmp_path / "e", sdist=sdist, builder=builder)
    assert builder.calls == 1 and not result.reused and (install / "engine.json").exists()


def test_pinned_sdist_with_wrong_hash_is_refused(tmp_path):
    sdist = make_sdist(tmp_path, engine.LLAMA_CPP_PYTHON_VERSION)
    with pytest.raises(ConfigError, match="sha256"):
        build_llama_cpp("cpu", cache_dir=tmp_path / "e", sdist=sdist, builder=FakeBuilder())


# ------------------------------------------------------------------ errors


def test_missing_cmake_names_the_debian_package(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    builder = CMakeBuilder(env={"PATH": str(empty)})
    with pytest.raises(EngineBuildError, match=r"cmake.*not found on PATH.*apt-get install cmake"):
        builder.check_tools(plan_for("cpu", tmp_path))


def test_missing_nvcc_for_a_cuda_build(tmp_path, monkeypatch):
    tools = tmp_path / "bin"
    for name in ("cmake", "c++", "cc", "ninja"):
        fake_exe(tools / name, "")
    monkeypatch.setattr(cuda_toolkit, "DEFAULT_NVCC", tmp_path / "no-cuda" / "nvcc")  # even on a CUDA machine
    builder = CMakeBuilder(env={"PATH": str(tools)})
    builder.check_tools(plan_for("cpu", tmp_path))  # a CPU build needs no nvcc
    with pytest.raises(EngineBuildError, match="nvcc.*nvidia-cuda-toolkit"):
        builder.check_tools(plan_for("70", tmp_path))


def test_cli_missing_cmake(cli, clean_env, monkeypatch):
    sdist = make_sdist(clean_env)
    result = CliRunner().invoke(
        cli,
        [
            "engine",
            "build",
            "llama.cpp",
            "--cuda-arch",
            "cpu",
            "--sdist",
            str(sdist),
            "--cache-dir",
            str(clean_env / "e"),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "cmake" in result.output and "apt-get install cmake" in result.output


def test_download_failure_says_to_pass_sdist(tmp_path, monkeypatch):
    # A fake "python" that fails as pip does without network.
    pip = fake_exe(tmp_path / "fake-python", "ERROR: Could not find a version that satisfies the requirement\n")
    pip.write_text(pip.read_text() + "exit 1\n")
    monkeypatch.setattr(llama_build.sys, "executable", str(pip))
    with pytest.raises(EngineBuildError, match="pass --sdist PATH") as info:
        engine.download_sdist("0.0.1", tmp_path / "dl")
    assert "Could not find a version" in info.value.log_tail


def test_cli_bad_arch_is_a_usage_error(cli, clean_env):
    result = CliRunner().invoke(cli, ["engine", "build", "llama.cpp", "--cuda-arch", "volta"])
    assert result.exit_code == 2
    assert "--cuda-arch 'volta'" in result.output


def test_cli_build_reuse_and_list(cli, clean_env, monkeypatch):
    install = fake_build_dir(clean_env / "e")
    # A complete build exists: the command must not touch the network or a compiler.
    result = CliRunner().invoke(
        cli, ["engine", "build", "llama.cpp", "--cuda-arch", "cpu", "--cache-dir", str(clean_env / "e")]
    )
    assert result.exit_code == 0, result.output
    assert "reused" in result.output and str(install / "bin" / "llama-server") in result.output
    listed = CliRunner().invoke(cli, ["engine", "list", "--cache-dir", str(clean_env / "e")])
    assert install.name in listed.output


def test_cli_cpu_and_another_arch_contradict(cli, clean_env):
    result = CliRunner().invoke(cli, ["engine", "build", "llama.cpp", "--cpu", "--cuda-arch", "70"])
    assert result.exit_code == 2
    assert "--cpu and --cuda-arch 70" in result.output


def test_import_llama_cpp_says_how_to_install(monkeypatch):
    import importlib.util
    import sys

    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(engine.EngineNotFoundError, match="engine build llama.cpp --python"):
        engine.import_llama_cpp({})


def test_import_llama_cpp_keeps_an_explicit_library_path(monkeypatch, tmp_path):
    import importlib.metadata
    import sys

    try:
        importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llama-cpp-python is not installed")
    for name in [m for m in sys.modules if m == "llama_cpp" or m.startswith("llama_cpp.")]:
        monkeypatch.delitem(sys.modules, name)  # restored after the test
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))  # the user's choice, holding no libllama.so
    with pytest.raises(engine.EngineNotFoundError, match=str(tmp_path)):
        engine.import_llama_cpp({})
    assert os.environ["LLAMA_CPP_LIB_PATH"] == str(tmp_path)


# ------------------------------------------------------------------ the real thing


@pytest.mark.skipif(
    os.environ.get("AUTOTUNE_TEST_BUILD") != "1" and os.environ.get("AUTOTUNE_REQUIRE_ENGINE") != "1",
    reason="set AUTOTUNE_TEST_BUILD=1 to compile llama.cpp (minutes)",
)
def test_real_cpu_build():
    # In CI the README's test command has just built it: this checks that build (reused).
    build = build_llama_cpp("cpu", jobs=os.cpu_count())
    version = engine_version(build.server)
    assert version.commit, version.raw
    assert build.quantize.is_file()
    assert any(p.name.startswith("libllama.so") for p in build.lib_dir.iterdir())
    assert find_llama_server({}, arch="cpu") == build.server


# ------------------------------------------------------------------ the benchmarks, built beside the server


def test_a_build_made_before_the_benchmarks_gets_only_them_added(tmp_path):
    sdist = make_sdist(tmp_path)
    first = build_llama_cpp("cpu", cache_dir=tmp_path / "e", sdist=sdist, builder=FakeBuilder())
    for tool in engine.BENCH_TOOLS:  # as a build of the previous release left it
        (first.install_dir / "bin" / tool).unlink()
    marker = first.install_dir / engine.MARKER
    marker.write_text(json.dumps({"arch": "cpu", "llama_cpp_python": "9.9.9", "manifest_version": 1}))
    # Lookups keep using it as it is: nothing is rebuilt by finding the server.
    assert find_llama_server({}, cache_dir=tmp_path / "e", arch="cpu") == first.server
    with pytest.raises(EngineNotFoundError, match=r"llama-bench: the llama.cpp build in .* predates.*--cuda-arch cpu"):
        engine.find_engine_tool("llama-bench", cache_dir=tmp_path / "e", arch="cpu")

    # Adding them fails: the old build is still complete and usable.
    with pytest.raises(EngineBuildError):
        build_llama_cpp("cpu", cache_dir=tmp_path / "e", sdist=sdist, builder=FakeBuilder(fail=True))
    assert marker.is_file() and find_llama_server({}, cache_dir=tmp_path / "e", arch="cpu") == first.server

    builder = FakeBuilder()
    added = build_llama_cpp("cpu", cache_dir=tmp_path / "e", sdist=sdist, builder=builder)
    assert builder.calls == 1 and added.install_dir == first.install_dir and not added.missing_tools
    assert json.loads(marker.read_text())["manifest_version"] == engine.MANIFEST_VERSION
    assert (first.install_dir / "build.log").read_text().count("fake build") == 3  # appended, not replaced
    assert (
        engine.find_engine_tool("llama-batched-bench", cache_dir=tmp_path / "e", arch="cpu")
        == first.install_dir / "bin" / "llama-batched-bench"
    )
    build_llama_cpp("cpu", cache_dir=tmp_path / "e", sdist=sdist, builder=builder)
    assert builder.calls == 1  # now complete: reused


def test_find_engine_tool_follows_the_server(clean_env):
    server = fake_exe(clean_env / "engine" / "llama-server")
    bench = fake_exe(clean_env / "engine" / "llama-bench", "usage\n")
    fake_build_dir(clean_env / "cache")  # another tree: its llama-bench must not be picked
    assert engine.find_engine_tool("llama-bench", {"binary": str(server)}, cache_dir=clean_env / "cache") == bench
    with pytest.raises(EngineNotFoundError, match=r"llama-batched-bench: none beside .*engine/llama-server"):
        engine.find_engine_tool("llama-batched-bench", {"binary": str(server)}, cache_dir=clean_env / "cache")
    with pytest.raises(ConfigError, match=r"engine tool 'llama-cli': autotune builds llama-server, llama-quantize"):
        engine.find_engine_tool("llama-cli")


def test_install_outputs_copies_every_target_and_refuses_a_missing_one(tmp_path):
    built = tmp_path / "build" / "bin"
    for tool in engine.BUILD_TARGETS:
        fake_exe(built / tool, "")
    (built / "libllama-bench-impl.so").write_text("")
    fake_exe(built / "llama-cli", "")  # built as a dependency, not ours to ship
    engine.install_outputs(built, tmp_path / "bin")
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == sorted(
        [*engine.BUILD_TARGETS, "libllama-bench-impl.so"]
    )
    (built / "llama-batched-bench").unlink()
    with pytest.raises(EngineBuildError, match="without llama-batched-bench"):
        engine.install_outputs(built, tmp_path / "bin2")


def test_cmake_builds_the_benchmarks_and_the_rpc_server(tmp_path):
    args = engine.cmake_build_args(plan_for("cpu", tmp_path))
    assert args[args.index("--target") + 1 :] == [
        "llama-server",
        "llama-quantize",
        "llama-bench",
        "llama-batched-bench",
        "ggml-rpc-server",
    ]


# ------------------------------------------------------------------ which card a build runs on


@pytest.mark.parametrize(
    ("built", "cc", "verdict"),
    [
        ("70", "7.0", None),
        ("70;86", "8.6", None),
        ("80", "8.6", None),  # same major, newer minor: the sm_80 machine code runs
        ("90a", "9.0", None),
        ("75", "7.0", "no kernels this card can run"),
        ("90", "7.0", "no kernels this card can run"),
        ("70", "9.0", "PTX JIT-compiled for sm_70"),
        ("90a", "10.0", "no kernels this card can run"),
        ("cpu", "7.0", "CPU-only: on this card, sm_70 (Volta, e.g. V100), it would measure the CPU"),
    ],
)
def test_build_supports(tmp_path, built, cc, verdict):
    install = fake_build_dir(tmp_path, built)
    answer = engine.build_supports(install / "bin" / "llama-server", cc)
    if verdict is None:
        assert answer is None
    else:
        assert verdict in answer
        card = engine.cuda_arch_from_cc(cc)
        assert f"autotune engine build llama.cpp --cuda-arch {card}" in answer


def test_build_supports_names_the_toolkit_an_old_card_needs(tmp_path):
    fake_build_dir(tmp_path, "cpu")
    [build] = engine.built_engines(tmp_path)
    answer = engine.build_supports(build, "7.0")
    assert "--cuda-compiler /usr/local/cuda-12.9/bin/nvcc" in answer  # CUDA 13 cannot build sm_70
    assert "cuda-12.9" not in engine.build_supports(build, "9.0")
    assert engine.build_supports(build, None) is None  # no card: a CPU build is the right one


def test_build_supports_a_binary_autotune_did_not_build(tmp_path):
    cpu_only = fake_exe(tmp_path / "cpu" / "llama-server")
    (tmp_path / "cpu" / "libggml-base.so").write_text("")
    assert "no CUDA backend" in engine.build_supports(cpu_only, "7.0")
    (tmp_path / "cpu" / "libggml-cuda.so").write_text("")
    assert engine.build_supports(cpu_only, "7.0") is None  # its architectures are unknown: not refused
    static = fake_exe(tmp_path / "static" / "llama-server")
    assert engine.build_supports(static, "7.0") is None


# ------------------------------------------------------------------ the CUDA toolkit, checked before compiling

NVCC_13 = (
    "nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
    "Built on Wed_Aug_20_01:58:59_PM_PDT_2025\nCuda compilation tools, release 13.0, V13.0.88\n"
    "Build cuda_13.0.r13.0/compiler.36424714_0\n"
)
# What CUDA 13.0's nvcc --list-gpu-arch printed on an H200 machine.
NVCC_13_ARCHS = (
    "compute_75 compute_80 compute_86 compute_87 compute_88 compute_89 compute_90 compute_100 "
    "compute_110 compute_103 compute_120 compute_121"
).replace(" ", "\n") + "\n"


def fake_nvcc(path: Path, release: str, archs: str | None = None) -> Path:
    """An nvcc that prints ``release``'s --version (on stdout, as nvcc does), and ``archs`` for
    --list-gpu-arch (an unknown option before CUDA 11: exit 1)."""
    version = NVCC_13.replace("13.0", release)
    # Shell builtins only: the tests' PATH may hold nothing else.
    listing = f"printf '%s' '{archs}'; exit 0" if archs else "echo 'nvcc fatal : Unknown option' >&2; exit 1"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = --list-gpu-arch ]; then {listing}; fi\nprintf '%s' '{version}'\n")
    path.chmod(0o755)
    return path


def build_tools(root: Path) -> Path:
    tools = root / "tools"
    for name in ("cmake", "c++", "cc", "ninja"):
        fake_exe(tools / name, "")
    return tools


def test_parse_nvcc_output():
    assert cuda_toolkit.parse_nvcc_version(NVCC_13) == (13, 0)
    assert cuda_toolkit.parse_nvcc_version("Cuda compilation tools, release 12.9, V12.9.86") == (12, 9)
    assert cuda_toolkit.parse_nvcc_version("bash: nvcc: command not found") is None
    assert {"75", "90", "121"} <= cuda_toolkit.parse_gpu_arch_list(NVCC_13_ARCHS)
    assert "70" not in cuda_toolkit.parse_gpu_arch_list(NVCC_13_ARCHS)


@pytest.mark.parametrize("listing", [None, NVCC_13_ARCHS], ids=["version-only", "list-gpu-arch"])
def test_cuda_13_refuses_volta_before_compiling(tmp_path, listing, monkeypatch):
    monkeypatch.setattr(cuda_toolkit, "VERSIONED_NVCC_GLOB", str(tmp_path / "none" / "*"))
    nvcc = fake_nvcc(tmp_path / "cuda-13.0" / "bin" / "nvcc", "13.0", listing)
    builder = CMakeBuilder(env={"PATH": f"{build_tools(tmp_path)}:{nvcc.parent}"})
    with pytest.raises(ConfigError) as info:
        builder.check_tools(plan_for("70", tmp_path))
    message = str(info.value)
    for part in (
        "--cuda-arch 70",
        "CUDA 13.0",
        str(nvcc),
        "sm_70 (Volta, e.g. V100)",
        "the last toolkit that can is CUDA 12.9",
        "--cuda-compiler /usr/local/cuda-12.9/bin/nvcc",
        "CUDACXX=/usr/local/cuda-12.9/bin/nvcc",
    ):
        assert part in message
    builder.check_tools(plan_for("75;90a", tmp_path))  # Turing and Hopper: fine with 13.0
    assert builder.cuda_compiler == str(nvcc) and builder.cuda.version == (13, 0)


def test_cuda_12_9_builds_volta_and_an_installed_one_is_named(tmp_path, monkeypatch):
    cuda12 = fake_nvcc(tmp_path / "cuda-12.9" / "bin" / "nvcc", "12.9")
    cuda13 = fake_nvcc(tmp_path / "cuda-13.0" / "bin" / "nvcc", "13.0")
    monkeypatch.setattr(cuda_toolkit, "VERSIONED_NVCC_GLOB", str(tmp_path / "cuda-*" / "bin" / "nvcc"))
    tools = build_tools(tmp_path)
    with pytest.raises(
        ConfigError,
        match=rf"CUDA 12.9 is installed at {cuda12} and can: rerun with "
        rf"--cuda-compiler {cuda12} \(or CUDACXX={cuda12}\)",
    ):
        CMakeBuilder(env={"PATH": str(tools), "CUDACXX": str(cuda13)}).check_tools(plan_for("70", tmp_path))
    for builder in (
        CMakeBuilder(env={"PATH": f"{tools}:{cuda13.parent}"}, cuda_compiler=cuda12),  # flag over PATH
        CMakeBuilder(env={"PATH": f"{tools}:{cuda13.parent}", "CUDACXX": str(cuda12)}),
    ):
        builder.check_tools(plan_for("70", tmp_path))
        assert builder.cuda_compiler == str(cuda12)
    args = cmake_configure_args(plan_for("70", tmp_path), known_options=KNOWN, cuda_compiler=builder.cuda_compiler)
    assert f"-DCMAKE_CUDA_COMPILER={cuda12}" in args


def test_a_new_card_needs_a_new_enough_toolkit(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_toolkit, "VERSIONED_NVCC_GLOB", str(tmp_path / "none" / "*"))
    nvcc = fake_nvcc(tmp_path / "cuda-12.4" / "bin" / "nvcc", "12.4")
    with pytest.raises(ConfigError, match=r"cannot compile for sm_120 \(Blackwell.*needs CUDA 12.8 or newer"):
        CMakeBuilder(env={"PATH": str(build_tools(tmp_path))}, cuda_compiler=nvcc).check_tools(
            plan_for("120", tmp_path)
        )


def test_a_cuda_compiler_that_is_not_there_is_named(tmp_path):
    tools = build_tools(tmp_path)
    with pytest.raises(ConfigError, match=r"--cuda-compiler /nowhere/nvcc: no executable nvcc"):
        CMakeBuilder(env={"PATH": str(tools)}, cuda_compiler="/nowhere/nvcc").check_tools(plan_for("70", tmp_path))
    with pytest.raises(ConfigError, match=r"CUDACXX /nowhere/nvcc: no executable nvcc"):
        CMakeBuilder(env={"PATH": str(tools), "CUDACXX": "/nowhere/nvcc"}).check_tools(plan_for("70", tmp_path))
    broken = fake_exe(tmp_path / "broken" / "nvcc", "Segmentation fault\n")
    with pytest.raises(ConfigError, match=r"no 'release X.Y' line \(Segmentation fault\)"):
        CMakeBuilder(env={"PATH": str(tools)}, cuda_compiler=broken).check_tools(plan_for("70", tmp_path))


def test_cli_cuda_13_for_a_v100_is_exit_2_before_any_download(cli, clean_env, monkeypatch):
    monkeypatch.setattr(cuda_toolkit, "VERSIONED_NVCC_GLOB", str(clean_env / "none" / "*"))
    nvcc = fake_nvcc(clean_env / "cuda-13.0" / "bin" / "nvcc", "13.0", NVCC_13_ARCHS)
    monkeypatch.setenv("PATH", str(build_tools(clean_env)))
    result = CliRunner().invoke(
        cli,
        [
            "engine",
            "build",
            "llama.cpp",
            "--cuda-arch",
            "70",
            "--cuda-compiler",
            str(nvcc),
            "--cache-dir",
            str(clean_env / "e"),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "Error: --cuda-arch 70: CUDA 13.0" in result.output and "cuda-12.9" in result.output
    assert "Traceback" not in result.output and "CMake" not in result.output
    assert not (clean_env / "e" / "downloads").exists()


def test_cli_cuda_compiler_for_a_cpu_build_is_exit_2(cli, clean_env):
    result = CliRunner().invoke(
        cli,
        ["engine", "build", "llama.cpp", "--cpu", "--cuda-compiler", "/x/nvcc", "--cache-dir", str(clean_env / "e")],
    )
    assert result.exit_code == 2
    assert "--cuda-compiler /x/nvcc: the build is CPU-only (a CPU build was asked for)" in result.output


def test_a_missing_engine_is_the_cores_engine_unavailable(clean_env):
    from autotune.errors import EngineUnavailableError, exit_status

    with pytest.raises(EngineUnavailableError) as info:  # what stops a study at its first trial
        find_llama_server({}, cache_dir=clean_env / "cache")
    assert exit_status(info.value) == 2
