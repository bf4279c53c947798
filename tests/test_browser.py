"""The report and the dashboard as a person sees them: headless Chromium (tests/browser.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import optuna
import pytest

from autotune.config import load_study_config
from autotune.report import load_study, stored_summary, write_study_report
from autotune.study import StudyRunner, prepare_study
from tests.browser import check_report, chromium, console_errors, wait_for
from tests.conftest import plugin_registered


@pytest.fixture(scope="module")
def twin_study(tmp_path_factory, request):
    """The default study on the twin, 12 launches: stored, with notes, in a file storage."""
    import autotune_plugins.twin as twin

    from tests.conftest import REPO

    tmp = tmp_path_factory.mktemp("browser")
    url = f"sqlite:///{tmp / 'v100.db'}"
    with plugin_registered(twin, "twin"):
        runner = StudyRunner(prepare_study(load_study_config(REPO / "studies" / "v100-qwen27b.toml"), storage=url))
        runner.run(n_trials=12)
    return tmp, url


def test_the_report_renders_its_plots_in_chromium(twin_study):
    tmp, url = twin_study
    out = write_study_report(load_study(url), stored_summary(url), tmp / "report.html")
    n, rows, winner = check_report(out, min_plots=3)  # knee, memory, quality; no bandwidth-known GPU run
    assert n >= 3 and rows >= 12
    assert "Winner: trial" in winner and "deploy" in winner


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_dashboard_speaks_autotune(twin_study):
    tmp, url = twin_study
    port = _free_port()
    env_plugins = {"AUTOTUNE_LOAD_PLUGINS": "twin"}
    import os

    server = subprocess.Popen([sys.executable, "-m", "autotune.cli", "dashboard", "--storage", url, "--port", str(port)],
                              env=dict(os.environ, **env_plugins), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, server.stdout.read().decode()[-2000:]
                assert time.monotonic() < deadline, "the dashboard did not start listening in 30 s"
                time.sleep(0.3)
        study = load_study(url)
        measured = next(t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE)
        with chromium() as browser:
            browser.get(f"http://127.0.0.1:{port}/dashboard/studies/1")
            wait_for(browser, lambda: "score (aggregate_tok_s - penalty)" in browser.page_source,
                     what="the objective's name on the study page")
            wait_for(browser, lambda: browser.execute_script(
                "return [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.querySelector('.main-svg')).length"),
                what="a rendered plot on the study page")
            browser.get(f"http://127.0.0.1:{port}/dashboard/studies/1/trials?numbers={measured.number}")
            wait_for(browser, lambda: "parallel streams of" in browser.find_element("tag name", "body").text,
                     what=f"trial {measured.number}'s note")
            text = browser.find_element("tag name", "body").text
            assert "aggregate" in text and "VRAM predicted" in text
            # Each user attribute is one unwrapped line: the long values are stored in parts
            # (records.cells), so the page is about as wide as the window (it was 9,238 px).
            browser.set_window_size(1280, 1000)
            width = browser.execute_script("return document.documentElement.scrollWidth")
            assert width < 2000, f"the trial page is {width} px wide in a 1280 px window"
            assert not console_errors(browser), console_errors(browser)
    finally:
        server.terminate()
        server.wait(timeout=10)
