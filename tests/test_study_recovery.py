"""A study restarted after its worker was killed picks up where it was, nothing lost."""

from __future__ import annotations

import socket
import time
from collections import Counter

import optuna
import pytest

from autotune.engine.backend import TrialConfig
from autotune.config import load_study_config
from autotune.study import StudyRunner, prepare_study, records
from autotune.study import trial_queue
from autotune.study import storage as study_storage
from autotune.study.records import store
from autotune.study.trial_result import TrialResult
from autotune.study.records import TrialRecord

if __package__:  # tests/ is a package
    from .fake_backends import FakeBackend, memory_dir, read_log, registered, write_study
else:
    from fake_backends import FakeBackend, memory_dir, read_log, registered, write_study


def test_a_killed_local_worker_s_trial_is_failed_for_retry_at_restart(twin_plugin, default_study_path, tmp_storage):
    cfg = load_study_config(default_study_path)
    runner = StudyRunner(prepare_study(cfg, storage=tmp_storage), seed=0)
    runner.run(n_trials=3)
    # A worker killed with SIGKILL leaves its trial RUNNING, stamped with its host and pid.
    orphan = runner.study.ask()
    orphan.set_user_attr("worker", f"{socket.gethostname()}:999999999")
    orphan.set_user_attr("config_key", "whatever was being measured")

    again = StudyRunner(prepare_study(cfg, storage=tmp_storage), seed=1)
    t = again.study.trials[orphan.number]
    assert t.state == optuna.trial.TrialState.FAIL
    assert t.user_attrs["retry"] is True and "died" in TrialRecord.of(t).fail_reason
    # Retried trials never answer for their configuration.
    assert "whatever was being measured" not in again._evaluated_keys()
    summary = again.run(n_trials=2)
    assert summary.n_complete >= 5
    assert not again.study.get_trials(states=(optuna.trial.TrialState.RUNNING,))


def test_a_live_worker_s_trial_is_left_alone(twin_plugin, default_study_path, tmp_storage):
    import os

    cfg = load_study_config(default_study_path)
    runner = StudyRunner(prepare_study(cfg, storage=tmp_storage), seed=0)
    mine = runner.study.ask()
    mine.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    StudyRunner(prepare_study(cfg, storage=tmp_storage), seed=1)
    assert runner.study.trials[mine.number].state == optuna.trial.TrialState.RUNNING


@pytest.fixture
def scratch(tmp_path):
    """Where the SQLite storages go: in memory when possible (see fake_backends.memory_dir)."""
    yield from memory_dir(tmp_path)


def _until_stale(study: optuna.Study, trial_id: int) -> None:
    """Wait (bounded) until the storage itself calls the trial's heartbeat stale."""
    store = study._storage
    store = getattr(store, "_backend", store)  # the RDBStorage under Optuna's cache
    for _ in range(100):
        if trial_id in store._get_stale_trial_ids(study._study_id):
            return
        time.sleep(0.05)
    raise AssertionError("the heartbeat never went stale")


@pytest.mark.parametrize("death", ["killed here", "killed on another host"])
def test_a_grid_killed_mid_trial_measures_every_configuration_once_on_resume(tmp_path, scratch, monkeypatch, death):
    monkeypatch.setattr(study_storage, "HEARTBEAT_GRACE_S", 1)
    storage = f"sqlite:///{scratch / 'grid.db'}"
    log = tmp_path / "launches.jsonl"
    # It counts the search's launches; the finish's (tests/test_finish.py) would launch the best again.
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
    with registered(FakeBackend(log)):
        first = StudyRunner(prepare_study(cfg, storage=storage), seed=0)
        first.run(n_trials=2)
        # What a worker killed by SIGKILL in its third trial leaves: the grid's next queued trial
        # RUNNING, stamped with the dead worker, its configuration claimed, its heartbeat beaten.
        orphan = first.study.ask()
        config = TrialConfig.from_dict(records.field_of(orphan.user_attrs, "config"))  # a running trial: no record yet
        host = socket.gethostname() if death == "killed here" else "other-host"
        store(orphan, {"config_key": config.key, "worker": f"{host}:999999999"})
        first.claims.claim(config.key, orphan._trial_id)
        first.study._storage.record_heartbeat(orphan._trial_id)
        if death == "killed on another host":
            _until_stale(first.study, orphan._trial_id)

        resumed = StudyRunner(prepare_study(cfg, storage=storage), seed=0)
        summary = resumed.run()

    trials = resumed.study.get_trials()
    assert trials[orphan.number].state == optuna.trial.TrialState.FAIL
    assert not [
        t.number for t in trials if t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)
    ]
    outcomes = Counter(
        TrialRecord.of(t).config_key
        for t in trials
        if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        and t.user_attrs.get("answered_from") is None
    )
    grid = {c.key for c in resumed.prepared.space.enumerate()}
    assert set(outcomes) == grid and set(outcomes.values()) == {1}, outcomes
    assert sorted(e["key"] for e in read_log(log)) == sorted(grid)  # the orphan itself launched nothing
    assert summary.n_complete == len(grid) and summary.best["number"] != orphan.number


def test_a_configuration_that_kills_its_worker_every_time_is_not_queued_forever(tmp_path, scratch):
    cfg = load_study_config(write_study(tmp_path / "s.toml", "fake", ["a"], parallel=(1, 2)))
    with registered(FakeBackend()):
        runner = StudyRunner(prepare_study(cfg, storage=f"sqlite:///{scratch / 's.db'}"), seed=0)
    config = next(runner.prepared.space.enumerate())
    queued = []
    attempt = runner.study.ask()
    for _ in range(trial_queue.MAX_CUT_SHORT):
        store(attempt, {"config": config.as_dict(), "config_key": config.key, "worker": "other-host:1"})
        runner._fail_quietly(attempt, TrialResult(), "interrupted", retry=True)
        queued.append(runner.queue.requeue_cut_short())
        attempt = runner.study.ask()  # the queued retry, while there is one
    assert queued == [1] * (trial_queue.MAX_CUT_SHORT - 1) + [0]
