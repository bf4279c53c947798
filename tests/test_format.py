"""The tree is formatted by ruff format, at the line length pyproject.toml states: a file that
``ruff format`` would change fails here, naming it (run ``ruff format`` over the tree to fix)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.conftest import REPO

FORMATTED = ("autotune", "plugins", "tests", "bench", "examples")


def _ruff() -> str:
    beside = Path(sys.executable).with_name("ruff")  # the [test] extra installs it into this venv
    found = str(beside) if beside.exists() else shutil.which("ruff")
    assert found, "ruff is not installed: pip install -e '.[test]' (pyproject.toml pins it)"
    return found


def test_the_line_length_is_stated():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert config["tool"]["ruff"]["line-length"] == 120


def test_every_file_is_formatted():
    done = subprocess.run([_ruff(), "format", "--check", *FORMATTED], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_unformatted_file_is_caught(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.ruff]\nline-length = 120\n")
    (tmp_path / "bad.py").write_text("x = {  'a':1 }\n")
    done = subprocess.run([_ruff(), "format", "--check", "."], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 1 and "bad.py" in done.stdout
