"""Deploy-line injection (issue 26, class 3): the deploy line is pasted into a shell, so nothing in
a setting, a path or a template may end its comment and start a command; a control character in
a one-line field is refused up front, naming the file and the field."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from autotune.engine.deploy import deploy_line
from autotune.report.dashboard import _wrapped
from autotune.errors import ConfigError
from autotune.study.prepare import check_settings
from tests.plugins.test_openai_server import STORIES, cfg, make_ctx

from autotune_plugins.llama_server.backend import LlamaServerBackend
from autotune_plugins.openai_server.backend import OpenAIServerBackend
from autotune_plugins.openai_server.templates import load_template

INJECTED = "127.0.0.1\ntouch /tmp/pwned"


@pytest.mark.parametrize("backend", [OpenAIServerBackend(), LlamaServerBackend()])
def test_a_control_character_in_a_host_is_refused_naming_the_file_and_the_field(backend):
    (problem,) = check_settings(backend, {"host": INJECTED}, "s.toml")
    assert problem.startswith(f"s.toml: [backends.{backend.name}] host = ")
    assert "control character '\\n'" in problem and "one line of printable text" in problem
    assert check_settings(backend, {"host": "0.0.0.0"}, "s.toml") == []


def _pasted(command: str) -> list[str]:
    """The words bash gives ``command`` (Python's shlex does not read bash's $'...')."""
    out = subprocess.run(
        ["bash", "--norc", "-c", "words() { printf '%s\\0' \"$@\"; }; words " + command],
        capture_output=True,
        check=True,
    )
    return out.stdout.decode().split("\0")[:-1]


def test_a_control_character_in_a_template_field_is_refused(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(
        '[template]\ncommand = ["srv", "-m", "{weights}", "--port", "{port}"]\nmemory = "measured"\n'
        'docs = "https://example.org\\ntouch /tmp/pwned"\n'
    )
    with pytest.raises(ConfigError, match=rf"{path}: \[template\] docs = .*control character '\\n'"):
        load_template(path)


def test_the_deploy_line_is_one_shell_line_whatever_a_path_holds(tmp_path):
    """A template from a directory whose name holds a newline: its path is the note of a
    template without docs, and its weights' path is an argument."""
    where = tmp_path / "x\ntouch pwned #"
    where.mkdir()
    (where / "t.toml").write_text(
        '[template]\ncommand = ["srv", "-m", "{weights}", "--port", "{port}"]\nmemory = "measured"\n'
    )
    shutil.copy(STORIES, where / "m b.gguf")
    line = OpenAIServerBackend().deploy_command(cfg("m b.gguf"), make_ctx(where, template="t.toml"))
    command, _, comment = line.partition("  # ")
    assert "\n" not in comment and comment.startswith("template t (")
    assert "\n" not in command  # one line: the newline is bash's $'\x0a'
    assert _pasted(command)[1:] == ["-m", str(where / "m b.gguf"), "--port", "8000"]  # quoted, not split


def test_deploy_line_quotes_only_what_needs_it():
    assert deploy_line(
        ["llama-server", "-m", "/m/a.gguf", "-c", 4096],
        ["ctx 4096 x 1 slots", "listens on x"],
        {"CUDA_VISIBLE_DEVICES": "0"},
    ) == ("CUDA_VISIBLE_DEVICES=0 llama-server -m /m/a.gguf -c 4096  # ctx 4096 x 1 slots; listens on x")
    assert deploy_line(["srv", "a b", "x\ny"], ["one\nrm -rf ~"]) == "srv 'a b' $'x\\x0ay'  # one rm -rf ~"


def test_the_dashboard_note_keeps_the_quoting():
    line = deploy_line(["srv", "--template=a b", "--n", "1"], ["a; b"], {"CUDA_VISIBLE_DEVICES": "GPU-1 2"})
    lines = _wrapped(line, width=20)
    joined = " ".join(ln.rstrip("\\").strip() for ln in lines if not ln.startswith("#"))
    assert shlex.split(joined) == ["CUDA_VISIBLE_DEVICES=GPU-1 2", "srv", "--template=a b", "--n", "1"]
    assert joined.startswith("CUDA_VISIBLE_DEVICES='GPU-1 2' ")  # an assignment, not a command named so


def test_the_dashboard_note_wraps_a_long_comment():
    # A note of 170 characters in a code block made the trial page 2,043 px wide in a 1,280 px window.
    note = "no paged attention (flash-attn 2 needs sm_80): it serves the 2 users one at a time, " * 2
    lines = _wrapped(deploy_line(["srv", "-m", "x"], [note.strip(), "short"]), width=40)
    assert max(len(ln) for ln in lines) <= 40
    comment = " ".join(ln[2:] for ln in lines if ln.startswith("# ") and ln != "# short")
    assert comment == note.strip()
    assert lines[-1] == "# short"
