"""studies/cpu-tiny.toml as a user runs it: `autotune study` on real llama-server processes.

The models folder is built as the study file's header says (stories260K plus a synthetic
13M-parameter Llama in F16, Q8_0 and Q4_0). These tests need a llama.cpp build; CI makes one
before pytest and sets AUTOTUNE_REQUIRE_ENGINE=1, so there they fail rather than skip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.study import records
from autotune.study.calibration import SPEED_METRICS
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_gguf
from autotune_plugins.llama_server import trial_run
from autotune_plugins.llama_server.backend import LlamaServerBackend
from autotune_plugins.llama_server.synth import SynthSpec, quantize, write_model
from autotune_plugins.twin import TwinLlamaCpp
from autotune_plugins.twin.calibration import median_abs_error
from autotune.study.records import TrialRecord
from tests.conftest import REPO, shared_file
from tests.browser import check_report
from tests.engine_fixtures import RecordedRequests, cpu_build
from tests.plugins.test_llama_server_backend import servers_on

# The shape the study file's header gives to `autotune synth`.
TINY = SynthSpec(arch="llama", n_layers=4, hidden=512, n_heads=8, n_kv_heads=4, ffn=1536, context_length=2048)


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory) -> Path:
    build = cpu_build()
    root = tmp_path_factory.mktemp("cpu-tiny")
    models = root / "models"
    models.mkdir()
    shutil.copy(shared_file("models/stories260K.gguf"), models / "stories260K.gguf")
    f16 = write_model(TINY, models / "tiny-f16.gguf", vocab_from=models / "stories260K.gguf", seed=0).path
    for qtype in ("Q8_0", "Q4_0"):
        quantize(f16, qtype, binary=build.quantize, timeout_s=120)
    text = (REPO / "studies" / "cpu-tiny.toml").read_text(encoding="utf-8")
    (root / "cpu-tiny.toml").write_text(text, encoding="utf-8")
    # One engine thread instead of the file's two, in every run here: what these tests check is
    # the study, not the speed, and on a loaded 2-core machine a 2-thread llama.cpp loses whole
    # tokens to a descheduled thread (its threads wait for each other every step): with two busy
    # neighbours the study did not end in 900 s. One thread slows by the share of the core it
    # loses, no more.
    # And 32 output tokens instead of 64, 28 measured trials instead of 40: each run's decode is
    # most of a trial's time, and what is checked is the chain and the statistics (at least 20
    # measured), not the speed (pytest's own time, issue 28).
    assert "threads = 2" in text and "output_tokens = 64" in text and "n_trials = 40" in text
    one_thread = (
        text.replace("threads = 2", "threads = 1")
        .replace("output_tokens = 64", "output_tokens = 32")
        .replace("n_trials = 40", "n_trials = 28")
    )
    (root / "cpu-tiny-1t.toml").write_text(one_thread, encoding="utf-8")
    # The same study for resuming after an interrupt: what is checked there is that the stored
    # trials stand and new ones are measured; the baselines and the finish (five launches more,
    # minutes on a loaded machine) are checked on real servers by the whole study.
    assert "\n[study]\n" in one_thread
    (root / "cpu-tiny-resume.toml").write_text(
        one_thread.replace("\n[study]\n", "\n[study]\nbaseline = false\nfinish_top = 0\n", 1), encoding="utf-8"
    )
    return root


def autotune_cmd(*args: str) -> list[str]:
    # The console script of this environment, run as a module so no PATH lookup is involved.
    return [sys.executable, "-c", "from autotune.cli import main; main()", *args]


def run_env() -> dict[str, str]:
    # The subprocess loads plugins from entry points, as a user's does; pin which ones.
    return dict(os.environ, AUTOTUNE_LOAD_PLUGINS="llama_server", PYTHONUNBUFFERED="1")


def test_the_whole_study_on_real_servers(study_dir):
    storage = f"sqlite:///{study_dir / 'full.db'}"
    started = time.monotonic()
    # With the twin loaded, as a user's study has it: it learns from every measured trial.
    env = dict(run_env(), AUTOTUNE_LOAD_PLUGINS="llama_server,twin")
    proc = subprocess.run(
        autotune_cmd("study", "cpu-tiny-1t.toml", "--storage", storage, "--json", "--report", "report.html"),
        cwd=study_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    print(f"cpu-tiny: {seconds:.0f} s, {summary['n_complete']} measured")  # shown with -s / on failure

    study = optuna.load_study(study_name="cpu-tiny", storage=storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) >= 20
    for t in done:
        m = TrialRecord.of(t).metrics
        # Real measurements: positive rates, a spread, several runs each, from the engine itself.
        assert m["decode_tok_s"]["median"] > 0 and m["aggregate_tok_s"]["median"] > 0
        # min_runs 3 on any machine: the study's [measure] max_seconds bounds only the runs beyond
        # them, so a loaded machine (slower runs) gives the same count, never a one-run median.
        agg = m["aggregate_tok_s"]
        assert 3 <= agg["n"] <= 6 and agg["stop_reason"] in ("stable", "max_runs", "max_seconds"), agg
        assert TrialRecord.of(t).engine["version"].startswith("llama.cpp")
    # Every file in the space was loaded by the engine, and each in its own format.
    assert {t.params["llama-server.weights"] for t in done} >= {
        "models/tiny-f16.gguf",
        "models/tiny-f16-Q8_0.gguf",
        "models/tiny-f16-Q4_0.gguf",
        "models/stories260K.gguf",
    }
    # Invalid combinations are never launched: a q8_0 cache on stories260K (head size 8).
    for t in study.trials:
        if (
            t.params.get("llama-server.weights") == "models/stories260K.gguf" and t.params.get("kv_bits") == 8
        ):  # q8_0, under the shared name of the cache's precision
            assert t.state == optuna.trial.TrialState.PRUNED and "head size 8" in TrialRecord.of(t).prune_reason
    # The objective is plain aggregate tok/s: the best trial is the fastest one measured, or, where
    # the noise-aware finish measured the leaders again, the one it chose among them.
    fastest = max(done, key=lambda t: TrialRecord.of(t).metrics["aggregate_tok_s"]["median"]).number
    finish = summary.get("finish") or {}
    assert summary["best"]["number"] == finish.get("chosen", fastest)
    assert fastest in finish.get("trials", [fastest])
    assert servers_on(study_dir / "models") == []
    # Before the search, llama-server's default launch (-m only; -ngl 0 without a GPU) on the largest file, measured
    # once with 4 users (-np auto), and how many times faster the winner is.
    base = summary["baseline"]["llama-server"]
    assert base["error"] is None and base["weights"] == "models/tiny-f16.gguf", base
    assert base["aggregate_tok_s"]["median"] > 0 and base["ratio"]["aggregate"]["ratio"] > 0
    assert " -ngl 0 " in base["deploy_command"] and " -c " not in base["deploy_command"]
    assert not any((TrialRecord.of(t).config or {}).get("engine_defaults") for t in study.trials)
    check_the_twin_learned_from_the_study(study, study_dir, summary)
    # The report of a real study renders in a browser: knee, memory (measured peaks) at least.
    n, rows, winner = check_report(study_dir / "report.html", min_plots=2)
    assert rows >= len(done) and f"Winner: trial {summary['best']['number']}" in winner


def check_the_twin_learned_from_the_study(study: optuna.Study, study_dir: Path, summary: dict) -> None:
    """The stored calibration differs from the published constants and predicts the study's own
    trials better (the twin predicts a T4, the study runs on this CPU: far off before)."""
    cal = records.stored_calibrations(study)["llama-server"]
    assert cal["predictor"] == "twin-llama.cpp" and cal["gpu"] == "t4" and cal["n"] >= 10
    assert any(abs(cal["after"][f] / cal["before"][f] - 1) > 0.1 for f in cal["before"] if cal["before"][f] > 0)
    assert summary["calibration"]["llama-server"] == cal  # the report shows it
    ctx = StudyContext(
        gpu=get_gpu("t4"),
        model=model_from_gguf(study_dir / "models" / "tiny-f16.gguf"),
        workload=Workload(prompt_tokens=128, output_tokens=32),
        vram_budget_bytes=15 * 2**30,
        protocol=Protocol(),
        settings={"threads": 1, "startup_timeout_s": 60},
        base_dir=study_dir,
    )
    twin = TwinLlamaCpp()
    trials = [
        (replace(r.trial_config, backend=twin.name), {m: r.median(m) for m in SPEED_METRICS if r.median(m)})
        for r in records.measured(study)
    ]
    trials = [(c, m) for c, m in trials if twin.predictor.predict(c, ctx) is not None]
    before = median_abs_error([twin.predictor.predict(c, ctx) for c, _ in trials], trials)
    after = median_abs_error([twin.predictor.predict(c, replace(ctx, calibration=cal)) for c, _ in trials], trials)
    print(
        f"cpu-tiny: twin's median error on its {len(trials)} trials {before:.0%} -> {after:.0%}; "
        f"constants {cal['before']} -> {cal['after']}"
    )
    assert after < before


def test_two_streams_serve_more_than_one(study_dir, monkeypatch):
    """Where batching pays (a 126M-parameter F16 model, 250 MB, larger than the CPU's caches,
    whose weights one decode step reads once for both streams; on the 13M models of the study,
    which sit in cache, two streams barely beat one): parallel 2 really serves two requests at
    once, on two slots, with the same prompt and output tokens as parallel 1. The speed-up is
    printed, not asserted (measured 1.33x on the 2-core VM with two engine threads; on a shared
    one it follows the neighbours). One engine thread, as in the study above: two threads wait
    for each other every step, and on a loaded machine that made this test take minutes."""
    shape = SynthSpec(arch="llama", n_layers=8, hidden=1024, n_heads=8, n_kv_heads=4, ffn=4096, context_length=2048)
    model_path = write_model(
        shape, study_dir / "mid-f16.gguf", vocab_from=study_dir / "models" / "stories260K.gguf", seed=0, overwrite=True
    ).path
    ctx = StudyContext(
        gpu=get_gpu("t4"),
        model=model_from_gguf(model_path),
        workload=Workload(prompt_tokens=64, output_tokens=32),
        vram_budget_bytes=15 * 2**30,
        protocol=Protocol(warmup_runs=1, min_runs=2, max_runs=2, rel_spread_tol=1.0),
        settings={"threads": 1, "startup_timeout_s": 60},
        base_dir=model_path.parent,
    )
    b = LlamaServerBackend()
    post_events = trial_run.post_events

    def served(parallel: int) -> tuple[float, RecordedRequests, list[str]]:
        sent = RecordedRequests(post_events)
        monkeypatch.setattr(trial_run, "post_events", sent)
        config = TrialConfig(
            "llama-server", model_path.name, 512, parallel, (("cache_type", "f16"), ("flash_attn", True))
        )
        m = b.run(config, ctx)
        return m.metrics["aggregate_tok_s"].median, sent, m.attrs["argv"]

    (one, sent_one, argv_one), (two, sent_two, argv_two) = served(1), served(2)
    assert sent_one.counts() == sent_two.counts() == {(64, 32)}  # the server's own count, every request
    assert (sent_one.most_open, sent_two.most_open) == (1, 2)
    assert argv_two[argv_two.index("-np") + 1] == "2" and argv_one[argv_one.index("-np") + 1] == "1"
    print(f"aggregate tok/s: parallel 1 {one:.1f}, parallel 2 {two:.1f} ({two / one:.2f}x)")


@pytest.mark.parametrize(
    "sig, after_s",
    [(signal.SIGINT, 0.0), (signal.SIGINT, 4.0), (signal.SIGKILL, 0.0)],
    ids=["SIGINT-at-first-launch", "SIGINT-mid-study", "SIGKILL"],
)
def test_no_server_survives_autotune_interrupted_or_killed(study_dir, sig, after_s, tmp_path):
    storage = f"sqlite:///{tmp_path / 'killed.db'}"
    # PYTHONFAULTHANDLER: a study that does not end is made to print where it is stuck.
    child = subprocess.Popen(
        autotune_cmd("study", "cpu-tiny-1t.toml", "--storage", storage),
        cwd=study_dir,
        env=dict(run_env(), PYTHONFAULTHANDLER="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not servers_on(study_dir / "models") and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.02)
        if not servers_on(study_dir / "models"):
            child.kill()
            pytest.fail(f"no llama-server was started: {child.stderr.read()[-2000:]}")
        # Mid-study, the signal most likely lands while streams are measured: it must end the
        # study (130), not become one failed trial that the study shrugs off.
        time.sleep(after_s)
        child.send_signal(sig)
        try:
            code = child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGABRT)
            child.wait()
            pytest.fail(f"the study did not end within 60 s of {sig.name}: {child.stderr.read()[-6000:]}")
        deadline = time.monotonic() + 10
        while servers_on(study_dir / "models") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert servers_on(study_dir / "models") == []
        if sig == signal.SIGINT:
            assert code == 130, child.stderr.read()[-2000:]
        else:
            assert code == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in servers_on(study_dir / "models"):  # a failed test must not leave servers behind
            os.kill(pid, signal.SIGKILL)
    # What was finished before the signal is in the storage, and the study resumes from it.
    resumed = subprocess.run(
        autotune_cmd("study", "cpu-tiny-resume.toml", "--storage", storage, "--trials", "2"),
        cwd=study_dir,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    study = optuna.load_study(study_name="cpu-tiny", storage=storage)
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials) >= 2
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    assert servers_on(study_dir / "models") == []
