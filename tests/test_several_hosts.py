"""Workers on several hosts: one liveness rule for a claim's worker, and a summary that names
the configurations still being measured (a best named before they end may change)."""

from __future__ import annotations

import datetime
import os
import re
import socket

import optuna
import pytest
import sqlalchemy
from click.testing import CliRunner
from optuna.storages._rdb import models

from autotune.cli import cli
from autotune.config import load_study_config
from autotune.report.text import stored_summary, summary_text
from autotune.study import StudyRunner, claims, prepare_study
from autotune.study import storage as study_storage
from autotune.study.records import store

if __package__:  # tests/ is a package
    from .fake_backends import FakeBackend, memory_dir, registered, write_study
else:
    from fake_backends import FakeBackend, memory_dir, registered, write_study


@pytest.fixture
def scratch(tmp_path):
    yield from memory_dir(tmp_path)


def test_the_liveness_rule_is_the_pid_here_and_the_heartbeat_everywhere():
    here, limit = socket.gethostname(), 60.0
    gone = 2**22 + 1  # above Linux's largest pid_max: no such process here
    # On this host a dead pid is dead at once, whatever its heartbeat says.
    assert claims.holder(1, f"{here}:{gone}", 0.0, limit).dead_because == "its process is gone"
    assert claims.holder(1, f"{here}:{os.getpid()}", 5.0, limit).alive
    # On another host a pid means nothing: its heartbeat decides, against the stated limit.
    assert claims.holder(1, f"other-host:{gone}", 59.0, limit).alive
    stale = claims.holder(1, f"other-host:{gone}", 61.0, limit)
    assert (
        not stale.alive
        and stale.describe() == f"host other-host (pid {gone}, last heartbeat 61 s ago, over the 60 s limit)"
    )
    # A live pid whose heartbeat stopped (a pid reused, a worker hung) is dead too.
    assert not claims.holder(1, f"{here}:{os.getpid()}", 61.0, limit).alive
    # No heartbeat recorded (a journal storage; a trial just asked): nothing says it is dead.
    assert claims.holder(1, "other-host:7", None, limit).alive


def _another_host_measures_the_best(tmp_path, url: str):
    """A grid of six whose best (parallel 4, weights bb) a worker on another host claimed and
    is measuring: its trial RUNNING, stamped with its host and pid, its heartbeat beaten."""
    cfg = load_study_config(
        write_study(
            tmp_path / "grid.toml",
            "fake",
            ["a", "bb"],
            parallel=(1, 2, 4),
            sampler="grid",
            study_extra="finish_top = 0",
        )
    )
    other = StudyRunner(prepare_study(cfg, storage=url), seed=0)
    config = max(other.prepared.space.enumerate(), key=FakeBackend().speed)
    other.queue.enqueue(config)
    trial = other.study.ask()
    store(trial, {"config_key": config.key, "worker": "other-host:4242"})
    assert other.claims.claim(config.key, trial._trial_id) is None
    other.study._storage.record_heartbeat(trial._trial_id)
    return cfg, trial, config


def test_a_study_that_ends_while_another_host_measures_says_the_best_may_change(tmp_path, scratch):
    url = f"sqlite:///{scratch / 'grid.db'}"
    with registered(FakeBackend()):
        cfg, trial, config = _another_host_measures_the_best(tmp_path, url)
        survivor = StudyRunner(prepare_study(cfg, storage=url), seed=0)
        summary = survivor.run()
    assert survivor.study.trials[trial.number].state == optuna.trial.TrialState.RUNNING  # alive: left alone
    assert summary.best["params"] != config.as_dict()  # the best so far, not the study's
    line = "1 configuration still being measured by host other-host (pid 4242, last heartbeat "
    text = summary_text(summary)
    assert line in text and "s ago); the best may change" in text
    [measuring] = summary.extra["being_measured"]
    assert (measuring["number"], measuring["host"], measuring["pid"], measuring["alive"]) == (
        trial.number,
        "other-host",
        4242,
        True,
    )
    assert measuring["heartbeat_limit_s"] == study_storage.HEARTBEAT_GRACE_S
    # `best` builds the same summary from the storage, and says the same.
    said = CliRunner().invoke(cli, ["best", "--storage", url])
    assert said.exit_code == 0 and line in said.output and "the best may change" in said.output


def test_a_dead_host_s_configuration_is_named_then_measured_again(tmp_path, scratch):
    url = f"sqlite:///{scratch / 'grid.db'}"
    with registered(FakeBackend()):
        cfg, trial, config = _another_host_measures_the_best(tmp_path, url)
        # Its host died five minutes ago: its last heartbeat is that old, by the database's clock.
        engine = sqlalchemy.create_engine(url)
        beats = models.TrialHeartbeatModel.__table__
        with engine.begin() as conn:
            now = conn.execute(sqlalchemy.select(sqlalchemy.func.now())).scalar()
            conn.execute(
                beats.update()
                .where(beats.c.trial_id == trial._trial_id)
                .values(heartbeat=now - datetime.timedelta(seconds=300))
            )
        engine.dispose()
        text = summary_text(stored_summary(url))
        assert re.search(
            r"1 configuration left RUNNING by a dead worker: host other-host \(pid 4242, last heartbeat "
            r"3\d\d s ago, over the 60 s limit\); the next 'autotune study' measures it again",
            text,
        ), text
        resumed = StudyRunner(prepare_study(cfg, storage=url), seed=0)
        summary = resumed.run()
    failed = resumed.study.trials[trial.number]
    assert failed.state == optuna.trial.TrialState.FAIL and failed.user_attrs["retry"] is True
    assert "worker other-host:4242 died" in failed.user_attrs["fail_reason"]
    assert summary.best["params"] == config.as_dict()
    assert "being_measured" not in summary.extra
