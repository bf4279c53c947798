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
from autotune_plugins.llama_server import engine
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


def fake_build_dir(root: Path, arch: str = "cpu", version: str = engine.LLAMA_CPP_PYTHON_VERSION) -> Path:
    """A complete build in an engines directory, as build_llama_cpp leaves it."""
    install = root / f"llama.cpp-{version}-{engine.arch_tag(arch)}"
    fake_exe(install / "bin" / "llama-server")
    fake_exe(install / "bin" / "llama-quantize", "usage\n")
    (install / engine.MARKER).write_text(json.dumps({"arch": arch, "llama_cpp_python": version, "tag": engine.arch_tag(arch)}))
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
KNOWN = "option(LLAMA_CURL) option(LLAMA_OPENSSL) LLAMA_BUILD_TESTS LLAMA_BUILD_EXAMPLES LLAMA_USE_PREBUILT_UI LLAMA_BUILD_UI"


def gpu(cc: str) -> SimpleNamespace:
    return SimpleNamespace(compute_capability=cc)


def plan_for(arch: str, tmp_path: Path) -> BuildPlan:
    return BuildPlan("0.3.36", arch, tmp_path / f"llama.cpp-0.3.36-{engine.arch_tag(arch)}", 2, "0c1e570")


def test_cmake_args_cpu(tmp_path):
    args = cmake_configure_args(plan_for("cpu", tmp_path), known_options=KNOWN)
    assert args[:7] == ["cmake", "-S", str(tmp_path / "llama.cpp-0.3.36-cpu" / "src"),
                        "-B", str(tmp_path / "llama.cpp-0.3.36-cpu" / "build"), "-G", "Ninja"]
    for flag in ("-DGGML_CUDA=OFF", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_COMMIT=0c1e570",
                 "-DCMAKE_BUILD_TYPE=Release"):
        assert flag in args
    assert not [a for a in args if "CUDA_ARCHITECTURES" in a]


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
    monkeypatch.setattr(engine.platform, "machine", lambda: "x86_64")
    accepting = fake_exe(tmp_path / "cc", "")
    rejecting = fake_exe(tmp_path / "old-cc", "")
    rejecting.write_text(rejecting.read_text() + "exit 1\n")
    assert engine.amx_guard_flags(str(accepting), AMX_CPUINFO) == ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
    assert engine.amx_guard_flags(str(accepting), "flags\t\t: fpu avx2 avx512f\n") == []
    assert engine.amx_guard_flags(str(rejecting), AMX_CPUINFO) == []  # too old to emit AMX anyway
    args = cmake_configure_args(plan_for("cpu", tmp_path), known_options=KNOWN, host_flags=["-mno-amx-tile"],
                                env={"CFLAGS": "-O2 -g"})
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
        fake_exe(plan.bin_dir / "llama-quantize", "usage\n")


def test_build_then_reuse(tmp_path):
    sdist = make_sdist(tmp_path)
    builder = FakeBuilder()
    first = build_llama_cpp("cpu", cache_dir=tmp_path / "engines", sdist=sdist, builder=builder, jobs=3)
    assert builder.calls == 1 and not first.reused
    assert first.install_dir == tmp_path / "engines" / "llama.cpp-9.9.9-cpu"
    manifest = json.loads((first.install_dir / "engine.json").read_text())
    assert manifest["arch"] == "cpu" and manifest["jobs"] == 3 and manifest["llama_cpp_commit"] == "0c1e57098"
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
    monkeypatch.setattr(engine, "DEFAULT_NVCC", tmp_path / "no-cuda" / "nvcc")  # even on a CUDA machine
    builder = CMakeBuilder(env={"PATH": str(tools)})
    builder.check_tools(plan_for("cpu", tmp_path))  # a CPU build needs no nvcc
    with pytest.raises(EngineBuildError, match="nvcc.*nvidia-cuda-toolkit"):
        builder.check_tools(plan_for("70", tmp_path))


def test_cli_missing_cmake(cli, clean_env, monkeypatch):
    sdist = make_sdist(clean_env)
    result = CliRunner().invoke(cli, ["engine", "build", "llama.cpp", "--cuda-arch", "cpu", "--sdist", str(sdist),
                                      "--cache-dir", str(clean_env / "e")])
    assert result.exit_code == 1, result.output
    assert "cmake" in result.output and "apt-get install cmake" in result.output


def test_download_failure_says_to_pass_sdist(tmp_path, monkeypatch):
    # A fake "python" that fails as pip does without network.
    pip = fake_exe(tmp_path / "fake-python", "ERROR: Could not find a version that satisfies the requirement\n")
    pip.write_text(pip.read_text() + "exit 1\n")
    monkeypatch.setattr(engine.sys, "executable", str(pip))
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
    result = CliRunner().invoke(cli, ["engine", "build", "llama.cpp", "--cuda-arch", "cpu",
                                      "--cache-dir", str(clean_env / "e")])
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


@pytest.mark.skipif(os.environ.get("AUTOTUNE_TEST_BUILD") != "1" and os.environ.get("AUTOTUNE_REQUIRE_ENGINE") != "1",
                    reason="set AUTOTUNE_TEST_BUILD=1 to compile llama.cpp (minutes)")
def test_real_cpu_build():
    # In CI the README's test command has just built it: this checks that build (reused).
    build = build_llama_cpp("cpu", jobs=os.cpu_count())
    version = engine_version(build.server)
    assert version.commit, version.raw
    assert build.quantize.is_file()
    assert any(p.name.startswith("libllama.so") for p in build.lib_dir.iterdir())
    assert find_llama_server({}, arch="cpu") == build.server
