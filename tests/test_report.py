"""What a study reports: the Pareto front of a two-objective study."""

from __future__ import annotations

import re

import optuna

from autotune.config import load_study_config
from autotune.study import pareto_front, run_study
from autotune.study.records import TrialRecord


def test_a_pareto_study_reports_its_non_dominated_feasible_trials(
    twin_plugin, default_study_path, tmp_path, tmp_storage
):
    text = default_study_path.read_text(encoding="utf-8").replace(
        "penalty_per_point = 1.0", 'penalty_per_point = 1.0\nmode = "pareto"'
    )
    path = tmp_path / "pareto.toml"
    path.write_text(text, encoding="utf-8")
    summary = run_study(load_study_config(path), n_trials=15, storage=tmp_storage, seed=0)
    front = summary.extra["pareto_front"]
    assert front
    from autotune.report.text import summary_text

    # Each member's drop in words, never a bare sign (issue 28: "+" for a drop).
    lines = summary_text(summary).split("Pareto front (throughput vs quality drop):\n")[1].splitlines()[: len(front)]
    assert all(
        re.match(r"  \d+\.\d tok/s, (drop|gain) \d+\.\d\d points: |  \d+\.\d tok/s, no drop ", line) for line in lines
    ), lines
    study = optuna.load_study(study_name=summary.study_name, storage=tmp_storage)
    feasible = [
        t
        for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
        if t.user_attrs.get("answered_from") is None and all(c <= 0 for c in t.constraints.values())
    ]
    # Throughput is maximised and the quality drop minimised: nothing feasible beats a front member on both.
    for member in front:
        tput, drop = member["values"]
        assert not any(
            t.values[0] >= tput and t.values[1] <= drop and tuple(t.values) != (tput, drop) for t in feasible
        )
    # And every feasible trial off the front is beaten by one on it.
    on_front = {t.number for t in pareto_front(study)}
    assert {m["number"] for m in front} == on_front
    for t in feasible:
        if t.number not in on_front:
            assert any(m["values"][0] >= t.values[0] and m["values"][1] <= t.values[1] for m in front)


def test_the_explanation_of_a_resumed_study_uses_the_latest_result_per_configuration(tmp_path):
    from autotune.engine.backend import TrialConfig
    from autotune.study.explain import explain_best
    from autotune.study import StudyRunner, prepare_study
    from tests.fake_backends import FakeBackend, registered, write_study

    class Flaky(FakeBackend):
        interrupted = False

        def run(self, config, ctx):
            if config.parallel == 1 and not Flaky.interrupted:
                Flaky.interrupted = True
                raise KeyboardInterrupt  # Ctrl-C while parallel 1 is measured
            return super().run(config, ctx)

    storage = f"sqlite:///{tmp_path / 's.db'}"
    path = write_study(tmp_path / "s.toml", "fake", ["w"], parallel=(1, 2), sampler="grid")
    with registered(Flaky()):
        first = StudyRunner(prepare_study(load_study_config(path), storage=storage), seed=0)
        p1 = TrialConfig("fake", "w", 4096, 1, (("mode", "plain"),))
        first.study.enqueue_trial(first.prepared.space.params_of(p1))
        assert first.run(n_trials=1).interrupted
        again = StudyRunner(prepare_study(load_study_config(path), storage=storage), seed=0)
        summary = again.run()
        why = explain_best(again.prepared, again.study, summary.best)
    states = [t.state for t in again.study.trials if TrialRecord.of(t).config_key == p1.key]
    assert optuna.trial.TrialState.FAIL in states and optuna.trial.TrialState.COMPLETE in states
    assert summary.best["params"]["parallel"] == 2
    (line,) = [w for w in why if w.startswith("parallel 1:")]
    assert line.startswith("parallel 1: measured score") and "interrupted" not in line


def test_study_and_best_give_one_summary(twin_plugin, default_study_path, tmp_storage):
    """The summary is built once, from the storage: what a run returns (``study --json``) and
    what ``best --json`` reads back afterwards are the same object but for what only the run
    knows (how many it launched, how long it took). ``converged`` was the run's alone."""
    from autotune.report.text import stored_summary, summary_json

    ran = summary_json(run_study(load_study_config(default_study_path), n_trials=6, storage=tmp_storage, seed=0))
    stored = summary_json(stored_summary(tmp_storage, ran["study"]))
    assert set(ran) == set(stored)
    run_only = {"n_new", "n_measured", "interrupted", "elapsed_s"}
    assert {k: v for k, v in ran.items() if k not in run_only} == {k: v for k, v in stored.items() if k not in run_only}
    assert isinstance(stored["converged"], bool) and stored["why"]  # stored by the run, not by the CLI


def test_a_cpu_studys_report_calls_its_device_a_device_and_its_budget_one_figure(tmp_path, tmp_storage):
    # Issue 28: a "GPU" row read "CPU: Intel Xeon"; one budget was 17.7, 17.45 and 17.4.
    import re

    from autotune.report.text import stored_summary
    from autotune.report.html import render
    from autotune.study.admission import budget_text
    from autotune.study.records import study_header
    from tests.fake_backends import FakeBackend, registered, write_study

    path = write_study(tmp_path / "cpu.toml", "fake", ["q4"], ctx=(4096,), parallel=(1,), sampler="grid")
    path.write_text(path.read_text().replace('gpu = "v100-16gb"', 'gpu = "cpu"\nvram_budget_gib = 4'))
    with registered(FakeBackend()):
        run_study(load_study_config(path), n_trials=1, storage=tmp_storage)
    study = optuna.load_study(study_name="fake-study", storage=tmp_storage)
    page = render(study, stored_summary(tmp_storage))
    assert "<tr><th>device</th><td>CPU: " in page and "<th>GPU</th>" not in page
    shown = budget_text(study_header(study)["vram_budget_bytes"])
    assert shown == "2.25 GiB" and f"<tr><th>memory budget</th><td>{shown}</td></tr>" in page  # 4 GiB - 1792 MiB
    assert set(re.findall(r"budget (\d+\.\d+) GiB", page)) == {"2.25"}  # the memory plot's line too
