"""What autotune writes for people cannot be turned into something else by a name it did not
choose (issue 41, item 1): commands are shell-quoted from an argv and pasted into bash here,
TOML is written by a TOML writer, terminal text is stripped of control sequences, Markdown is
escaped, and a report's default path stays in the working directory."""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.config import load_study_config
from autotune.study import StudyRunner, prepare_study
from tests.conftest import plugin_registered
from tests.fake_backends import FakeBackend, registered, write_study

HOSTILE = [
    "x;touch a;$(touch b).toml",
    "it's `touch c`",
    'q"$(touch d)"',
    "new\nline; touch e",
    "tab\tand\\back",
    "\x1b]52;c;ZXZpbA==\x07osc",
    "-rf",
    "sp ace",
    "ünï €",
    "\u202eevil",
]


def _paste(line: str, cwd: Path) -> list[str]:
    """``line`` pasted into bash in ``cwd``, with ``autotune`` a function that prints its
    arguments, one per NUL: the words the pasted line gives it."""
    script = "autotune() { printf '%s\\0' \"$@\"; }\n" + line + "\n"
    out = subprocess.run(
        ["bash", "--norc", "--noprofile"],
        input=script.encode(),
        cwd=cwd,
        capture_output=True,
        check=True,
        env={"PATH": os.environ["PATH"]},
    )
    return out.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("word", HOSTILE)
def test_a_quoted_word_is_one_word_when_pasted_and_runs_nothing(word, tmp_path):
    from autotune.toolkit.shell import command_line

    line = command_line(["autotune", "study", word])
    assert "\n" not in line and "\x1b" not in line  # one line of printable text
    assert _paste(line, tmp_path) == ["study", word]
    assert list(tmp_path.iterdir()) == []  # no touch ran


def test_init_prints_a_next_line_that_pastes_as_it_says(seven_b, tmp_path, monkeypatch):
    from tests.test_study_writer import Plugin

    monkeypatch.chdir(tmp_path)
    out = "x;touch a;$(touch b).toml"
    with plugin_registered(Plugin, "makers"):
        result = CliRunner().invoke(cli, ["init", str(seven_b), "--gpu", "t4", "--out", out])
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("next: ")]
    first, _, then = line[len("next: ") :].partition("    then: ")
    before = set(os.listdir(tmp_path))
    assert _paste(first, tmp_path) == ["study", out]
    assert _paste(then, tmp_path)[:2] == ["best", "--storage"]
    assert set(os.listdir(tmp_path)) == before  # neither a nor b


def test_a_model_name_cannot_write_toml_into_the_study_file(tmp_path):
    from tests.test_study_writer import HeadRulesPlugin, _tiny
    from autotune.study_writer import draft_study, render

    model = _tiny(tmp_path, 256, 2)
    hostile = model.with_name('m\n[backends.llama-server]\nbinary = "evil"\n\x1b[2J')
    model.rename(hostile)
    with plugin_registered(HeadRulesPlugin, "head-rules"):
        text = render(draft_study(str(hostile), gpu="t4"), tmp_path / "s;$(touch z).toml")
    doc = tomllib.loads(text)
    assert "backends" not in doc  # the name stayed in its comment
    assert "\x1b" not in text
    header = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert any("Run it with: autotune study 's;$(touch z).toml'" in ln for ln in header)


def _stored(tmp_path: Path, weights: str) -> str:
    storage = f"sqlite:///{tmp_path / 's.db'}"
    path = write_study(tmp_path / "s.toml", "fake", [weights], parallel=(1, 2), sampler="grid")
    with registered(FakeBackend()):
        StudyRunner(prepare_study(load_study_config(path), storage=storage), seed=0).run(n_trials=2)
    return storage


ESCAPES = "\x1b]52;c;ZXZpbA==\x07\x1b[2J\x9b31m"


def test_names_reach_the_terminal_without_their_escape_sequences(tmp_path):
    storage = _stored(tmp_path, f"w{ESCAPES}")
    # A study name another client of the shared storage wrote, escapes and "../" included.
    name = f"{ESCAPES}../../../X"
    optuna.copy_study(from_study_name="fake-study", from_storage=storage, to_storage=storage, to_study_name=name)
    with registered(FakeBackend()):
        for args in (["best", "--storage", storage, "--study", name], ["best", "--storage", storage]):
            result = CliRunner().invoke(cli, args)
            assert not any(c in result.output for c in "\x1b\x07\x9b"), result.output
            assert "\\x1b" in result.output or args[-1] == storage  # shown, not sent


def test_report_without_out_writes_in_the_working_directory(tmp_path, monkeypatch):
    storage = _stored(tmp_path, "w")
    name = "../../../X"
    optuna.copy_study(from_study_name="fake-study", from_storage=storage, to_storage=storage, to_study_name=name)
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    with registered(FakeBackend()):
        result = CliRunner().invoke(cli, ["report", "--storage", storage, "--study", name])
    assert result.exit_code == 0, result.output
    written = Path(result.output.strip().splitlines()[-1])
    assert written.resolve().parent == work.resolve()
    assert not (tmp_path / "X.html").exists()


def test_dashboard_notes_show_a_file_name_as_text_not_a_link():
    from autotune.report.dashboard import _block, trial_card
    from autotune.study.records import TrialRecord

    r = TrialRecord.__new__(TrialRecord)
    for k, v in dict(
        config={
            "backend": "fake",
            "weights": "/m/[click me](javascript:alert(1)).gguf",
            "ctx": 4096,
            "parallel": 1,
            "mode": "[x](javascript:y)",
        },
        answered_from=None,
        metrics={},
        values=None,
        constraints={},
        quality_drop_points=None,
        predicted_vram=None,
        measured_vram_bytes=None,
        state=None,
        deploy_command=None,
        gpu=None,
    ).items():
        object.__setattr__(r, k, v)
    card = trial_card(r)
    assert "](javascript:" not in card.replace("\\](javascript:", "")
    assert "[click me]" not in card and "\\[click me\\]" in card
    block = _block("````\nbreak out\n````")
    assert block[1] == block[-2] and len(block[1]) == 5  # a fence longer than any in the text


def test_a_hostile_study_name_for_init_is_refused_before_anything_is_written(seven_b, tmp_path, monkeypatch):
    from tests.test_study_writer import Plugin

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for name in ("x;$(touch b)", "..", "a/../../b"):
        with plugin_registered(Plugin, "makers"):
            result = CliRunner().invoke(cli, ["init", str(seven_b), "--gpu", "t4", "--name", name])
        assert result.exit_code == 2 and f"--name {name!r}: use letters, digits" in result.output, result.output
        assert list(work.iterdir()) == []


def test_clicks_own_errors_show_a_typed_escape_sequence_as_text(tmp_path):
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", "from autotune.cli import main; main()", "best", f"{ESCAPES}x.toml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "AUTOTUNE_LOAD_PLUGINS": ""},
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert not any(c in proc.stderr for c in "\x1b\x07\x9b") and "\\x1b]52;c;" in proc.stderr


def test_a_logged_warning_shows_a_name_as_text(tmp_path):
    import sys

    code = (
        "import logging\nfrom autotune.cli import cli\n"
        "@cli.command('warn-test')\ndef warn_test():\n"
        f"    logging.getLogger('autotune.x').warning('template %s', {ESCAPES!r})\n"
        "from autotune.cli import main\nmain()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "warn-test"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "AUTOTUNE_LOAD_PLUGINS": ""},
    )
    assert proc.returncode == 0 and proc.stderr.startswith("template \\x1b]52;c;"), proc.stderr
    assert not any(c in proc.stderr for c in "\x1b\x07\x9b")
