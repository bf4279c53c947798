"""The notes autotune writes for optuna-dashboard: through its public ``save_note``, read back by
its ``get_note``, passed to the runner as an observer; and a study's machinery that imports
neither optuna-dashboard nor what it pulls in until the first note."""

from __future__ import annotations

import json
import subprocess
import sys

import optuna
import optuna_dashboard

from autotune.report import dashboard
from autotune.study import open_storage

LONG = "".join(f"line {i}: {'x' * (i % 70)}\n" for i in range(200))  # 8690 characters: 5 chunks of 2045


def test_notes_are_read_back_by_optuna_dashboard(tmp_path):
    study = optuna.create_study(storage=open_storage(f"sqlite:///{tmp_path / 's.db'}"))
    trials = [study.ask() for _ in range(2)]
    for which, body in ((0, LONG), (1, "short"), (0, "shorter now"), (None, LONG), (None, "")):
        dashboard.save_note(study if which is None else trials[which], body)
    assert optuna_dashboard.get_note(trials[0]) == "shorter now"
    assert optuna_dashboard.get_note(trials[1]) == "short"
    assert optuna_dashboard.get_note(study) == ""


def test_the_trial_note_is_an_observer_of_the_finished_trial(tmp_path):
    study = optuna.create_study(storage=open_storage(f"sqlite:///{tmp_path / 's.db'}"))
    trial = study.ask()
    trial.set_user_attr("config", {"backend": "b", "weights": "w.gguf", "ctx": 4096, "parallel": 2})
    trial.set_user_attr("prune_reason", "does not fit: needs 9 GiB")
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    dashboard.trial_notes(None)(study, trial)
    note = optuna_dashboard.get_note(trial)
    assert note.startswith("### b: w.gguf") and "**not launched**: does not fit: needs 9 GiB" in note


def test_the_study_machinery_imports_no_dashboard_server_nor_scipy():
    """What ``autotune study`` imports before it runs (the CLI, the runner, the plugins with the
    twin, the notes): optuna-dashboard's server with scikit-learn and pandas, and scipy, are a
    second and a half of every study; they load where used (``autotune dashboard``, a quality
    bound's statistics, a real study's calibration)."""
    code = (
        "import sys, autotune.cli, autotune.study.runner, autotune.report.dashboard, autotune.plugins as p;"
        "p.load_plugins(); import autotune_plugins.twin;"
        "print(__import__('json').dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('optuna_dashboard', 'sklearn', 'pandas', 'scipy'))))"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert loaded == []


def _served(app, path):
    said = {}
    body = b"".join(
        app(
            {"PATH_INFO": path, "REQUEST_METHOD": "GET"},
            lambda status, headers, exc_info=None: said.update(status=status, headers=dict(headers)),
        )
    )
    return said, body


def test_the_dashboard_page_wraps_long_attributes_and_nothing_else_changes(tmp_path):
    """optuna-dashboard's own page, served through ``wrapping_pages``: the style that wraps a
    whole attribute's line is in its head (one 5,000-character metrics line made a trial page
    9,211 px wide), the length says so; its API answers byte for byte as without it."""
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}")
    optuna.create_study(storage=storage, study_name="s")
    plain, wrapped = optuna_dashboard.wsgi(storage), dashboard.wrapping_pages(optuna_dashboard.wsgi(storage))
    said, page = _served(wrapped, "/dashboard/studies/1")
    _, original = _served(plain, "/dashboard/studies/1")
    assert said["status"].startswith("200") and dashboard.WRAP_ATTRIBUTES + b"</head>" in page
    assert page.replace(dashboard.WRAP_ATTRIBUTES, b"") == original
    assert int(said["headers"]["Content-Length"]) == len(page)
    assert "'unsafe-inline'" in said["headers"]["Content-Security-Policy"].split("style-src")[1].split(";")[0]
    assert _served(wrapped, "/api/studies")[1] == _served(plain, "/api/studies")[1]


def test_the_wrapped_page_closes_what_the_dashboard_answered():
    closed = []

    class Answer(list):
        def close(self):
            closed.append(True)

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/html"), ("Content-Length", "27")])
        return Answer([b"<html><head></head></html>"])

    said, page = _served(dashboard.wrapping_pages(app), "/dashboard")
    assert (
        closed == [True] and dashboard.WRAP_ATTRIBUTES in page and said["headers"]["Content-Length"] == str(len(page))
    )
