"""Every command in the README's Usage section runs, as a user would type it.

The README's command lines are read from the file and each must have a concrete run below
(placeholders such as ``path/to/model.gguf`` filled with files the test makes): a command
added to or changed in the README without a run here fails ``test_every_usage_line_has_a_run``.
Each run is a child process of the installed ``autotune`` with the plugins it would load.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.engine_fixtures import llama_cpp_module, llama_server_binary

STORIES = REPO / "tests" / "data" / "stories260K.gguf"


def usage_lines() -> list[str]:
    """The indented ``autotune ...`` lines of the Usage section, continuation lines joined."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Usage", 1)[1].split("\n## ", 1)[0]
    lines, current = [], None
    for raw in section.splitlines():
        line = raw.strip()
        if current is not None:
            current += " " + line.rstrip("\\").strip()
            if not line.endswith("\\"):
                lines.append(current)
                current = None
            continue
        if raw.startswith("    autotune "):
            command = line.split("  #", 1)[0].strip()
            if command.endswith("\\"):
                current = command.rstrip("\\").strip()
            else:
                lines.append(command)
    return [re.sub(r"\s+", " ", line) for line in lines]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("AUTOTUNE_LOAD_PLUGINS", None)  # every installed plugin loads, as for a user
    env.pop("AUTOTUNE_STORAGE", None)
    return env


def autotune(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from autotune.cli import main; main()", *args], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    return result


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


@pytest.fixture(scope="module")
def studied(work) -> str:
    """A short run of the default study, the storage that best and dashboard then read."""
    storage = f"sqlite:///{work / 'readme.db'}"
    out = ok(autotune("study", "--budget", "90s", "--trials", "6", "--storage", storage, "--seed", "1", "--json",
                      cwd=work))
    assert json.loads(out.stdout)["best"]["deploy_command"]
    return storage


@pytest.fixture(scope="module")
def model_gguf(work) -> Path:
    """A small random-weight Llama that holds ctx 4096 (the README's estimate line asks for it)."""
    out = work / "model.gguf"
    ok(autotune("synth", "--arch", "llama", "--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2",
                "--ffn", "256", "--ctx", "8192", "--vocab-from", str(STORIES), "--out", str(out), cwd=work))
    return out


def run_study(work, studied):
    ok(autotune("study", "--trials", "1", "--storage", studied, "--seed", "2", cwd=work))  # continues the study


def run_best(work, studied):
    best = json.loads(ok(autotune("best", "--study", "v100-qwen27b", "--storage", studied, "--json", cwd=work)).stdout)
    assert best["best"]["params"]["backend"].startswith("twin-")
    assert "deploy:" in ok(autotune("best", "--storage", studied, cwd=work)).stdout


def run_report(work, studied):
    ok(autotune("report", "--storage", studied, "--out", "readme.html", cwd=work))
    page = (work / "readme.html").read_text()
    assert "Winner: trial" in page and "plot-knee" in page and "plot-vram" in page


def run_storage_upgrade(work, studied):
    # The study was written by this autotune: nothing to rename, and it says so.
    assert "left as it is" in ok(autotune("storage", "upgrade", studied, cwd=work)).stdout


def run_estimate_catalog(work, studied):
    args = ["estimate", "--gpu", "v100-16gb", "--model", "qwen2.5-27b-article", "--backend", "exllamav2",
            "--weights", "exl2:3.3", "--ctx", "4096", "--cache", "q8", "--flash-attn", "--parallel", "4"]
    assert "fits" in ok(autotune(*args, cwd=work)).stdout
    assert json.loads(ok(autotune(*args, "--json", cwd=work)).stdout)["vram"]["fits"] is True


def run_estimate_file(work, studied, model_gguf):
    out = ok(autotune("estimate", "--model", str(model_gguf), "--backend", "llama-server", "--ctx", "4096",
                      "--parallel", "4", "--cache", "q8_0", "--flash-attn", "--gpu", "v100-16gb", cwd=work))
    assert "fits" in out.stdout


def run_estimate_study(work, studied):
    args = ["estimate", "--study", "v100-qwen27b", "--storage", studied, "--backend", "llama.cpp", "--weights",
            "gguf:Q4_K_M", "--ctx", "4096", "--parallel", "4"]
    out = ok(autotune(*args, cwd=work)).stdout
    # The default study runs on the twin, which predicts itself: nothing to calibrate, and it says so.
    assert "on v100-16gb, model qwen2.5-27b-article" in out and "holds no calibration of twin-llama.cpp" in out
    assert json.loads(ok(autotune(*args, "--json", cwd=work)).stdout)["gpu"] == "v100-16gb"


def run_quality(work, studied):
    llama_cpp_module()  # skip (or fail in CI) without the engine's Python bindings
    out = ok(autotune("quality", "--backend", "llama-server", "--weights", str(STORIES), "--benchmark", "kld",
                      "--reference", str(STORIES), "--json", cwd=work))
    assert json.loads(out.stdout)["kld_mean"] == pytest.approx(0.0, abs=1e-6)  # a model against itself


def run_plugins(work, studied):
    names = {b["name"] for b in json.loads(ok(autotune("plugins", "--json", cwd=work)).stdout)["backends"]}
    assert {"twin-exllamav2", "twin-llama.cpp", "llama-server", "exllamav2"} <= names
    assert "backends:" in ok(autotune("plugins", cwd=work)).stdout


def run_dashboard(work, studied):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "from autotune.cli import main; main()", "dashboard", "--storage",
                             studied, "--host", "127.0.0.1", "--port", str(port)],
                            cwd=work, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        body = None
        for _ in range(300):  # at most ~30 s to start
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as response:
                    body = json.loads(response.read())
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        assert body is not None, f"dashboard did not answer; exit {proc.poll()}"
        assert [s["study_name"] for s in body["study_summaries"]] == ["v100-qwen27b"]
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def run_engine_build(work, studied):
    llama_server_binary()  # skip (or fail in CI) without a build: this run must not compile for minutes
    out = ok(autotune("engine", "build", "llama.cpp", "--cpu", cwd=work, timeout=600))
    assert "llama-server" in out.stdout + out.stderr


def run_engine_list(work, studied):
    llama_server_binary()
    assert "cpu" in ok(autotune("engine", "list", cwd=work)).stdout


def run_synth(work, studied):
    llama_server_binary()  # --quantize runs the engine's llama-quantize
    out = work / "q.gguf"
    ok(autotune("synth", "--arch", "qwen2", "--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2",
                "--ffn", "256", "--out", str(out), "--quantize", "Q8_0,Q4_0", cwd=work))
    assert out.is_file() and (work / "q-Q8_0.gguf").is_file() and (work / "q-Q4_0.gguf").is_file()


def run_synth_moe(work, studied):
    llama_server_binary()  # the vocab file comes from the engine build's sources
    out = work / "moe.gguf"
    ok(autotune("synth", "--arch", "qwen3moe", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                "--head-dim", "32", "--ffn", "96", "--experts", "4", "--experts-used", "2", "--expert-ffn", "32",
                "--out", str(out), cwd=work))
    assert out.is_file()


def run_init(work, studied):
    llama_server_binary()  # the study it writes must validate: the engine must be there
    out = ok(autotune("init", str(STORIES), "--gpu", "cpu", "--out", "mine.toml", "--name", "mine", cwd=work))
    assert "next: autotune study mine.toml" in out.stdout
    text = (work / "mine.toml").read_text()
    assert 'gpu = "cpu"' in text and "gguf:Q4_0" in text
    refused = autotune("init", str(STORIES), "--gpu", "cpu", "--out", "mine.toml", cwd=work)
    assert refused.returncode == 2 and "already exists (pass --force" in refused.stderr


# README line (as written, placeholders and all) -> the run that types it for real.
RUNS = {
    "autotune init MODEL [--gpu auto|KEY|cpu] [--out study.toml] [--name NAME] [--force]": run_init,
    "autotune study [STUDY.toml] [--budget 2h|45m|90s] [--trials N] [--storage URL] [--seed N] [--json] "
    "[--report PATH]": run_study,
    "autotune best [STUDY.toml] [--study NAME] [--storage URL] [--json]": run_best,
    "autotune report [STUDY.toml] [--study NAME] [--storage URL] [--out report.html]": run_report,
    "autotune estimate --gpu v100-16gb --model qwen2.5-27b-article --backend exllamav2 --weights exl2:3.3 --ctx 4096 "
    "--cache q8 --flash-attn --parallel 4 [--json]": run_estimate_catalog,
    "autotune estimate --model path/to/model.gguf --backend llama-server --ctx 4096 --parallel 4 --cache q8_0 "
    "--flash-attn --gpu v100-16gb": run_estimate_file,
    "autotune estimate --study NAME [--storage URL] --backend llama.cpp --weights gguf:Q4_K_M --ctx 4096 "
    "--parallel 4 [--json]": run_estimate_study,
    "autotune quality --backend llama-server --weights model.gguf --benchmark mmlu|ceval|kld [--cache TYPE] "
    "[--per-subject N] [--shots K] [--reference REF.gguf] [--json]": run_quality,
    "autotune plugins [--json]": run_plugins,
    "autotune dashboard [STUDY.toml] [--storage URL] [--host 127.0.0.1] [--port 8080]": run_dashboard,
    "autotune storage upgrade URL": run_storage_upgrade,
    "autotune engine build llama.cpp [--cuda-arch auto|cpu|70|90] [--cuda-compiler NVCC] [--cpu] [--python] "
    "[--jobs N]": run_engine_build,
    "autotune engine list": run_engine_list,
    "autotune synth --arch qwen2 --layers 28 --hidden 3584 --heads 28 --kv-heads 4 --ffn 18944 --out q7b.gguf "
    "--quantize Q8_0,Q4_K_M,Q4_0": run_synth,
    "autotune synth --arch qwen3moe --layers 48 --hidden 2048 --heads 32 --kv-heads 4 --head-dim 128 --ffn 6144 "
    "--experts 128 --experts-used 8 --expert-ffn 768 --out q30b-a3b.gguf": run_synth_moe,
}


def test_every_usage_line_has_a_run():
    assert usage_lines() == list(RUNS), "a README Usage command has no run in tests/test_readme_usage.py"


@pytest.mark.parametrize("line", list(RUNS))
def test_usage_line_runs(line, work, studied, request):
    run = RUNS[line]
    extra = {"model_gguf": request.getfixturevalue("model_gguf")} if "model_gguf" in run.__code__.co_varnames else {}
    run(work, studied, **extra)
