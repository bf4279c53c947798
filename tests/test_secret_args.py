"""Secrets in an engine's arguments are masked wherever an argv is stored or shown, and a server
that wants an API key gets it from a named environment variable (issue 41, item 2)."""

from __future__ import annotations

import json

import pytest

from autotune.engine.deploy import deploy_line
from autotune.toolkit.redact import MASK, mask_argv

KEY = "sk-proj-" + "A1b2C3d4" * 4
HF = "hf_" + "Zz9" * 10


@pytest.mark.parametrize(
    "argv, masked",
    [
        (["--api-key", KEY], ["--api-key", MASK]),
        ([f"--api-key={KEY}"], [f"--api-key={MASK}"]),
        (["--hf-token", HF], ["--hf-token", MASK]),
        (["--token", "plain-secret-value"], ["--token", MASK]),
        (["--password", "hunter22"], ["--password", MASK]),
        (["-H", f"Authorization: Bearer {KEY}"], ["-H", f"Authorization: {MASK}"]),
        (["--header", "x-api-key: abcdef"], ["--header", f"x-api-key: {MASK}"]),
        (["--anything", KEY], ["--anything", MASK]),  # a token by its shape, whatever flag carries it
        ([f"--env=HF_TOKEN={HF}"], [f"--env=HF_TOKEN={MASK}"]),
        # Not secrets: numbers, paths to a key, names of variables, ordinary flags.
        (
            ["--max-tokens", "512", "--api-key-file", "/k.txt", "--ssl-keyfile", "k.pem", "-ctk", "q8_0"],
            ["--max-tokens", "512", "--api-key-file", "/k.txt", "--ssl-keyfile", "k.pem", "-ctk", "q8_0"],
        ),
        (["--api-key", "--port", "80"], ["--api-key", "--port", "80"]),
    ],
)
def test_mask_argv(argv, masked):
    assert mask_argv(argv) == masked


def test_the_deploy_line_never_holds_the_key():
    line = deploy_line(["vllm", "serve", "m", "--api-key", KEY, "--hf-token", HF], ["note"])
    assert KEY not in line and HF not in line and "--api-key '***'" in line


def test_a_key_in_extra_args_is_stored_and_shown_masked_and_api_key_env_authorizes(tmp_path, monkeypatch):
    """A llama-server started with --api-key answers 401 without it: with api_key_env naming the
    variable, every trial is measured; the key is in neither the stored command nor the deploy line."""
    from tests.engine_fixtures import llama_server_binary
    from tests.plugins.test_openai_server import STORIES, cfg, make_ctx
    from autotune_plugins.openai_server.backend import OpenAIServerBackend
    from autotune.errors import BackendError
    import shutil

    binary = str(llama_server_binary())
    shutil.copy(STORIES, tmp_path / "m.gguf")
    monkeypatch.setenv("MY_SERVER_KEY", KEY)
    b = OpenAIServerBackend()
    config = cfg("m.gguf", 1, cache_type="f16", flash_attn=True)
    plain = dict(executable=binary, extra_args=["-t", "2", "--api-key", KEY], startup_timeout_s=60)
    with pytest.raises(BackendError) as err:  # without the header: the server's 401
        b.run(config, make_ctx(tmp_path, **plain))
    assert "401" in str(err.value) and KEY not in str(err.value) + err.value.log_tail
    ctx = make_ctx(tmp_path, **plain, api_key_env="MY_SERVER_KEY")
    m = b.run(config, ctx)
    assert m.metrics["aggregate_tok_s"].median > 0
    stored = json.dumps(m.attrs)
    assert KEY not in stored and "--api-key" in stored
    assert KEY not in b.deploy_command(config, ctx)
    # The engine reads the named variable itself (llama-server: LLAMA_API_KEY): no key in the file at all.
    monkeypatch.setenv("LLAMA_API_KEY", KEY)
    m = b.run(
        config,
        make_ctx(
            tmp_path, executable=binary, extra_args=["-t", "2"], startup_timeout_s=60, api_key_env="LLAMA_API_KEY"
        ),
    )
    assert m.metrics["aggregate_tok_s"].median > 0


def test_an_unset_api_key_env_is_refused_before_any_server(tmp_path, monkeypatch):
    from tests.plugins.test_openai_server import make_ctx
    from autotune_plugins.openai_server.backend import OpenAIServerBackend

    monkeypatch.delenv("NOT_SET_KEY", raising=False)
    problems = OpenAIServerBackend().preflight(make_ctx(tmp_path, executable="/bin/true", api_key_env="NOT_SET_KEY"))
    assert any("api_key_env = 'NOT_SET_KEY'" in p and "not set" in p for p in problems)
    (setting,) = [s for s in OpenAIServerBackend.settings if s.name == "api_key_env"]
    assert "not the key itself" in setting.problem(KEY) and setting.problem("MY_KEY") is None


def test_a_key_from_a_plainly_named_variable_is_scrubbed_from_engine_output(tmp_path, monkeypatch):
    from autotune.errors import BackendError
    from autotune_plugins.openai_server.backend import OpenAIServerBackend
    from tests.plugins.test_openai_server import make_ctx

    value = "plain-looking-" + "k3y" * 6
    monkeypatch.setenv("SERVE_WITH", value)  # no secret word in the name: secret_values alone misses it
    assert OpenAIServerBackend().api_key(make_ctx(tmp_path, api_key_env="SERVE_WITH")) == value
    err = BackendError(f"server exited: started with --api-key {value}", log_tail=f"key={value}")
    assert value not in str(err) and value not in err.log_tail


def test_a_deploy_note_holds_no_c1_control_or_bidi_override():
    line = deploy_line(["srv"], ["docs \x9b31m red \u202e evil"])
    assert "\x9b" not in line and "\u202e" not in line
