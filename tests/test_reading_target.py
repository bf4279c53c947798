"""`best`, `report` and `dashboard` read the study you ran, and never create a database."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from autotune.cli import cli
from tests.conftest import REPO, plugin_registered


@pytest.fixture
def ran_here(tmp_path, monkeypatch):
    """A twin study run from a study file of its own in an empty directory, storage by default."""
    import autotune_plugins.twin as twin

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOTUNE_STORAGE", raising=False)
    text = (REPO / "studies" / "v100-qwen27b.toml").read_text().replace('name = "v100-qwen27b"', 'name = "mine"')
    (tmp_path / "my.toml").write_text(text)
    with plugin_registered(twin, "twin"):
        result = CliRunner().invoke(cli, ["study", "my.toml", "--trials", "3", "--quiet"], obj={})
        assert result.exit_code == 0, result.output
        assert "autotune report" in result.output  # where the report can be written
        yield tmp_path


def test_best_and_report_follow_the_study_just_run(ran_here):
    before = sorted(p.name for p in ran_here.iterdir())
    assert "mine.db" in before and "v100-qwen27b.db" not in before
    best = CliRunner().invoke(cli, ["best"], obj={})
    assert best.exit_code == 0, best.output
    assert best.output.startswith("study mine (")
    report = CliRunner().invoke(cli, ["report", "--out", "r.html"], obj={})
    assert report.exit_code == 0, report.output
    assert (ran_here / "r.html").read_text().count("autotune report: mine") == 2  # title and heading
    assert sorted(p.name for p in ran_here.iterdir()) == sorted(before + ["r.html"])


def test_a_study_file_argument_names_the_storage(ran_here, monkeypatch):
    sub = ran_here / "sub"
    sub.mkdir()
    shutil.copy(ran_here / "my.toml", sub / "my.toml")
    monkeypatch.chdir(sub)
    # The file's default storage is relative to where the command runs: not there, and not created.
    result = CliRunner().invoke(cli, ["best", "my.toml"], obj={})
    assert result.exit_code == 2 and "mine.db does not exist" in result.output
    assert sorted(p.name for p in sub.iterdir()) == ["my.toml"]


def test_reading_commands_never_create_a_database(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    for argv in (["best"], ["report"], ["dashboard", "--storage", "sqlite:///typo.db", "--port", "1"]):
        result = CliRunner().invoke(cli, argv, obj={})
        assert result.exit_code == 2, (argv, result.output)
        assert "does not exist" in result.output
    assert list(tmp_path.iterdir()) == []
