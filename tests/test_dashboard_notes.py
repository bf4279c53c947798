"""The notes autotune writes for optuna-dashboard (``autotune.dashboard.save_note``): optuna-dashboard's
own layout, written in one transaction without importing optuna-dashboard, read back by its reader;
and a study's machinery that imports neither it nor what it pulls in."""

from __future__ import annotations

import json
import subprocess
import sys

import optuna
import optuna_dashboard
import pytest

from autotune import dashboard
from autotune.study import open_storage, trial_writes

LONG = "".join(f"line {i}: {'x' * (i % 70)}\n" for i in range(200))  # 8690 characters: 5 chunks of 2045


def _study(url: str) -> optuna.Study:
    return optuna.create_study(storage=open_storage(url) if url.startswith("sqlite") else url)


def _notes(study: optuna.Study) -> dict:
    return {k: v for k, v in study._storage.get_study_system_attrs(study._study_id).items()
            if k.startswith("dashboard:")}


@pytest.mark.parametrize("upsert", [True, False], ids=["upsert", "per-key write"])
def test_notes_are_optuna_dashboards_own(tmp_path, monkeypatch, upsert):
    if not upsert:  # a database without an upsert: Optuna's own writes, the same attributes
        monkeypatch.setattr(trial_writes, "_upsert", lambda table, dialect, owner: None)
    ours, theirs = _study(f"sqlite:///{tmp_path / 'ours.db'}"), _study(f"sqlite:///{tmp_path / 'theirs.db'}")
    trials = {study: [study.ask() for _ in range(2)] for study in (ours, theirs)}
    for which, body in ((0, LONG), (1, "short"), (0, "shorter now"), (None, LONG), (None, "")):
        dashboard.save_note(ours, None if which is None else trials[ours][which], body)
        optuna_dashboard.save_note(theirs if which is None else trials[theirs][which], body)
        assert _notes(ours) == _notes(theirs)  # versions, chunks, and an older note's chunks blanked
    assert len(_notes(ours)) == 3 + 5 + 1 + 5  # versions; chunks of trial 0, trial 1, the study
    trial0 = optuna.Trial(ours, ours.trials[0]._trial_id)
    assert optuna_dashboard.get_note(trial0) == "shorter now"
    assert optuna_dashboard.get_note(ours) == ""


def test_a_storage_of_another_kind_gets_optuna_dashboards_writer():
    study = optuna.create_study()  # in memory
    trial = study.ask()
    dashboard.save_note(study, trial, LONG)
    dashboard.save_note(study, None, "the summary")
    assert optuna_dashboard.get_note(trial) == LONG
    assert optuna_dashboard.get_note(study) == "the summary"


def test_the_study_machinery_imports_no_dashboard_server_nor_scipy():
    """What ``autotune study`` imports before it runs (the CLI, the runner, the plugins with the
    twin, the notes): optuna-dashboard's server with scikit-learn and pandas, and scipy, are a
    second and a half of every study; they load where used (``autotune dashboard``, a quality
    bound's statistics, a real study's calibration)."""
    code = ("import sys, autotune.cli, autotune.study.runner, autotune.dashboard, autotune.plugins as p;"
            "p.load_plugins(); import autotune_plugins.twin;"
            "print(__import__('json').dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('optuna_dashboard', 'sklearn', 'pandas', 'scipy'))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout)
    assert loaded == []
