"""Every command of the README and of docs/usage.md's Commands runs, as a user would type it.

The command lines are read from the files (the ``autotune ...`` lines of their ```sh blocks) and
each must have a concrete run below (placeholders such as ``path/to/model.gguf`` filled with files
the test makes): a command added to or changed in the README or in docs/usage.md without a run
here fails ``test_every_usage_line_has_a_run`` or ``test_every_readme_line_has_a_run``.
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
USAGE = REPO / "docs" / "usage.md"
README = REPO / "README.md"


def command_lines(text: str) -> list[str]:
    """The ``autotune ...`` lines of the ```sh blocks in ``text``: continuation lines joined,
    ``  # comments`` cut, runs of spaces made one. Output (```text blocks) is not a command."""
    lines, current, in_sh = [], None, False
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("```"):
            in_sh = not in_sh and line[3:].strip() == "sh"
            continue
        if not in_sh:
            continue
        if current is not None:
            current += " " + line.rstrip("\\").strip()
            if not line.endswith("\\"):
                lines.append(current)
                current = None
            continue
        if line.startswith("autotune "):
            command = line.split("  #", 1)[0].strip()
            if command.endswith("\\"):
                current = command.rstrip("\\").strip()
            else:
                lines.append(command)
    return [re.sub(r"\s+", " ", line) for line in lines]


def usage_lines() -> list[str]:
    """The command lines of docs/usage.md's Commands section (the reference of every command)."""
    section = USAGE.read_text(encoding="utf-8").split("\n## Commands", 1)[1].split("\n## ", 1)[0]
    return command_lines(section)


def readme_lines() -> list[str]:
    """The command lines of the README, each once, in the order they first appear."""
    return list(dict.fromkeys(command_lines(README.read_text(encoding="utf-8"))))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("AUTOTUNE_LOAD_PLUGINS", None)  # every installed plugin loads, as for a user
    env.pop("AUTOTUNE_STORAGE", None)
    return env


def autotune(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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
    out = ok(
        autotune("study", "--budget", "90s", "--trials", "6", "--storage", storage, "--seed", "1", "--json", cwd=work)
    )
    assert json.loads(out.stdout)["best"]["deploy_command"]
    return storage


@pytest.fixture(scope="module")
def model_gguf(work) -> Path:
    """A small random-weight Llama that holds ctx 4096 (the README's estimate line asks for it)."""
    out = work / "model.gguf"
    ok(
        autotune(
            "synth",
            "--arch",
            "llama",
            "--layers",
            "2",
            "--hidden",
            "128",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--ffn",
            "256",
            "--ctx",
            "8192",
            "--vocab-from",
            str(STORIES),
            "--out",
            str(out),
            cwd=work,
        )
    )
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
    args = [
        "estimate",
        "--gpu",
        "v100-16gb",
        "--model",
        "qwen2.5-27b-article",
        "--backend",
        "exllamav2",
        "--weights",
        "exl2:3.3",
        "--ctx",
        "4096",
        "--cache",
        "q8",
        "--flash-attn",
        "--parallel",
        "4",
    ]
    assert "fits" in ok(autotune(*args, cwd=work)).stdout
    assert json.loads(ok(autotune(*args, "--json", cwd=work)).stdout)["vram"]["fits"] is True


def run_estimate_file(work, studied, model_gguf):
    out = ok(
        autotune(
            "estimate",
            "--model",
            str(model_gguf),
            "--backend",
            "llama-server",
            "--ctx",
            "4096",
            "--parallel",
            "4",
            "--cache",
            "q8_0",
            "--flash-attn",
            "--gpu",
            "v100-16gb",
            cwd=work,
        )
    )
    assert "fits" in out.stdout


def run_estimate_study(work, studied):
    args = [
        "estimate",
        "--study",
        "v100-qwen27b",
        "--storage",
        studied,
        "--backend",
        "llama.cpp",
        "--weights",
        "gguf:Q4_K_M",
        "--ctx",
        "4096",
        "--parallel",
        "4",
    ]
    out = ok(autotune(*args, cwd=work)).stdout
    # The default study runs on the twin, which predicts itself: nothing to calibrate, and it says so.
    assert "on v100-16gb, model qwen2.5-27b-article" in out and "holds no calibration of twin-llama.cpp" in out
    assert json.loads(ok(autotune(*args, "--json", cwd=work)).stdout)["gpu"] == "v100-16gb"


def run_quality(work, studied):
    llama_cpp_module()  # skip (or fail in CI) without the engine's Python bindings
    out = ok(
        autotune(
            "quality",
            "--backend",
            "llama-server",
            "--weights",
            str(STORIES),
            "--benchmark",
            "kld",
            "--reference",
            str(STORIES),
            "--json",
            cwd=work,
        )
    )
    assert json.loads(out.stdout)["kld_mean"] == pytest.approx(0.0, abs=1e-6)  # a model against itself


def run_plugins(work, studied):
    names = {b["name"] for b in json.loads(ok(autotune("plugins", "--json", cwd=work)).stdout)["backends"]}
    assert {"twin-exllamav2", "twin-llama.cpp", "llama-server", "exllamav2"} <= names
    assert "backends:" in ok(autotune("plugins", cwd=work)).stdout


def run_dashboard(work, studied):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from autotune.cli import main; main()",
            "dashboard",
            "--storage",
            studied,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=work,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    ok(
        autotune(
            "synth",
            "--arch",
            "qwen2",
            "--layers",
            "2",
            "--hidden",
            "128",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--ffn",
            "256",
            "--out",
            str(out),
            "--quantize",
            "Q8_0,Q4_0",
            cwd=work,
        )
    )
    assert out.is_file() and (work / "q-Q8_0.gguf").is_file() and (work / "q-Q4_0.gguf").is_file()


def run_synth_moe(work, studied):
    llama_server_binary()  # the vocab file comes from the engine build's sources
    out = work / "moe.gguf"
    ok(
        autotune(
            "synth",
            "--arch",
            "qwen3moe",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "32",
            "--ffn",
            "96",
            "--experts",
            "4",
            "--experts-used",
            "2",
            "--expert-ffn",
            "32",
            "--out",
            str(out),
            cwd=work,
        )
    )
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


def run_readme_best(work, studied):
    # `best` with nothing else reads the study last run in this directory: the `studied` fixture's.
    out = ok(autotune("best", cwd=work)).stdout
    assert "v100-qwen27b" in out and "deploy:" in out


def run_readme_report(work, studied):
    ok(autotune("report", "--out", "report.html", cwd=work))
    page = (work / "report.html").read_text()
    assert "Winner: trial" in page and "plot-knee" in page


def run_readme_engine_build(work, studied):
    llama_server_binary()  # skip (or fail in CI) without a build: this run must not compile for minutes
    from autotune.hardware.gpus import has_gpu

    if has_gpu():
        pytest.skip("`engine build llama.cpp` builds for this machine's GPU here, a compile of minutes")
    out = ok(autotune("engine", "build", "llama.cpp", cwd=work, timeout=600))
    assert "reused" in out.stdout and "llama-server" in out.stdout  # no GPU: the CPU build, as the README says


@pytest.fixture(scope="module")
def own_model(tmp_path_factory) -> Path:
    """The README's "Tune your own model" directory: `init` run on a small GGUF, as typed."""
    llama_server_binary()  # the study init writes must validate: the engine must be there
    own = tmp_path_factory.mktemp("own")
    model = own / "path" / "to" / "my-model.gguf"  # a GGUF file of that name stands for path/to/my-model
    model.parent.mkdir(parents=True)
    model.write_bytes(STORIES.read_bytes())
    out = ok(autotune("init", str(model), "--out", "my-model.toml", cwd=own))
    assert "next: autotune study my-model.toml" in out.stdout
    return own


def run_readme_init(work, studied, own_model):
    text = (own_model / "my-model.toml").read_text()
    assert 'name = "my-model"' in text and "gguf:Q4_0" in text
    # On a GGUF file, without a GPU: formats made from it, the file's own context as the top of
    # ctx, quality as KLD (what tests/plugins/test_made_artifacts_cpu.py checked with a study of
    # its own, the same launches as this one's).
    assert 'gpu = "cpu"' in text and 'source = "path/to/my-model.gguf"' in text and 'quality = "kld"' in text
    assert '"gguf:F16"' in text and "ctx = [256, 512, 1024, 2048]" in text  # up to stories260K's 2048


def run_readme_own_study(work, studied, own_model):
    # The file's budget (15 minutes on the CPU) is more than a test can spend: one launch, and
    # then the README's next line, `best`, reads the study this directory last ran.
    ok(autotune("study", "my-model.toml", "--trials", "1", cwd=own_model, timeout=600))
    out = ok(autotune("best", cwd=own_model)).stdout
    assert "my-model" in out and "deploy:" in out and "llama-server" in out
    import optuna

    from autotune.study.records import TrialRecord

    study = optuna.load_study(study_name="my-model", storage=f"sqlite:///{own_model / 'my-model.db'}")
    (t,) = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    # The quality is KLD against the source's full-precision format, made like any artifact.
    assert TrialRecord.of(t).quality["reference_weights"] == "gguf:F16"
    assert {a["format"] for a in TrialRecord.of(t).artifacts} >= {"gguf:F16"}


# README line (as written) -> the run that types it. `autotune best` is typed twice in the README:
# after the first study (run here) and after your own (run by run_readme_own_study).
README_RUNS = {
    "autotune best": run_readme_best,
    "autotune report --out report.html": run_readme_report,
    "autotune engine build llama.cpp": run_readme_engine_build,
    "autotune init path/to/my-model --out my-model.toml": run_readme_init,
    "autotune study my-model.toml": run_readme_own_study,
}


def test_every_usage_line_has_a_run():
    assert usage_lines() == list(RUNS), "a docs/usage.md command has no run in tests/test_readme_usage.py"


def test_every_readme_line_has_a_run():
    assert readme_lines() == list(README_RUNS), "a README command has no run in tests/test_readme_usage.py"


def _extra(run, request) -> dict:
    names = run.__code__.co_varnames[: run.__code__.co_argcount]
    return {name: request.getfixturevalue(name) for name in ("model_gguf", "own_model") if name in names}


@pytest.mark.parametrize("line", list(RUNS))
def test_usage_line_runs(line, work, studied, request):
    run = RUNS[line]
    run(work, studied, **_extra(run, request))


@pytest.mark.parametrize("line", list(README_RUNS))
def test_readme_line_runs(line, work, studied, request):
    run = README_RUNS[line]
    run(work, studied, **_extra(run, request))
