"""From one model to a tuned server on the CPU, as a user types it: a study whose candidates are
formats made on demand by llama.cpp's own tools, run twice (the second makes nothing), and
`autotune init` on a Hugging Face directory, its study then run (init on a GGUF file and its
study: tests/test_readme_usage.py, the README's own-model lines).

Needs a llama.cpp build (CI makes one; see tests/engine_fixtures.py). The Hugging Face case
also needs what convert_hf_to_gguf.py imports (torch, transformers, sentencepiece: the
``convert`` extra) and is skipped without it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from autotune.study.records import TrialRecord
from tests.conftest import REPO
from tests.engine_fixtures import cpu_build

STUDY = """
[study]
name = "made"
finish_top = 0

[hardware]
gpu = "cpu"

[model]
source = "stories260K.gguf"

[workload]
prompt_tokens = 32
output_tokens = 16

[measure]
warmup_runs = 1
min_runs = 2
max_runs = 3
max_seconds = 5

[[candidates]]
backend = "llama-server"
weights = ["gguf:Q8_0", "gguf:Q4_0"]

[space]
ctx = [256]
parallel = [1]
cache_type = ["f16"]
flash_attn = [true]

[backends.llama-server]
threads = 1  # two wait for each other every step: on a loaded machine that took minutes
"""


def autotune(*args: str, cwd: Path, plugins: str = "llama_server") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AUTOTUNE_LOAD_PLUGINS=plugins, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def workdir(tmp_path) -> Path:
    cpu_build()
    shutil.copy(REPO / "tests" / "data" / "stories260K.gguf", tmp_path / "stories260K.gguf")
    (tmp_path / "made.toml").write_text(STUDY)
    return tmp_path


def completed(storage: str, name: str) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name=name, storage=storage)
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


def test_formats_are_made_once_and_found_by_the_next_study(workdir):
    started = time.monotonic()
    first = autotune("study", "made.toml", "--trials", "2", "--storage", f"sqlite:///{workdir / 'one.db'}", cwd=workdir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "artifact gguf:Q8_0: making gguf:Q8_0" in first.stderr and "artifact gguf:Q4_0: making" in first.stderr
    trials = completed(f"sqlite:///{workdir / 'one.db'}", "made")
    assert {t.params["llama-server.weights"] for t in trials} == {"gguf:Q8_0", "gguf:Q4_0"}
    # Each made once: Q8_0 (the highest precision) by the default launch measured before the
    # search (study.baseline), so its trial finds it cached; Q4_0 by its trial.
    assert first.stderr.count("artifact gguf:Q8_0: making") == first.stderr.count("artifact gguf:Q4_0: making") == 1
    made = {}
    for t in trials:
        (a,) = TrialRecord.of(t).artifacts
        assert a["made_now"] == (a["format"] == "gguf:Q4_0")
        assert a["tool"].startswith("llama.cpp-") and Path(a["path"]).is_file()
        # The engine loaded the file it was given: the deploy line names it.
        assert a["path"] in TrialRecord.of(t).deploy_command
        made[a["format"]] = a
    from autotune.modelfiles.gguf_file import read_gguf

    assert read_gguf(made["gguf:Q4_0"]["path"]).file_type == "Q4_0"
    assert read_gguf(made["gguf:Q8_0"]["path"]).file_type == "Q8_0"

    # A second study from the same source makes nothing: every artifact is a cache hit.
    second = autotune(
        "study", "made.toml", "--trials", "2", "--storage", f"sqlite:///{workdir / 'two.db'}", cwd=workdir
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "making" not in second.stderr
    assert second.stderr.count("cache hit") >= 2
    for t in completed(f"sqlite:///{workdir / 'two.db'}", "made"):
        (a,) = TrialRecord.of(t).artifacts
        assert not a["made_now"] and a["sha256"] == made[a["format"]]["sha256"]
    print(f"two studies from one source: {time.monotonic() - started:.0f} s")


def run_init_study(workdir: Path, model: str) -> tuple[str, list[optuna.trial.FrozenTrial]]:
    out = autotune("init", model, "--out", "init.toml", cwd=workdir, plugins="llama_server,quality")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "next: autotune study init.toml" in out.stdout
    text = (workdir / "init.toml").read_text()
    storage = f"sqlite:///{workdir / 'init.db'}"
    run = autotune(
        "study", "init.toml", "--trials", "1", "--storage", storage, cwd=workdir, plugins="llama_server,quality"
    )
    assert run.returncode == 0, run.stderr[-3000:]
    name = next(line.split('"')[1] for line in text.splitlines() if line.startswith("name = "))
    return text, completed(storage, name)


# `autotune init` on a GGUF file, then its study: the README's "Tune your own model" lines do
# exactly that on stories260K (tests/test_readme_usage.py, run_readme_init and
# run_readme_own_study, which check the same: the file's fields, and a trial whose KLD is taken
# against the made gguf:F16). One such study is enough; here it was a second, the suite's
# third-longest test.


needs_converter = pytest.mark.skipif(
    not all(
        importlib.util.find_spec(m) for m in ("torch", "transformers", "sentencepiece", "safetensors", "tokenizers")
    ),
    reason="convert_hf_to_gguf.py needs torch, transformers and sentencepiece: pip install -e '.[convert]'",
)


@needs_converter
def test_init_on_a_hugging_face_directory_writes_a_study_that_runs(workdir):
    from tests.hf_model import write_tiny_llama

    write_tiny_llama(workdir / "tiny-llama", hidden=128)
    text, trials = run_init_study(workdir, "tiny-llama")
    assert 'source = "tiny-llama"' in text
    (t,) = trials
    formats = {a["format"]: a for a in TrialRecord.of(t).artifacts}
    assert "gguf:F16" in formats  # converted by llama.cpp's convert_hf_to_gguf.py, then quantized from it
    from autotune.modelfiles.gguf_file import read_gguf

    assert read_gguf(formats["gguf:F16"]["path"]).architecture == "llama"
