"""A storage that fails under a study, or is not one to write: one line naming the cause, exit 2.

The faults are SQLite's own: a database at its size limit (``PRAGMA max_page_count``, the
"database or disk is full" a full disk gives), a lock held by another connection, a file and
directory this user cannot write, another application's tables.
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import optuna
import pytest
import sqlalchemy
from click.testing import CliRunner

from autotune.cli import cli
from autotune.config import load_study_config
from autotune.errors import StorageError
from autotune.study import StudyRunner, prepare_study
from autotune.study import claims as claims_mod
from autotune.study import storage as study_storage
from autotune.study.records import TrialRecord

if __package__:  # tests/ is a package
    from .fake_backends import FakeBackend, memory_dir, registered, write_study
else:
    from fake_backends import FakeBackend, memory_dir, registered, write_study


def _without_root_s_override() -> None:
    """Root writes anywhere: drop the capabilities that let it (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH, CAP_FOWNER) before the command is executed, so file modes hold."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.fixture
def scratch(tmp_path):
    yield from memory_dir(tmp_path)


def _grid(tmp_path: Path):
    return load_study_config(
        write_study(
            tmp_path / "grid.toml",
            "fake",
            ["a", "bb"],
            parallel=(1, 2, 4),
            sampler="grid",
            study_extra="finish_top = 0",
        )
    )


def _measured_once(study: optuna.Study) -> Counter:
    return Counter(
        TrialRecord.of(t).config_key for t in study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE
    )


def test_a_full_disk_stops_the_study_with_the_cause_and_its_trial_is_measured_again(tmp_path, scratch, monkeypatch):
    url = f"sqlite:///{scratch / 'grid.db'}"
    cfg = _grid(tmp_path)
    with registered(FakeBackend()):
        first = StudyRunner(prepare_study(cfg, storage=url), seed=0)
        first.run(n_trials=2)
        # From here the database cannot grow: SQLite's "database or disk is full", as on a full disk.
        engine = study_storage.sql_engine(first.study)
        sqlalchemy.event.listen(
            engine,
            "connect",
            lambda conn, _: conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}"),
        )
        engine.dispose()
        with pytest.raises(StorageError) as raised:
            first.run(n_trials=4)
        said = str(raised.value)
        assert "disk is full" in said and url in said and "invalid data in the commit" not in said
        assert re.search(r"trial \d+ (was failed, to be measured again|is left RUNNING: the next run fails it)", said)
        # The disk has room again; the failed process is gone (what SIGKILL or its exit leaves).
        engine.dispose()
        monkeypatch.setattr(claims_mod, "process_alive", lambda pid: False)
        resumed = StudyRunner(prepare_study(cfg, storage=url), seed=0)
        monkeypatch.undo()
        resumed.run()
    trials = resumed.study.get_trials()
    assert not [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    grid = {c.key for c in resumed.prepared.space.enumerate()}
    assert _measured_once(resumed.study) == Counter({key: 1 for key in grid})


def test_a_database_locked_by_another_process_is_waited_for_and_then_named(tmp_path, scratch, monkeypatch):
    monkeypatch.setattr(study_storage, "SQLITE_LOCK_WAIT_S", 0.2)
    path = scratch / "grid.db"
    url = f"sqlite:///{path}"
    with registered(FakeBackend()):
        runner = StudyRunner(prepare_study(_grid(tmp_path), storage=url), seed=0)
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")  # another process writing, for longer than the wait
        try:
            with pytest.raises(StorageError, match=r"locked by another process \(waited 0.2 s\)"):
                runner.run(n_trials=2)
        finally:
            other.execute("ROLLBACK")
            other.close()


def test_another_application_s_sqlite_database_is_refused_untouched(tmp_path):
    path = tmp_path / "shop.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    for create in (True, False):
        with pytest.raises(
            StorageError,
            match=r"shop.db is a SQLite database of another application "
            r"\(tables: customers, orders\); give a new file",
        ):
            study_storage.open_storage(f"sqlite:///{path}", create=create)
    with sqlite3.connect(path) as conn:
        assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} == {
            "customers",
            "orders",
        }


@pytest.mark.parametrize("url", ["sqlite:///:memory:", "sqlite://"])
def test_an_in_memory_database_is_refused_with_why(twin_plugin, url):
    result = CliRunner().invoke(cli, ["study", "--storage", url, "--trials", "1", "--quiet"])
    assert result.exit_code == 2, result.output
    assert "in-memory database ends with this process" in result.output and "sqlite:///study.db" in result.output


def test_best_reads_a_study_on_read_only_media(tmp_path, scratch):
    with registered(FakeBackend()):
        runner = StudyRunner(prepare_study(_grid(tmp_path), storage=f"sqlite:///{scratch / 'grid.db'}"), seed=0)
        runner.run(n_trials=2)
    study_storage.sql_engine(runner.study).dispose()  # closed, as a study copied to the media is
    # A directory and file nobody may write, readable by all, as read-only media are.
    media = Path(tempfile.mkdtemp(prefix="autotune-ro-"))
    try:
        shutil.copy(scratch / "grid.db", media / "grid.db")
        os.chmod(media / "grid.db", 0o444)
        os.chmod(media, 0o555)
        as_user = {"preexec_fn": _without_root_s_override} if os.geteuid() == 0 else {}
        env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(media / "cache"), "HOME": str(media)}
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "from autotune.cli import main; main()",
                "best",
                "--storage",
                f"sqlite:///{media / 'grid.db'}",
                "--json",
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=media,
            timeout=60,
            **as_user,
        )
        assert done.returncode == 0, done.stderr
        assert '"n_complete": 2' in done.stdout
        assert sorted(p.name for p in media.iterdir()) == ["grid.db"]  # nothing written beside it
    finally:
        os.chmod(media, 0o755)
        shutil.rmtree(media, ignore_errors=True)
