"""A failure every trial would repeat stops the study (exit 2, the cause, the remedy); a failure
of one configuration (out of memory) never does; nothing to deploy is not exit 0."""

from __future__ import annotations

from click.testing import CliRunner

from autotune.cli import cli
from autotune.study.systematic import STREAK, FailureWatch, launching, making, normalized

if __package__:  # tests/ is a package
    from .fake_backends import BrokenBackend, read_log, registered, write_study
else:
    from fake_backends import BrokenBackend, read_log, registered, write_study


def _study(tmp_path, storage, backend, n_configs=4):
    path = write_study(
        tmp_path / "broken.toml", "fake-broken", [f"w{i}" for i in range(n_configs)], parallel=(1, 2), sampler="grid"
    )
    with registered(backend):
        return CliRunner().invoke(cli, ["study", str(path), "--storage", storage, "--quiet"])


def test_the_same_cause_in_every_launch_stops_the_study_with_exit_2(tmp_path, tmp_storage):
    backend = BrokenBackend(tmp_path / "launches.jsonl")
    result = _study(tmp_path, tmp_storage, backend)
    assert result.exit_code == 2, result.output
    assert len(read_log(tmp_path / "launches.jsonl")) == STREAK  # of 8 configurations: the budget is kept
    assert "fake-broken: launching the engine: 3 failures in a row with the same cause" in result.output
    assert "unknown model architecture 'qwen3next'" in result.output and "fix the cause" in result.output
    assert "why the search ended: stopped: fake-broken: launching the engine" in result.output


def test_out_of_memory_in_every_configuration_never_stops_the_study_but_is_not_exit_0(tmp_path, tmp_storage):
    backend = BrokenBackend(tmp_path / "launches.jsonl", oom=True)
    result = _study(tmp_path, tmp_storage, backend)
    assert len(read_log(tmp_path / "launches.jsonl")) == 8  # every configuration tried: each its own failure
    assert result.exit_code == 1, result.output
    assert "no feasible configuration" in result.output and "8 failed" in result.output


def test_an_engine_that_worked_once_is_not_broken(tmp_path, tmp_storage):
    backend = BrokenBackend(tmp_path / "launches.jsonl", works_first=1)
    result = _study(tmp_path, tmp_storage, backend)
    assert len(read_log(tmp_path / "launches.jsonl")) >= 8  # the search went on (and the finish ran)
    assert result.exit_code == 0, result.output


def test_the_watch_sets_numbers_and_paths_aside_and_keeps_scopes_apart():
    assert normalized("making q4_0 from /m/a failed: BPE pre-tokenizer was not recognized (line 12)") == normalized(
        "making q4_0 from /m/b failed: BPE pre-tokenizer was not recognized (line 31)"
    )
    watch = FailureWatch()
    cause = "making f16 from /models/x failed: BPE pre-tokenizer was not recognized"
    assert watch.failed(making("b"), cause) is None
    assert watch.failed(launching("b"), "exited with code 1: bad flag") is None  # another scope: its own streak
    assert watch.failed(making("b"), cause) is None
    stop = watch.failed(making("b"), cause)
    assert stop is not None and stop.scope == "b: making weights" and stop.count == 3 and "BPE" in stop.text
    other = FailureWatch()
    for reason in ("cause one", "cause two", "cause one", "cause two"):  # not one cause: no stop
        assert other.failed(launching("b"), reason) is None
    other.worked(launching("b"))
    for _ in range(5):  # it worked once in this run: a later streak is the configurations'
        assert other.failed(launching("b"), "cause one") is None


def test_the_counts_name_every_state_and_add_up(tmp_path, tmp_storage):
    # A random sampler over 2 configurations asked for more: its repeats are answered from storage.
    from autotune.config import load_study_config
    from autotune.report.text import stored_summary, summary_text
    from autotune.study import run_study

    if __package__:
        from .fake_backends import FakeBackend
    else:
        from fake_backends import FakeBackend
    path = write_study(tmp_path / "two.toml", "fake", ["a"], parallel=(1, 2), sampler="random")
    with registered(FakeBackend()):
        run_study(load_study_config(path), n_trials=4, storage=tmp_storage)
    s = stored_summary(tmp_storage)
    answered = s.extra["n_answered_from_storage"]
    assert answered > 0
    assert s.n_complete + s.n_pruned + s.n_failed + answered + s.extra["n_cut_short"] == s.n_trials
    assert (
        f"{s.n_trials} trials: {s.n_complete} complete, {s.n_pruned} pruned, {s.n_failed} failed, "
        f"{answered} answered from storage" in summary_text(s)
    )
    # A configuration queued for a later run (WAITING) is said to be queued, not "still running"
    # (the report of a stopped study said "3 still running" of trials never started).
    import optuna

    study = optuna.load_study(study_name=s.study_name, storage=tmp_storage)
    study.enqueue_trial({"parallel": 1})
    queued = stored_summary(tmp_storage)
    assert queued.extra["n_queued"] == 1 and "n_running" not in queued.extra
    assert "1 queued, not started" in summary_text(queued) and "still running" not in summary_text(queued)
