"""Ctrl-C and SIGTERM at each phase of a study leave no process of it behind, not even one that
left the engine's process group (issue 49 item 4), and the storage is left for a resume.

The engine is a stand-in (tests/engine_fixtures.py's keepalive server, or one that never gets
ready) that first starts a grandchild in a session of its own, as an engine's helper or a
shell wrapper's child would: the group kill alone does not reach it, only autotune's mark does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from autotune.study import records

from tests.engine_fixtures import keepalive_engine, write_llama_study

# Starts a grandchild that leaves the group (setsid, double fork: reparented to init), records
# both pids, then becomes the engine (the keepalive server, or a sleep that never serves).
WRAPPER = """#!{python}
import os, sys, time
if "--version" in sys.argv:
    print("version: 1 (fake000)", file=sys.stderr)
    sys.exit(0)
pids = {pids!r}
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(os.path.join(pids, f"escaped-{{os.getpid()}}"), "w"):
            pass
        time.sleep(600)
    os._exit(0)
with open(os.path.join(pids, f"engine-{{os.getpid()}}"), "w"):
    pass
if {serves}:
    os.execv({server!r}, [{server!r}, *sys.argv[1:]])
time.sleep(600)
"""


def _engine(tmp_path: Path, serves: bool) -> tuple[Path, Path]:
    pids = tmp_path / "pids"
    pids.mkdir()
    server = keepalive_engine(tmp_path, name="keepalive-server")
    path = tmp_path / "llama-server"
    path.write_text(WRAPPER.format(python=sys.executable, pids=str(pids), serves=serves, server=str(server)))
    path.chmod(0o755)
    return path, pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, awaiting its reaper
    except OSError:
        return False


def _started(pids: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in pids.iterdir()]


PHASES = {
    # The baseline (the engine's default launch) measured: its completion never ends.
    "baseline": (True, "request_timeout_s = 600"),
    # A trial's engine launch: the server never answers /health.
    "launch": (False, "startup_timeout_s = 600"),
}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("phase", sorted(PHASES))
def test_a_signal_leaves_no_process_of_the_study_and_a_storage_to_resume(tmp_path, phase, sig):
    serves, setting = PHASES[phase]
    engine, pids = _engine(tmp_path, serves)
    study = "" if phase == "baseline" else "baseline = false"
    path = write_llama_study(
        tmp_path / "sig.toml",
        study=study + "\nfinish_top = 0",
        extra=f'[backends.llama-server]\nbinary = "{engine}"\nthreads = 1\n{setting}',
    )
    storage = f"sqlite:///{tmp_path / 'sig.db'}"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from autotune.cli import main; main()",
            "study",
            str(path),
            "--storage",
            storage,
            "--trials",
            "3",
        ],
        env=dict(os.environ, AUTOTUNE_LOAD_PLUGINS="llama_server", PYTHONFAULTHANDLER="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    started: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(started := _started(pids)) < 2 and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(started) == 2, f"the engine was not started: {child.stderr.read()[-2000:]}"
        time.sleep(0.3)  # into the phase: the readiness wait, or the stream
        child.send_signal(sig)
        try:
            code = child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGABRT)
            child.wait()
            pytest.fail(f"the study did not end within 30 s of {sig.name}: {child.stderr.read()[-4000:]}")
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in started if _alive(p)] == [], f"left running after {sig.name} in the {phase}"
        assert code == 130, child.stderr.read()[-2000:]  # SIGTERM too: the study's handler ends it as Ctrl-C
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    # Nothing half-stored: no trial left RUNNING, the interrupted one failed as such and marked to
    # be measured again on resume; an interrupted baseline is not stored as measured.
    loaded = optuna.load_study(study_name="sig", storage=storage)
    trials = [(t.state, t.user_attrs.get("fail_reason"), t.user_attrs.get("retry")) for t in loaded.trials]
    assert records.baselines(loaded) == {}
    assert trials == ([] if phase == "baseline" else [(optuna.trial.TrialState.FAIL, "interrupted", True)])
