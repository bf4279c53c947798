"""The report and the dashboard as a person sees them: headless Chromium (tests/browser.py),
every page no wider than a 1,280 px window."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import optuna
import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.config import load_study_config
from autotune.report.dashboard import annotate_study, deploy_commands, trial_notes
from autotune.report.text import load_study, stored_summary, summary_text, write_study_report
from autotune.study import StudyRunner, prepare_study
from tests.browser import WINDOW, assert_fits, check_report, chromium, console_errors, plots_rendered, wait_for
from tests.conftest import plugin_registered
from tests.fake_backends import BrokenBackend, registered, write_study

TWIN, BROKEN = "v100-qwen27b", "broken"
# What a converter prints for a model it does not know, as the new user's 217 trials did.
CAUSE = (
    "converting the model failed: Traceback (most recent call last): "
    + 'File "/opt/llama.cpp/convert_hf_to_gguf.py", line 712, in get_vocab_base_pre ' * 6
    + "NotImplementedError: BPE pre-tokenizer was not recognized - update get_vocab_base_pre() "
    + "chkhsh="
    + "0123456789abcdef" * 6
)


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """One file storage with two studies and their notes: the default study on the twin, 12
    launches, and a study whose every launch fails with one long cause (stopped after 3)."""
    import autotune_plugins.twin as twin

    from tests.conftest import REPO

    tmp = tmp_path_factory.mktemp("browser")
    url = f"sqlite:///{tmp / 'studies.db'}"
    with plugin_registered(twin, "twin"):
        runner = StudyRunner(prepare_study(load_study_config(REPO / "studies" / "v100-qwen27b.toml"), storage=url))
        summary = runner.run(n_trials=12, on_trial=trial_notes(url))  # as the CLI writes them
        annotate_study(runner.study, summary_text(summary), deploy_commands(summary))
    path = write_study(tmp / "broken.toml", "fake-broken", ["w0", "w1"], name=BROKEN, parallel=(1, 2), sampler="grid")
    with registered(BrokenBackend(cause=CAUSE)):
        result = CliRunner().invoke(cli, ["study", str(path), "--storage", url, "--quiet"])
    assert result.exit_code == 2, result.output  # the systematic failure stopped it
    return tmp, url


def test_the_report_renders_its_plots_in_chromium(studies):
    tmp, url = studies
    out = write_study_report(load_study(url, TWIN), stored_summary(url, TWIN), tmp / "report.html")
    n, rows, winner = check_report(out, min_plots=3)  # knee, memory, quality; no bandwidth-known GPU run
    assert n >= 3 and rows >= 12
    assert "Winner: trial" in winner and "deploy" in winner


def test_a_failed_studys_report_opens_on_its_cause_and_draws_no_empty_plot(studies):
    tmp, url = studies
    out = write_study_report(load_study(url, BROKEN), stored_summary(url, BROKEN), tmp / "failed.html")
    with chromium() as browser:
        browser.set_window_size(*WINDOW)
        browser.get(out.resolve().as_uri())
        causes = wait_for(browser, lambda: browser.find_elements("id", "causes"), what="the causes card")[0]
        assert causes.location["y"] < browser.find_element("id", "about").location["y"]  # before anything else
        cause = causes.find_element("css selector", "ol li").text  # the most common cause, as shown unclicked
        assert "3 failed: engine exited (code 1) (trials 0, 1, 2)" in cause, cause
        assert "converting the model failed" in cause and "BPE pre-tokenizer was not recognized" in cause, cause
        assert plots_rendered(browser) == 0  # no axes without a point on them
        assert "no trial was measured" in browser.find_element("id", "knee-absent").text
        height = browser.execute_script("return document.getElementById('trials').offsetHeight")
        assert height < 400, f"the table of 3 failed trials is {height} px tall: long reasons are not collapsed"
        assert_fits(browser, "the failed study's report")
        assert not console_errors(browser), console_errors(browser)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_dashboard_speaks_autotune_and_each_page_fits_the_window(studies):
    tmp, url = studies
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "autotune.cli", "dashboard", "--storage", url, "--port", str(port)],
        env=dict(os.environ, AUTOTUNE_LOAD_PLUGINS="twin"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
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
        twin_id, broken_id = (storage_id(url, name) for name in (TWIN, BROKEN))
        measured = next(t for t in load_study(url, TWIN).trials if t.state == optuna.trial.TrialState.COMPLETE)
        base = f"http://127.0.0.1:{port}/dashboard/studies"
        with chromium() as browser:
            browser.set_window_size(*WINDOW)
            body = lambda: browser.find_element("tag name", "body").text  # noqa: E731
            browser.get(f"{base}/{twin_id}")
            wait_for(
                browser,
                lambda: "score (aggregate_tok_s - penalty)" in browser.page_source,
                what="the objective's name on the study page",
            )
            wait_for(browser, lambda: plots_rendered(browser), what="a rendered plot on the study page")
            assert_fits(browser, "the study page")
            browser.get(f"{base}/{twin_id}/note")
            wait_for(browser, lambda: "why the search ended" in body(), what="the study's note")
            assert "deploy:" in body() and "```" not in body()  # Markdown rendered, the command a code block
            assert_fits(browser, "the study's note")  # it was 4,448 px: one unwrapped code block
            browser.get(f"{base}/{twin_id}/trials?numbers={measured.number}")
            wait_for(browser, lambda: "parallel streams of" in body(), what=f"trial {measured.number}'s note")
            assert "aggregate" in body() and "VRAM predicted" in body()
            # Schema 3: each field one attribute, its whole value (no parts: config_key.0 was one).
            assert "config_key" in body() and "deploy_command" in body() and "config_key.0" not in body()
            assert_fits(browser, f"trial {measured.number}'s page")
            browser.get(f"{base}/{broken_id}/note")
            wait_for(browser, lambda: "BPE pre-tokenizer was not recognized" in body(), what="the failed study's note")
            assert_fits(browser, "the failed study's note")
            browser.get(f"{base}/{broken_id}/trials?numbers=0")
            wait_for(browser, lambda: "BPE pre-tokenizer" in body(), what="the failed trial's note")
            assert_fits(browser, "a failed trial's page")
            assert not console_errors(browser), console_errors(browser)
    finally:
        server.terminate()
        server.wait(timeout=10)


def storage_id(url: str, name: str) -> int:
    """The study's id in the storage: the dashboard's address of it."""
    return optuna.storages.RDBStorage(url).get_study_id_from_name(name)
