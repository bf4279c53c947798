"""Secrets (issue 26, class 2): a storage password in any URL form is masked wherever the URL is
shown or stored, a URL the driver would misread is a clean exit 2, engines get an allow-listed
environment, and what they print is scrubbed of known secrets before it is relayed or stored."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.errors import AutotuneError, BackendError, StorageError
from autotune.toolkit.redact import engine_environment, is_secret_name, mask_url, scrub, secret_values
from autotune.study.storage import _last_run_file, open_storage, remember_run


@pytest.mark.parametrize(
    "url, shown",
    [
        ("postgresql://bob:pw@db.example/x", "postgresql://bob:***@db.example/x"),
        # libpq takes the password as a query parameter too; sslpassword, passwd, tokens alike
        ("postgresql://bob@db.example/x?password=s3cret", "postgresql://bob@db.example/x?password=***"),
        (
            "postgresql:///x?host=/run/pg&user=bob&password=s3cret&sslmode=require",
            "postgresql:///x?host=/run/pg&user=bob&password=***&sslmode=require",
        ),
        ("mysql+pymysql://u@h/d?passwd=s3cret&charset=utf8", "mysql+pymysql://u@h/d?passwd=***&charset=utf8"),
        ("postgresql://h/d?sslpassword=s3cret&api_token=t0ken", "postgresql://h/d?sslpassword=***&api_token=***"),
        # an unencoded '@' (or '/', '?') in the password: the userinfo ends at the last '@' before the host
        ("postgresql://bob:p@ss@db.example:5432/x", "postgresql://bob:***@db.example:5432/x"),
        (
            "postgresql+psycopg://bob:a/b@c@db.example/x?application_name=me@home",
            "postgresql+psycopg://bob:***@db.example/x?application_name=me@home",
        ),
        ("postgresql://bob:p?ss@db.example/x", "postgresql://bob:***@db.example/x"),
        # nothing secret: unchanged, character for character
        ("sqlite:///dir/a@b:c.db", "sqlite:///dir/a@b:c.db"),
        ("postgresql://bob@db.example/x?sslmode=require", "postgresql://bob@db.example/x?sslmode=require"),
        ("journal:study.log", "journal:study.log"),
    ],
)
def test_every_url_form_is_masked(url, shown):
    assert mask_url(url) == shown
    assert "s3cret" not in mask_url(url) and "p@ss" not in mask_url(url)


def test_a_query_password_is_not_written_to_the_last_study_file(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    remember_run("postgresql://bob@db.example/x?password=s3cret", "s", tmp_path)
    data = json.loads(_last_run_file(tmp_path).read_text())
    assert data["storage"] is None and data["study"] == "s"  # given again by $AUTOTUNE_STORAGE or --storage
    remember_run("postgresql://bob@db.example/x", "s", tmp_path)
    assert json.loads(_last_run_file(tmp_path).read_text())["storage"] == "postgresql://bob@db.example/x"


@pytest.mark.parametrize(
    "url, why",
    [
        ("postgresql://bob:pa:ss9@db.example:54x2/x", "the port after the host must be a number"),
        ("postgresql://bob:pa@ss9:wq7z@db.example/x", "the password holds an unencoded '@'"),
        ("postgresql://bob:pa@ss9@db.example/x", "the password holds an unencoded '@'"),
    ],
)
def test_a_url_the_driver_would_misread_is_one_clean_line_without_the_password(url, why):
    with pytest.raises(StorageError) as err:
        open_storage(url)
    message = str(err.value)
    assert why in message and "ss9" not in message and "wq7z" not in message
    assert message.startswith("storage postgresql://bob:***@db.example")
    result = CliRunner().invoke(cli, ["best", "--storage", url])
    assert result.exit_code == 2 and "ss9" not in result.output and result.exception.__class__ is SystemExit


def test_a_query_password_is_masked_in_the_cli_error(tmp_path):
    pytest.importorskip("psycopg")
    url = "postgresql://alice@127.0.0.1:1/autotune?password=s3cretpw"  # nothing listens on port 1
    result = CliRunner().invoke(cli, ["best", "--storage", url])
    assert result.exit_code == 2
    assert "s3cretpw" not in result.output
    assert result.output.startswith("Error: storage postgresql://alice@127.0.0.1:1/autotune?password=***")


def test_secret_names():
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "PGPASSWORD",
        "OPENAI_API_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "GITHUB_ACCESSTOKEN",
        "password",
        "sslpassword",
    ):
        assert is_secret_name(name), name
    for name in ("PATH", "PWD", "TOKENIZERS_PARALLELISM", "CUDA_VISIBLE_DEVICES", "AUTOTUNE_STORAGE", "HF_HOME"):
        assert not is_secret_name(name), name


def test_an_engine_gets_the_allow_list_and_what_its_backend_declares():
    ours = {
        "PATH": "/bin",
        "HOME": "/h",
        "LC_ALL": "C",
        "CUDA_HOME": "/cuda",
        "HF_TOKEN": "hf_secret1",
        "HF_HOME": "/hf",
        "AUTOTUNE_STORAGE": "postgresql://bob:pw1234@h/x",
        "PGPASSWORD": "pw5678",
        "MY_TOOL_DIR": "/t",
        "LLAMA_ARG_CTX_SIZE": "99",
    }
    env = engine_environment(("HF_*",), environ=ours, CUDA_VISIBLE_DEVICES="1")
    assert env == {
        "PATH": "/bin",
        "HOME": "/h",
        "LC_ALL": "C",
        "CUDA_HOME": "/cuda",
        "HF_HOME": "/hf",
        "CUDA_VISIBLE_DEVICES": "1",
    }  # a pattern never hands on a secret (HF_* is not HF_TOKEN)
    # a variable named exactly, by the backend or the user, passes: the escape hatch for a gated download
    env = engine_environment(("HF_*",), environ={**ours, "AUTOTUNE_ENGINE_ENV": "HF_TOKEN, MY_TOOL_*"})
    assert env["HF_TOKEN"] == "hf_secret1" and env["MY_TOOL_DIR"] == "/t" and "PGPASSWORD" not in env
    # the marks of an autotune run by autotune reach its engines (processes.start adds theirs)
    assert engine_environment(environ={"AUTOTUNE_PROCESS_MARK": "outer"}) == {"AUTOTUNE_PROCESS_MARK": "outer"}
    # a proxy is handed on (a server may download its model); a password in it is scrubbed from output
    proxied = {"HTTPS_PROXY": "http://me:prx4321@proxy:3128"}
    assert engine_environment(environ=proxied) == proxied and "prx4321" in secret_values(proxied)


def test_the_backends_do_not_hand_on_our_secrets(monkeypatch, tmp_path):
    from autotune_plugins.exllamav2.backend import ExLlamaV2Backend
    from autotune_plugins.openai_server.backend import OpenAIServerBackend
    from autotune_plugins.openai_server.server import OpenAIServer

    monkeypatch.setenv("HF_TOKEN", "hf_secret1")
    monkeypatch.setenv("AUTOTUNE_STORAGE", "postgresql://bob:pw1234@h/x")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    env = OpenAIServer.environment("0", OpenAIServerBackend().engine_variables)
    assert "HF_TOKEN" not in env and "AUTOTUNE_STORAGE" not in env
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG" and env["CUDA_VISIBLE_DEVICES"] == "0" and "PATH" in env
    worker = engine_environment(ExLlamaV2Backend.engine_variables)
    assert "HF_TOKEN" not in worker and "AUTOTUNE_STORAGE" not in worker and "PATH" in worker


def test_engine_output_is_scrubbed_of_known_secrets(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret1")
    monkeypatch.setenv("AUTOTUNE_STORAGE", "postgresql://bob:pw1234@h/x?sslpassword=ssl9876")
    assert {"hf_secret1", "pw1234", "ssl9876"} <= secret_values()
    assert not {"true", "8443"} & secret_values({"HF_HUB_DISABLE_TOKEN": "true", "AUTH_PORT": "8443"})  # flags
    printed = "environ: HF_TOKEN=hf_secret1 AUTOTUNE_STORAGE=postgresql://bob:pw1234@h/x?sslpassword=ssl9876\n"
    assert scrub(printed) == "environ: HF_TOKEN=*** AUTOTUNE_STORAGE=postgresql://bob:***@h/x?sslpassword=***\n"
    # every backend's failure goes through BackendError: its message and log tail are what is
    # printed (the progress line) and stored (fail_reason, log_tail)
    err = BackendError("server exited with code 1: token hf_secret1 refused", log_tail=printed)
    assert "hf_secret1" not in str(err) and "hf_secret1" not in err.log_tail and "pw1234" not in err.log_tail


def test_a_failing_engine_that_prints_its_environment_leaks_nothing(tmp_path, monkeypatch):
    """End to end through the openai-server backend: a 'server' that prints the environment it
    was given and exits; the trial's failure (message and log tail) holds no secret."""
    from autotune_plugins.openai_server.backend import OpenAIServerBackend
    from tests.plugins.test_openai_server import STORIES, cfg, make_ctx

    monkeypatch.setenv("HF_TOKEN", "hf_secret1")
    monkeypatch.setenv("AUTOTUNE_ENGINE_ENV", "HF_TOKEN")  # handed on on purpose: the scrubber still hides it
    monkeypatch.setenv("AUTOTUNE_STORAGE", "postgresql://bob:pw1234@h/x")
    script = (
        "import os, sys; [print(k + '=' + v) for k, v in os.environ.items()]; "
        "print('storage', os.environ.get('AUTOTUNE_STORAGE')); sys.exit(1)"
    )
    ctx = make_ctx(
        tmp_path,
        executable=sys.executable,
        command=["python", "-c", script, "{weights}", "{port}"],
        startup_timeout_s=30,
    )
    shutil.copy(STORIES, tmp_path / "m.gguf")
    with pytest.raises(BackendError) as err:
        OpenAIServerBackend().run(cfg("m.gguf", 1, cache_type="f16", flash_attn=True), ctx)
    text = str(err.value) + err.value.log_tail
    assert "HF_TOKEN=***" in err.value.log_tail  # it ran and printed its environment
    assert "storage None" in err.value.log_tail  # $AUTOTUNE_STORAGE was not handed on
    assert "hf_secret1" not in text and "pw1234" not in text


def test_llama_server_gets_no_secret_and_no_llama_arg(tmp_path, monkeypatch):
    """A 'llama-server' that prints its environment and exits: the failure carries its output,
    which shows what it was given."""
    from autotune_plugins.llama_server.backend import LlamaServerBackend
    from tests.plugins.test_llama_server_backend import cfg, make_ctx
    from tests.plugins.test_openai_server import STORIES

    fake = tmp_path / "llama-server"
    fake.write_text('#!/bin/sh\nenv\necho "storage=[$AUTOTUNE_STORAGE] ctx=[$LLAMA_ARG_CTX_SIZE]"\nexit 1\n')
    fake.chmod(0o755)
    shutil.copy(STORIES, tmp_path / "m.gguf")
    monkeypatch.setenv("HF_TOKEN", "hf_secret1")
    monkeypatch.setenv("AUTOTUNE_STORAGE", "postgresql://bob:pw1234@h/x")
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "99")  # would set a flag the deploy line does not show
    monkeypatch.setenv("GGML_SCHED_MAX_COPIES", "1")  # the backend declares ggml's switches
    with pytest.raises(BackendError) as err:
        LlamaServerBackend().run(cfg("m.gguf"), make_ctx(tmp_path / "m.gguf", binary=str(fake), gpu_layers=0))
    tail = err.value.log_tail
    assert "storage=[] ctx=[]" in tail and "GGML_SCHED_MAX_COPIES=1" in tail and "PATH=" in tail
    assert "HF_TOKEN" not in tail and "hf_secret1" not in tail + str(err.value)


def _env_printer(path, *, version: bool = False):
    """An executable that prints the names of its environment variables (on --version, when
    ``version``), as a failing engine or tool may."""
    head = "print('version: 1 (fake000)')\n" if version else ""
    tail = "" if version else "raise SystemExit(1)\n"
    path.write_text(f"#!{sys.executable}\nimport os\n{head}print(' '.join(sorted(os.environ)))\n{tail}")
    path.chmod(0o755)
    return path


def test_version_probes_and_tools_get_the_allow_list_too(tmp_path, monkeypatch):
    """Not only the measured engine: its --version probe, and the converters and quantizers
    run_tool starts, get the allow-listed environment."""
    from autotune.modelfiles.artifacts import run_tool
    from autotune_plugins.llama_server.builds import engine_version

    monkeypatch.setenv("HF_TOKEN", "hf_secret1")
    monkeypatch.setenv("AUTOTUNE_STORAGE", "postgresql://bob:pw1234@h/x")
    with pytest.raises(AutotuneError) as failed:  # a failing tool's error quotes its last lines
        run_tool([str(_env_printer(tmp_path / "tool"))], "a converter", lambda _: None)
    probed = engine_version(_env_printer(tmp_path / "llama-server", version=True))
    for names in (str(failed.value), probed.raw):
        assert "PATH" in names, names
        assert "HF_TOKEN" not in names and "AUTOTUNE_STORAGE" not in names, names
