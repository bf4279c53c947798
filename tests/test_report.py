"""What a study reports: the Pareto front of a two-objective study."""

from __future__ import annotations

import optuna

from autotune.config import load_study_config
from autotune.study import pareto_front, run_study


def test_a_pareto_study_reports_its_non_dominated_feasible_trials(twin_plugin, default_study_path, tmp_path, tmp_storage):
    text = default_study_path.read_text(encoding="utf-8").replace("penalty_per_point = 1.0", 'penalty_per_point = 1.0\nmode = "pareto"')
    path = tmp_path / "pareto.toml"
    path.write_text(text, encoding="utf-8")
    summary = run_study(load_study_config(path), n_trials=15, storage=tmp_storage, seed=0)
    front = summary.extra["pareto_front"]
    assert front
    study = optuna.load_study(study_name=summary.study_name, storage=tmp_storage)
    feasible = [t for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
                if t.user_attrs.get("answered_from") is None and all(c <= 0 for c in t.constraints.values())]
    # Throughput is maximised and the quality drop minimised: nothing feasible beats a front member on both.
    for member in front:
        tput, drop = member["values"]
        assert not any(t.values[0] >= tput and t.values[1] <= drop and tuple(t.values) != (tput, drop) for t in feasible)
    # And every feasible trial off the front is beaten by one on it.
    on_front = {t.number for t in pareto_front(study)}
    assert {m["number"] for m in front} == on_front
    for t in feasible:
        if t.number not in on_front:
            assert any(m["values"][0] >= t.values[0] and m["values"][1] <= t.values[1] for m in front)
