"""Inputs are bounded up front (issue 41, item 3): only regular files of a sane size are read as
workload files, every numeric key has a range, and what used to be a traceback is one error
naming the file, the line or field, the value and what is accepted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotune.config import load_study_config
from autotune.errors import ConfigError
from tests.fake_backends import FakeBackend, registered, write_study


def _study(tmp_path: Path, workload: str, objective: str = "") -> Path:
    path = tmp_path / "s.toml"
    text = write_study(path, "fake", ["w"], parallel=(1, 2), sampler="grid").read_text()
    text = text.replace("prompt_tokens = 1500\noutput_tokens = 800\n", workload + "\n")
    if objective:
        text = text.replace("[objective]\n", f"[objective]\n{objective}\n", 1)
    path.write_text(text)
    return path


def _refused(path: Path) -> str:
    with registered(FakeBackend()), pytest.raises(ConfigError) as err:
        load_study_config(path)
    return str(err.value)


def test_a_fifo_as_the_workload_file_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "lengths.jsonl")
    path = _study(tmp_path, 'file = "lengths.jsonl"')
    code = (
        "from autotune.config import load_study_config\nfrom autotune.errors import ConfigError\n"
        f"try:\n    load_study_config({str(path)!r})\nexcept ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "[workload] file = 'lengths.jsonl'" in out.stdout and "named pipe (FIFO)" in out.stdout, out


def test_a_link_to_dev_zero_is_refused_by_what_it_is(tmp_path):
    (tmp_path / "zero.csv").symlink_to("/dev/zero")
    message = _refused(_study(tmp_path, 'file = "zero.csv"'))
    assert "[workload] file = 'zero.csv'" in message and "character device" in message


def test_a_lengths_file_over_the_limit_is_refused_unread(tmp_path, monkeypatch):
    import autotune.engine.workload as wl

    monkeypatch.setattr(wl, "MAX_LENGTHS_BYTES", 1000)
    (tmp_path / "big.jsonl").write_text('{"prompt_tokens": 10, "output_tokens": 10}\n' * 100)
    assert "larger than" in _refused(_study(tmp_path, 'file = "big.jsonl"'))


@pytest.mark.parametrize(
    "content, suffix, said",
    [
        (
            '{"prompt_tokens": 1' + "0" * 400 + ', "output_tokens": 5}\n',
            "jsonl",
            "line 1: prompt_tokens = an integer of about 401 digits: must be an integer from 1 to 10,000,000",
        ),
        ('{"prompt_tokens": 1' + "0" * 5000 + ', "output_tokens": 5}\n', "jsonl", "line 1: not JSON"),
        ("prompt_tokens,output_tokens\n12,²\n", "csv", "line 2: output_tokens = '²': must be an integer"),
        ("prompt_tokens,output_tokens\n-1,5\n", "csv", "line 2: prompt_tokens = '-1'"),
    ],
)
def test_a_bad_length_is_one_error_with_its_line_and_field(tmp_path, content, suffix, said):
    (tmp_path / f"l.{suffix}").write_text(content)
    message = _refused(_study(tmp_path, f'file = "l.{suffix}"'))
    assert said in message and f"[workload] file = 'l.{suffix}'" in message


def test_a_spreadsheets_csv_with_a_bom_and_a_long_text_column_is_read(tmp_path):
    rows = "".join(f'{100 + i},{20 + i},"{"x" * 200_000}"\n' for i in range(3))
    (tmp_path / "l.csv").write_bytes(("\ufeffprompt_tokens,output_tokens,text\n" + rows).encode("utf-8"))
    with registered(FakeBackend()):
        cfg = load_study_config(_study(tmp_path, 'file = "l.csv"\nrequests = 6'))
    assert 100 <= cfg.prompt_tokens <= 102


@pytest.mark.parametrize(
    "workload, objective, said",
    [
        (
            'prompt_tokens = 100\noutput_tokens = 10\narrival = "poisson"\nrate = 1e-300',
            "",
            "[workload] rate = 1e-300: must be 0.01..10000 requests per second",
        ),
        (
            'prompt_tokens = 100\noutput_tokens = 10\narrival = "poisson"\nrate_search = [1e-300, 2.0]',
            "",
            "[workload] rate_search",
        ),
        (
            "prompt_tokens = 100000000000\noutput_tokens = 10",
            "",
            "[workload] prompt_tokens = 100000000000: must be 1..",
        ),
        ("prompt_tokens = 100\noutput_tokens = 10", "ttft_p95_ms = 1e-300", "ttft_p95_ms = 1e-300: must be 0.1.."),
    ],
)
def test_numbers_out_of_range_are_refused_with_the_range(tmp_path, workload, objective, said):
    assert said in _refused(_study(tmp_path, workload, objective))


@pytest.mark.parametrize("key, value", [("gpu_layers", 10**12), ("ubatch", 2**40), ("batch", 2**31), ("n_cpu_moe", -1)])
def test_llama_server_refuses_what_its_own_parser_would(key, value):
    from autotune.study.prepare import check_space_values
    from autotune_plugins.llama_server.backend import LlamaServerBackend

    space = {key: (value,)}
    errors, _ = check_space_values({"llama-server": LlamaServerBackend().parameters(space)}, space, "s.toml")
    (error,) = errors
    assert f"[space] {key} = {value}" in error and "2147483647" in error


def test_best_answers_from_the_storage_when_the_lengths_file_has_moved(tmp_path, monkeypatch):
    from autotune.cli import cli
    from autotune.study import StudyRunner, prepare_study

    (tmp_path / "l.jsonl").write_text('{"prompt_tokens": 100, "output_tokens": 20}\n')
    path = _study(tmp_path, 'file = "l.jsonl"\nrequests = 4')
    storage = f"sqlite:///{tmp_path / 's.db'}"
    text = path.read_text().replace("[study]\n", f'[study]\nstorage = "{storage}"\n', 1)
    path.write_text(text)
    with registered(FakeBackend()):
        StudyRunner(prepare_study(load_study_config(path)), seed=0).run(n_trials=2)
        (tmp_path / "l.jsonl").rename(tmp_path / "moved.jsonl")
        monkeypatch.chdir(tmp_path)
        result = CliRunner().invoke(cli, ["best", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert '"n_complete": 2' in result.output


def test_a_fifo_as_the_study_file_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "s.toml")
    code = "from autotune.cli import main; main()"
    out = subprocess.run(
        [sys.executable, "-c", code, "best", "s.toml"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode == 2 and "s.toml: is a named pipe (FIFO), not a regular file" in out.stderr, out
