"""A study restarted after its worker was killed picks up where it was, nothing lost."""

from __future__ import annotations

import socket

import optuna

from autotune.config import load_study_config
from autotune.study import StudyRunner, prepare_study


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
    assert t.user_attrs["retry"] is True and "died" in t.user_attrs["fail_reason"]
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
