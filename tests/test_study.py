"""The study runner end to end: resume, dedup, failure isolation, interrupts, pruning, prior."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest

import autotune.study as study_mod
import autotune.study.runner as study_runner
import autotune.study.storage as study_storage
from autotune.engine.backend import TrialConfig
from autotune.config import load_study_config
from autotune.study import StudyRunner, open_storage, prepare_study, rank_by_prior, run_study
from autotune.study.records import TrialRecord

if __package__:  # tests/ is a package
    from .fake_backends import (
        BlockingBackend,
        FaultyBackend,
        RealExl2Backend,
        child_script,
        interleave_two_workers,
        memory_dir,
        read_log,
        registered,
        write_study,
    )
else:
    from fake_backends import (
        BlockingBackend,
        FaultyBackend,
        RealExl2Backend,
        child_script,
        interleave_two_workers,
        memory_dir,
        read_log,
        registered,
        write_study,
    )

State = optuna.trial.TrialState


@pytest.fixture
def scratch(tmp_path):
    """Where the SQLite storages go: in memory when possible (see fake_backends.memory_dir)."""
    yield from memory_dir(tmp_path)


@pytest.fixture
def storage(scratch) -> str:
    return f"sqlite:///{scratch / 'study.db'}"


def load(storage: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(storage))


def complete_keys(study: optuna.Study) -> list[str]:
    return [TrialRecord.of(t).config_key for t in study.get_trials(states=(State.COMPLETE,))]


def assert_consistent(study: optuna.Study) -> None:
    """The invariants every stored study keeps, whatever happened to the runs that built it."""
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(len(trials)))
    assert not [t.number for t in trials if t.state in (State.RUNNING, State.WAITING)], "trials left RUNNING/WAITING"
    twice = [k for k, n in Counter(complete_keys(study)).items() if n > 1]
    assert not twice, f"configurations COMPLETE twice: {twice}"
    for t in trials:
        if t.user_attrs.get("answered_from") is not None:
            assert t.state == State.PRUNED, f"answered trial {t.number} is {t.state.name}"
        if t.state == State.FAIL:
            assert t.values is None
            assert "metrics" not in t.user_attrs and "score" not in t.user_attrs, f"failed trial {t.number} has values"


# ------------------------------------------------------------------------ resume and dedup


def test_resume_grows_the_study_and_never_measures_twice(default_study_path, twin_plugin, storage):
    cfg = load_study_config(default_study_path)
    first = run_study(cfg, n_trials=4, storage=storage)
    assert first.n_measured == 4 and not first.interrupted
    study = load(storage, cfg.name)
    n_first = len(study.trials)
    assert n_first == first.n_trials >= 4
    keys_first = set(complete_keys(study))
    assert len(keys_first) == 4

    # Ask for a configuration the storage already holds: it must be answered, not launched.
    done = next(t for t in study.get_trials(states=(State.COMPLETE,)))
    prepared = prepare_study(cfg, storage=storage)
    study.enqueue_trial(prepared.space.params_of(TrialConfig.from_dict(TrialRecord.of(done).config)))

    second = run_study(cfg, n_trials=4, storage=storage)
    assert second.n_measured == 4
    study = load(storage, cfg.name)
    trials = study.get_trials()
    assert len(trials) == second.n_trials > n_first
    assert_consistent(study)
    keys = complete_keys(study)
    assert len(keys) == 8 and set(keys) > keys_first

    answered = trials[n_first]
    assert answered.user_attrs["answered_from"] == done.number
    assert answered.state == State.PRUNED
    assert TrialRecord.of(answered).config_key == TrialRecord.of(done).config_key
    assert TrialRecord.of(answered).prune_reason.startswith(f"already evaluated as trial {done.number} (COMPLETE")
    # The answer carries the earlier outcome but never counts as a second measurement.
    assert TrialRecord.of(answered).metrics == TrialRecord.of(done).metrics
    assert second.extra["n_answered_from_storage"] >= 1
    n_pruned = sum(1 for t in trials if t.state == State.PRUNED)
    assert second.n_pruned == n_pruned - second.extra["n_answered_from_storage"]


def test_best_ignores_answered_copies(default_study_path, twin_plugin, storage):
    cfg = load_study_config(default_study_path)
    run_study(cfg, n_trials=3, storage=storage)
    study = load(storage, cfg.name)
    best = study_mod.best_trial(study)
    prepared = prepare_study(cfg, storage=storage)
    study.enqueue_trial(prepared.space.params_of(TrialConfig.from_dict(best.config)))
    summary = run_study(cfg, n_trials=1, storage=storage)
    assert summary.best["number"] == study_mod.best_trial(load(storage, cfg.name)).number
    assert_consistent(load(storage, cfg.name))
    copy = [t for t in load(storage, cfg.name).trials if t.user_attrs.get("answered_from") == best.number]
    assert copy and summary.best["number"] != copy[0].number


# ------------------------------------------------------------------------ failure isolation


def test_failing_backend_does_not_stop_the_study(tmp_path, storage):
    backend = FaultyBackend(tmp_path / "launches.jsonl")
    path = write_study(
        tmp_path / "faulty.toml",
        "fake-faulty",
        ["ok", "okay", "backend-error", "bug", "crash"],
        parallel=(1, 2),
        sampler="grid",
    )
    with registered(backend):
        summary = run_study(load_study_config(path), storage=storage)
    assert not summary.interrupted
    study = load(storage, "fake-study")
    assert_consistent(study)
    trials = study.get_trials()
    assert len(trials) == 10  # every configuration of the grid, each once
    by_weights: dict[str, list[optuna.trial.FrozenTrial]] = {}
    for t in trials:
        by_weights.setdefault(TrialRecord.of(t).config["weights"], []).append(t)

    for w in ("ok", "okay"):
        assert [t.state for t in by_weights[w]] == [State.COMPLETE] * 2
    for t in by_weights["backend-error"]:
        assert t.state == State.FAIL
        assert TrialRecord.of(t).fail_reason == "engine refused to load: unsupported tensor type"
        assert TrialRecord.of(t).log_tail == "load_tensors: failed\n"
    for t in by_weights["bug"]:
        assert t.state == State.FAIL
        assert TrialRecord.of(t).fail_reason == "RuntimeError: plugin bug: list index out of range"
        assert "Traceback" in TrialRecord.of(t).log_tail
    for t in by_weights["crash"]:
        assert t.state == State.FAIL
        assert "exited with status -9 during measurement" in TrialRecord.of(t).fail_reason
    assert summary.n_failed == 6 and summary.n_complete == 4
    assert summary.best["params"] == {
        "backend": "fake-faulty",
        "weights": "okay",
        "ctx": 4096,
        "parallel": 2,
        "mode": "plain",
    }
    assert summary.best["values"] == [25.0]  # the fake's exact speed: nothing invented for failures
    # The killed engines are gone (reaped), not left as zombies or orphans.
    assert len(backend.child_pids) == 2
    for pid in backend.child_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # Failures are evaluated outcomes: a later run does not launch them again.
    before = len(read_log(tmp_path / "launches.jsonl"))
    with registered(FaultyBackend(tmp_path / "launches.jsonl")):
        again = run_study(load_study_config(path), storage=storage)
    assert len(read_log(tmp_path / "launches.jsonl")) == before
    assert again.n_measured == 0


# ------------------------------------------------------------------------ interrupts


def _interrupt_child(tmp_path: Path, scratch: Path, sig: int):
    """Run `autotune study` on a BlockingBackend in a child, signal it mid-launch; return facts."""
    # It counts the search's launches; the finish's (tests/test_finish.py) would launch the best again.
    study_path = write_study(
        tmp_path / "slow.toml",
        "fake-blocking",
        ["a", "bb", "ccc"],
        parallel=(1, 2, 4, 8),
        sampler="tpe",
        study_extra="finish_top = 0",
    )
    storage = f"sqlite:///{scratch / 'slow.db'}"
    log, marker = tmp_path / "launches.jsonl", tmp_path / "blocked"
    argv = ["study", str(study_path), "--storage", storage, "--trials", "50", "--json", "--quiet"]
    env = dict(os.environ, AUTOTUNE_LOAD_PLUGINS="")
    proc = subprocess.Popen(
        [sys.executable, "-c", child_script(log, marker, 4, argv)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):  # bounded: at most 60 s for start-up and three instant launches
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), f"the child never reached its 4th launch: {proc.communicate(timeout=30)}"
        # Three launches are done and stored before the fourth starts.
        assert len(complete_keys(load(storage, "fake-study"))) == 3
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err, storage, study_path, log, marker.read_text(encoding="utf-8")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_leaves_the_storage_consistent(tmp_path, scratch, sig):
    rc, out, err, storage, study_path, log, blocked_key = _interrupt_child(tmp_path, scratch, sig)
    assert rc == 130, err
    assert "interrupted: the storage is consistent" in err
    assert "Traceback" not in err
    report = json.loads(out)
    assert report["interrupted"] is True and report["n_complete"] == 3

    study = load(storage, "fake-study")
    assert_consistent(study)
    failed = study.get_trials(states=(State.FAIL,))
    assert len(failed) == 1
    assert TrialRecord.of(failed[0]).config_key == blocked_key
    assert TrialRecord.of(failed[0]).fail_reason == "interrupted"
    assert failed[0].user_attrs["retry"] is True
    first_keys = set(complete_keys(study))

    # Running again measures the 9 configurations left, the interrupted one included, and
    # nothing that was already measured.
    with registered(BlockingBackend(log)):
        summary = run_study(load_study_config(study_path), n_trials=9, storage=storage)
    assert summary.n_measured == 9 and not summary.interrupted
    study = load(storage, "fake-study")
    assert_consistent(study)
    assert len(complete_keys(study)) == 12  # the whole space: 3 weights x 4 parallel
    launches = Counter(entry["key"] for entry in read_log(log))
    assert launches[blocked_key] == 2  # the interrupted attempt and the measurement
    assert all(n == 1 for key, n in launches.items() if key != blocked_key), launches
    assert first_keys.isdisjoint(entry["key"] for entry in read_log(log)[4:])


def test_keyboard_interrupt_in_backend_run(tmp_path, storage):
    path = write_study(tmp_path / "kbd.toml", "fake-blocking", ["a", "bb"], parallel=(1, 2, 4))
    backend = BlockingBackend(raise_interrupt_on=2)
    with registered(backend):
        summary = run_study(load_study_config(path), n_trials=5, storage=storage)
    assert summary.interrupted
    assert summary.n_complete == 1 and summary.n_failed == 0 and summary.extra["n_cut_short"] == 1
    study = load(storage, "fake-study")
    assert_consistent(study)
    (failed,) = study.get_trials(states=(State.FAIL,))
    assert TrialRecord.of(failed).config_key == backend.calls[1].key
    assert TrialRecord.of(failed).fail_reason == "interrupted"
    assert failed.user_attrs["retry"] is True
    # An interrupted configuration is not an outcome: the next run may propose it again.
    with registered(BlockingBackend()):
        runner = StudyRunner(prepare_study(load_study_config(path), storage=storage))
        assert backend.calls[1].key not in runner._evaluated_keys()
        assert backend.calls[0].key in runner._evaluated_keys()


def test_interrupt_right_after_ask_leaves_no_running_trial(tmp_path, storage):
    path = write_study(tmp_path / "s.toml", "fake-blocking", ["a", "bb"], parallel=(1, 2, 4))
    with registered(BlockingBackend()):
        runner = StudyRunner(prepare_study(load_study_config(path), storage=storage))
        real = runner.sampler.before_trial
        calls = []

        def before_trial(study, trial):
            # Runs inside study.ask(), after the storage has created the trial RUNNING.
            calls.append(trial.number)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the trial is being created
            return real(study, trial)

        runner.sampler.before_trial = before_trial
        summary = runner.run(n_trials=5)
    assert summary.interrupted and summary.n_complete == 2
    assert_consistent(load(storage, "fake-study"))


def test_two_workers_never_measure_one_configuration_twice(tmp_path, storage):
    path = write_study(tmp_path / "race.toml", "fake-blocking", ["a", "bb"], parallel=(1, 2, 4))
    backend = BlockingBackend()
    x, study = interleave_two_workers(storage, path, backend)
    assert [c.key for c in backend.calls].count(x.key) == 1, "X was launched twice"
    assert_consistent(study)


# ------------------------------------------------------------------------ dead workers


def _start_blocked_child(tmp_path: Path, scratch: Path, hostname: str = ""):
    """A worker (child process) blocked in its second launch; the caller kills it."""
    study_path = write_study(tmp_path / "dead.toml", "fake-blocking", ["a", "bb"], parallel=(1, 2, 4), sampler="tpe")
    storage = f"sqlite:///{scratch / 'dead.db'}"
    log, marker = tmp_path / "launches.jsonl", tmp_path / "blocked"
    argv = ["study", str(study_path), "--storage", storage, "--trials", "50", "--json", "--quiet"]
    proc = subprocess.Popen(
        [sys.executable, "-c", child_script(log, marker, 2, argv, hostname)],
        cwd=tmp_path,
        env=dict(os.environ, AUTOTUNE_LOAD_PLUGINS=""),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), proc.communicate(timeout=30)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    (running,) = load(storage, "fake-study").get_trials(states=(State.RUNNING,))
    assert TrialRecord.of(running).config_key == marker.read_text(encoding="utf-8")
    return proc, study_path, storage, log, running


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL: no handler runs, the worker's trial stays RUNNING."""
    proc.kill()
    proc.communicate()


def _wait_until_stale(storage: str, trial_id: int, grace_s: float) -> None:
    """Wait (bounded) until the trial's last heartbeat is older than grace_s by the storage's clock."""
    store = open_storage(storage)
    store.grace_period = grace_s
    study_id = store.get_study_id_from_name("fake-study")
    for _ in range(300):
        if trial_id in store._get_stale_trial_ids(study_id):
            return
        time.sleep(0.1)
    raise AssertionError("the dead worker's heartbeat never went stale")


def _assert_measured_again(storage: str, log: Path, running: optuna.trial.FrozenTrial) -> optuna.trial.FrozenTrial:
    study = load(storage, "fake-study")
    assert_consistent(study)
    dead = study.trials[running.number]
    assert dead.state == State.FAIL
    assert len(complete_keys(study)) == 6  # the whole space, the dead worker's configuration included
    key = TrialRecord.of(running).config_key
    assert key in complete_keys(study)
    assert [e["key"] for e in read_log(log)].count(key) == 2  # the killed attempt and the measurement
    return dead


def test_restart_fails_a_killed_local_workers_trial_at_once(tmp_path, scratch):
    proc, study_path, storage, log, running = _start_blocked_child(tmp_path, scratch)
    _kill(proc)
    with registered(BlockingBackend(log)):
        summary = run_study(load_study_config(study_path), n_trials=5, storage=storage)
    assert summary.n_measured == 5
    dead = _assert_measured_again(storage, log, running)
    assert dead.user_attrs["retry"] is True and "died" in TrialRecord.of(dead).fail_reason


def test_restart_fails_a_dead_remote_workers_trial_after_the_heartbeat_grace(tmp_path, scratch, monkeypatch):
    # A worker on another machine cannot be checked by pid: only its heartbeat tells.
    proc, study_path, storage, log, running = _start_blocked_child(tmp_path, scratch, hostname="other-host")
    _kill(proc)
    assert running.user_attrs["worker"].startswith("other-host:")
    monkeypatch.setattr(study_storage, "HEARTBEAT_GRACE_S", 1)
    _wait_until_stale(storage, running._trial_id, 1)
    with registered(BlockingBackend(log)):
        summary = run_study(load_study_config(study_path), n_trials=5, storage=storage)
    assert summary.n_measured == 5
    _assert_measured_again(storage, log, running)


def test_survivor_fails_a_worker_that_dies_while_it_runs(tmp_path, scratch, monkeypatch):
    proc, study_path, storage, log, running = _start_blocked_child(tmp_path, scratch)
    monkeypatch.setattr(study_runner, "EXPLORE_AFTER_IDLE", 3)
    try:
        with registered(BlockingBackend(log)):
            runner = StudyRunner(prepare_study(load_study_config(study_path), storage=storage))
            _kill(proc)  # the other worker dies after the survivor has started
            store = runner.study._storage
            getattr(store, "_backend", store).grace_period = 1  # the RDBStorage under Optuna's cache
            _wait_until_stale(storage, running._trial_id, 1)
            runner.run(n_trials=5)
    finally:
        if proc.poll() is None:
            _kill(proc)
    _assert_measured_again(storage, log, running)


# ------------------------------------------------------------------------ pruning


def _enqueue(runner: StudyRunner, config: TrialConfig) -> None:
    runner.study.enqueue_trial(runner.prepared.space.params_of(config))


def test_over_budget_and_invalid_configurations_are_pruned_unlaunched(default_study_path, twin_plugin, storage):
    prepared = prepare_study(load_study_config(default_study_path), storage=storage)
    budget = prepared.vram_budget_bytes
    over = invalid = None
    for config in prepared.space.enumerate():
        ctx = prepared.contexts[config.backend]
        reasons = prepared.space.check(config, ctx)
        if reasons and invalid is None:
            invalid = (config, reasons)
        if not reasons and over is None:
            if prepared.backend(config.backend).estimate_memory(config, ctx).total_bytes > budget:
                over = config
    assert over is not None and invalid is not None
    runner = StudyRunner(prepared)
    _enqueue(runner, over)
    _enqueue(runner, invalid[0])
    summary = runner.run(n_trials=1)
    study = load(storage, prepared.cfg.name)
    assert_consistent(study)
    t_over, t_invalid = study.trials[0], study.trials[1]

    assert t_over.state == State.PRUNED
    assert TrialRecord.of(t_over).config_key == over.key
    assert TrialRecord.of(t_over).prune_reason.startswith("infeasible: predicted ")
    predicted = TrialRecord.of(t_over).predicted_vram
    assert predicted["total_bytes"] > budget
    assert predicted["total_bytes"] == sum(
        predicted[k] for k in ("weights_bytes", "kv_bytes", "buffers_bytes", "overhead_bytes")
    )
    assert f"budget {budget / 2**30:.2f} GiB" in TrialRecord.of(t_over).prune_reason
    assert t_over.constraints["vram_over_budget"] > 0  # infeasible to the sampler too
    assert "metrics" not in t_over.user_attrs and "engine" not in t_over.user_attrs  # never launched

    assert t_invalid.state == State.PRUNED
    assert TrialRecord.of(t_invalid).prune_reason == "invalid: " + "; ".join(invalid[1])
    assert "predicted_vram" not in t_invalid.user_attrs and "metrics" not in t_invalid.user_attrs
    assert summary.n_measured == 1 and summary.n_complete == 1


# ------------------------------------------------------------------------ prior


def test_prior_measures_the_twins_best_predictions_first(tmp_path, storage, twin_plugin):
    path = write_study(
        tmp_path / "prior.toml",
        "fake-exl2",
        ["exl2:3.0", "exl2:3.3", "exl2:3.5"],
        ctx=(4096, 8192),
        parallel=(1, 2, 4),
        sampler="tpe",
        extra_space='cache_type = ["fp16", "q8", "q4"]\nflash_attn = [true]',
        study_extra="prior = true\nprior_trials = 4",
    )
    backend = RealExl2Backend()
    with registered(backend):
        cfg = load_study_config(path)
        assert cfg.prior is True and cfg.prior_trials == 4
        prepared = prepare_study(cfg, storage=storage)
        ranked = rank_by_prior(prepared)
        summary = StudyRunner(prepared).run(n_trials=6)
    assert len(ranked) > 6
    assert [c.backend for c, _ in ranked] == ["fake-exl2"] * len(ranked)
    predictions = [p for _, p in ranked]
    assert predictions == sorted(predictions, reverse=True)
    study = load(storage, "fake-study")
    assert_consistent(study)
    first = study.trials[:4]
    assert [TrialRecord.of(t).config_key for t in first] == [c.key for c, _ in ranked[:4]]
    assert all(t.user_attrs.get("from_prior") is True for t in first)
    assert not any(t.user_attrs.get("from_prior") for t in study.trials[4:])
    assert [c.key for c in backend.calls[:4]] == [c.key for c, _ in ranked[:4]]
    assert summary.n_measured == 6
    # The real backend's measurement, not the twin's prediction, is what the study records.
    assert first[0].values[0] == pytest.approx(0.9 * ranked[0][1])
