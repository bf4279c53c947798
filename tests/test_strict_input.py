"""Say exactly what happened: input that would be silently replaced, ignored or misread is
refused before anything runs (exit 2, naming the file, the table, the key and what is
accepted), a failure every trial would repeat stops the study at once, and storages fail with
one line, their passwords masked."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner

from autotune import hookimpl, plugins
from autotune.engine.backend import Param, Setting, StudyContext, TrialConfig
from autotune.cli import cli
from autotune.errors import BackendError, EngineUnavailableError
from tests.fake_backends import FakeBackend, registered, write_study
from autotune.study.records import TrialRecord


class StrictBackend(FakeBackend):
    """Takes flash_attn true/false and cache_type f16/q8_0, declares two settings, and can be
    told that its engine is missing (preflight) or vanishes at launch (run)."""

    name = "fake-strict"
    settings = (
        Setting("startup_timeout_s", float, 60.0, "seconds to wait for the server"),
        Setting("threads", int, 1, "engine threads", check=lambda v: None if v >= 1 else "must be >= 1"),
    )

    def __init__(self, missing: bool = False, vanishes: bool = False):
        super().__init__()
        self.missing, self.vanishes = missing, vanishes

    def parameters(self, space):
        flash = tuple(v for v in space.get("flash_attn", (True,)) if isinstance(v, bool))
        cache = tuple(v for v in space.get("cache_type", ("f16",)) if v in ("f16", "q8_0"))
        return [
            Param("flash_attn", flash, accepted=(True, False)),
            Param("cache_type", cache, accepted=("f16", "q8_0")),
        ]

    def preflight(self, ctx: StudyContext) -> list[str]:
        return ["fake-server not found in /nowhere: run 'autotune engine build fake'"] if self.missing else []

    def run(self, config: TrialConfig, ctx: StudyContext):
        self._log(config)
        if self.vanishes:
            raise EngineUnavailableError("fake-server vanished: run 'autotune engine build fake'")
        return self.measure(config)


class OtherCacheBackend(StrictBackend):
    """A second engine that knows only its own cache type name."""

    name = "fake-other"

    def parameters(self, space):
        return [
            Param("cache_type", tuple(v for v in space.get("cache_type", ("fp16",)) if v == "fp16"), accepted=("fp16",))
        ]


def study(tmp_path: Path, backend: str = "fake-strict", extra_space: str = "", extra: str = "") -> Path:
    path = write_study(tmp_path / "s.toml", backend, ["w"], parallel=(1, 2), extra_space=extra_space)
    if extra:
        path.write_text(path.read_text() + extra)
    return path


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), obj={}, env=env, catch_exceptions=False)


def test_a_space_value_no_backend_accepts_is_exit_2_naming_what_is_accepted(tmp_path):
    path = study(tmp_path, extra_space='flash_attn = ["no"]\ncache_type = ["q9_0", "f16"]')
    with registered(StrictBackend()) as (backend,):
        result = run("study", str(path), "--storage", f"sqlite:///{tmp_path / 's.db'}")
    assert result.exit_code == 2
    assert (
        f"{path}: [space] flash_attn = 'no': no backend of this study accepts it (fake-strict accepts true, false)"
        in result.output
    )
    assert (
        f"{path}: [space] cache_type = 'q9_0': no backend of this study accepts it (fake-strict accepts 'f16', 'q8_0')"
        in result.output
    )
    assert backend.calls == [] and not (tmp_path / "s.db").exists()


def test_a_value_only_some_backends_take_is_dropped_for_the_others_with_a_line(tmp_path):
    from autotune.config import load_study_config
    from autotune.study import prepare_study

    path = study(tmp_path, extra_space='cache_type = ["q8_0", "fp16"]')
    path.write_text(
        path.read_text().replace(
            'weights = ["w"]', 'weights = ["w"]\n\n[[candidates]]\nbackend = "fake-other"\nweights = ["w"]'
        )
    )
    with registered(StrictBackend(), OtherCacheBackend()):
        prepared = prepare_study(load_study_config(path))
    assert (
        "fake-other: [space] cache_type = 'q8_0' not searched (another backend's values; fake-other accepts 'fp16')"
        in prepared.excluded
    )
    assert (
        "fake-strict: [space] cache_type = 'fp16' not searched (another backend's values; fake-strict accepts "
        "'f16', 'q8_0')" in prepared.excluded
    )
    caches = {
        e.backend.name: dict((p.name, p.choices) for p in e.params)["cache_type"]
        for e in prepared.space.entries.values()
    }
    assert caches == {"fake-strict": ("q8_0",), "fake-other": ("fp16",)}


def test_an_engine_name_where_a_backend_belongs_names_the_engines_backends(tmp_path):
    path = study(tmp_path, backend="fake-engine")  # StrictBackend.engine
    with registered(StrictBackend()):
        result = run("study", str(path))
    assert result.exit_code == 2
    assert (
        "backend = 'fake-engine': not installed (installed: fake-strict); fake-engine is an engine: name one of "
        "its backends (fake-strict)" in result.output
    )


def test_a_misspelt_space_key_is_named_as_the_typo(tmp_path):
    path = study(tmp_path)
    path.write_text(path.read_text().replace("ctx = [", "ctxx = ["))
    with registered(StrictBackend()):
        result = run("study", str(path))
    assert result.exit_code == 2
    assert (
        "[space] ctx = (missing): required: a list of integers >= 256 ([space] ctxx is not a known key: "
        "did you mean ctx?)" in result.output
    )


@pytest.mark.parametrize(
    "line, expected",
    [
        (
            "startup_timeot_s = 30",
            "[backends.fake-strict] startup_timeot_s: unknown setting (accepted: startup_timeout_s, threads)",
        ),
        (
            'startup_timeout_s = "soon"',
            "[backends.fake-strict] startup_timeout_s = 'soon': must be a number (seconds to wait",
        ),
        ("threads = 0", "[backends.fake-strict] threads = 0: must be >= 1"),
    ],
)
def test_backend_settings_are_checked_before_anything_runs(tmp_path, line, expected):
    path = study(tmp_path, extra=f"\n[backends.fake-strict]\n{line}\n")
    with registered(StrictBackend()) as (backend,):
        result = run("study", str(path), "--storage", f"sqlite:///{tmp_path / 's.db'}")
    assert result.exit_code == 2, result.output
    assert f"Error: {path}: {expected}" in result.output
    assert backend.calls == []


def test_a_missing_engine_stops_the_study_before_it_starts(tmp_path):
    path = study(tmp_path)
    with registered(StrictBackend(missing=True)) as (backend,):
        result = run("study", str(path), "--storage", f"sqlite:///{tmp_path / 's.db'}")
    assert result.exit_code == 2
    assert (
        "[candidates.0] backend = 'fake-strict': fake-server not found in /nowhere: run 'autotune engine build fake'"
        in result.output
    )
    assert backend.calls == []


def test_an_engine_that_vanishes_stops_the_study_at_the_first_trial(tmp_path):
    path = study(tmp_path)
    storage = f"sqlite:///{tmp_path / 's.db'}"
    with registered(StrictBackend(vanishes=True)) as (backend,):
        result = run("study", str(path), "--storage", storage, "--trials", "5")
    assert result.exit_code == 2
    assert "Error: fake-server vanished: run 'autotune engine build fake'" in result.output
    assert len(backend.calls) == 1  # not the whole budget
    trials = optuna.load_study(study_name="fake-study", storage=storage).trials
    failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(failed) == 1 and failed[0].user_attrs["retry"] is True  # measured again once the engine is back


# ------------------------------------------------------------------------------ storages


def test_an_unwritable_storage_is_one_error_line(tmp_path):
    path = study(tmp_path)
    with registered(StrictBackend()):
        result = run("study", str(path), "--storage", f"sqlite:///{tmp_path / 'no-such-dir' / 's.db'}")
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: storage sqlite:///{tmp_path / 'no-such-dir' / 's.db'}: the directory {tmp_path / 'no-such-dir'} does not exist"
    ]


def test_a_file_that_is_not_a_database_is_one_error_line(tmp_path):
    path = study(tmp_path)
    junk = tmp_path / "junk.db"
    junk.write_text("these are my notes, not a database\n")
    with registered(StrictBackend()):
        result = run("study", str(path), "--storage", f"sqlite:///{junk}")
    assert result.exit_code == 2
    assert result.output.strip() == f"Error: storage sqlite:///{junk}: {junk} is not a SQLite database"
    assert junk.read_text() == "these are my notes, not a database\n"


def test_a_database_of_someone_else_is_refused_not_misread(tmp_path):
    db = tmp_path / "other.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER)")
    result = run("best", "--storage", f"sqlite:///{db}")
    assert result.exit_code == 2 and result.output.startswith("Error: storage sqlite:///")
    assert len(result.output.strip().splitlines()) == 1


def test_reading_commands_never_create_a_database(tmp_path):
    missing = tmp_path / "typo.db"
    for args in (["best", "--storage", f"sqlite:///{missing}"], ["dashboard", "--storage", f"sqlite:///{missing}"]):
        result = run(*args)
        assert result.exit_code == 2
        assert "does not exist" in result.output
    assert not missing.exists()


def test_a_password_is_masked_and_an_unreachable_server_is_one_line(tmp_path):
    pytest.importorskip("psycopg")
    path = study(tmp_path)
    url = "postgresql://alice:s3cret@127.0.0.1:1/autotune"  # nothing listens on port 1
    with registered(StrictBackend()):
        result = run("study", str(path), "--storage", url)
    assert result.exit_code == 2
    assert "s3cret" not in result.output
    assert result.output.startswith(
        "Error: storage postgresql://alice:***@127.0.0.1:1/autotune: cannot open the database"
    )
    assert len(result.output.strip().splitlines()) == 1


def test_the_storage_can_come_from_the_environment_and_is_shown_masked(tmp_path, monkeypatch):
    from autotune.study.storage import mask_url, resolve_url

    assert mask_url("postgresql://bob:pw@db.example/x") == "postgresql://bob:***@db.example/x"
    assert mask_url("sqlite:///a.db") == "sqlite:///a.db"
    monkeypatch.setenv("AUTOTUNE_STORAGE", "sqlite:///from-env.db")
    assert resolve_url(None, "sqlite:///from-file.db", "sqlite:///default.db") == "sqlite:///from-env.db"
    assert resolve_url("sqlite:///flag.db", "sqlite:///from-file.db", "sqlite:///default.db") == "sqlite:///flag.db"
    monkeypatch.delenv("AUTOTUNE_STORAGE")
    assert resolve_url(None, None, "sqlite:///default.db") == "sqlite:///default.db"

    path = study(tmp_path)
    storage = f"sqlite:///{tmp_path / 'env.db'}"
    with registered(StrictBackend()):
        result = run("study", str(path), "--trials", "2", "--json", env={"AUTOTUNE_STORAGE": storage})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["storage"] == storage and (tmp_path / "env.db").exists()


def test_sqlite_pragmas_touch_only_our_own_databases(tmp_path):
    from autotune.study.storage import open_storage

    open_storage(f"sqlite:///{tmp_path / 'ours.db'}")
    theirs = tmp_path / "theirs.db"
    import sqlalchemy

    engine = sqlalchemy.create_engine(f"sqlite:///{theirs}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "delete"
    with sqlite3.connect(tmp_path / "ours.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# ------------------------------------------------------------------------------ plugins


class BrokenPlugin:
    @hookimpl
    def register_backends(self, register):
        import autotune_missing_optional_dependency  # noqa: F401  (what a plugin without its extra does)


def test_a_plugin_whose_hook_raises_is_reported_and_the_others_keep_working(capsys):
    plugins.register_plugin(BrokenPlugin(), name="broken-one")
    try:
        with registered(StrictBackend()):
            result = run("plugins", "--json")
            assert result.exit_code == 0
            found = json.loads(result.stdout)
            assert [b["name"] for b in found["backends"]] == ["fake-strict"]
            assert found["broken"] == [
                {
                    "plugin": "broken-one",
                    "hook": "register_backends",
                    "error": "ModuleNotFoundError: No module named 'autotune_missing_optional_dependency'",
                }
            ]
            text = run("plugins")
            assert "fake-strict" in text.output and "broken-one" in text.output
            assert plugins.get_backend("fake-strict").name == "fake-strict"
    finally:
        plugins.unregister_plugin("broken-one")


# ------------------------------------------------------------------------------ llama-server, as a user meets it


@pytest.mark.parametrize(
    "space, extra, expected",
    [
        (
            'flash_attn = ["no"]',
            "",
            "[space] flash_attn = 'no': no backend of this study accepts it (llama-server accepts true, false)",
        ),
        (
            'cache_type = ["q9_0"]',
            "",
            "[space] cache_type = 'q9_0': no backend of this study accepts it (llama-server accepts 'f16'",
        ),
        (
            "",
            "[backends.llama-server]\nstartup_timeot_s = 30",
            "[backends.llama-server] startup_timeot_s: unknown setting (accepted: ",
        ),
        (
            "",
            '[backends.llama-server]\nstartup_timeout_s = "soon"',
            "[backends.llama-server] startup_timeout_s = 'soon': must be a number",
        ),
    ],
)
def test_llama_server_input_that_would_be_replaced_or_ignored_is_exit_2(tmp_path, space, extra, expected):
    import autotune_plugins.llama_server as llama_server

    from tests.conftest import plugin_registered
    from tests.engine_fixtures import write_llama_study

    path = write_llama_study(tmp_path / "strict.toml", space=space, extra=extra)
    with plugin_registered(llama_server, "llama_server"):
        result = run("study", str(path), "--storage", f"sqlite:///{tmp_path / 's.db'}")
    assert result.exit_code == 2, result.output
    assert f"Error: {path}: {expected}" in result.output
    assert not (tmp_path / "s.db").exists()  # nothing ran, nothing was stored


def test_a_backend_listed_twice_is_named_even_when_the_gpu_is_unknown(tmp_path):
    path = study(tmp_path)
    text = path.read_text().replace('gpu = "v100-16gb"', 'gpu = "no-such-card"')
    path.write_text(text + '\n[[candidates]]\nbackend = "fake-strict"\nweights = ["w"]\n')
    with registered(StrictBackend()):
        result = run("study", str(path))
    assert result.exit_code == 2
    assert "[candidates.1] backend = 'fake-strict': listed twice; merge its weights into one entry" in result.output
    assert "no-such-card" in result.output


@pytest.mark.parametrize("seed", ["-1", str(2**63 - 1)])
def test_a_seed_numpy_cannot_take_is_exit_2_before_any_storage_is_made(tmp_path, seed):
    path = study(tmp_path)
    with registered(StrictBackend()):
        result = run("study", str(path), "--seed", seed, "--storage", f"sqlite:///{tmp_path / 's.db'}")
    assert result.exit_code == 2
    assert f"Invalid value for '--seed': {seed} is not in the range 0<=x<=4294967295" in result.output
    assert not (tmp_path / "s.db").exists()


class FailingBackend(StrictBackend):
    """Runs out of memory on weights ``oom``; on ``garbage`` its engine exits writing colours,
    a terminal title, a screen clear and raw bytes."""

    name = "fake-failing"

    def run(self, config: TrialConfig, ctx: StudyContext):
        self._log(config)
        if config.weights == "oom":
            raise BackendError("fake-server exited with code 1: failed to start: CUDA error: out of memory")
        if config.weights == "garbage":
            raise BackendError(
                "fake-server exited with code 3: \x1b[31mboom\x1b[0m\x1b]0;owned\x07\x1b[2J\x00\xff",
                log_tail="loading\r50%\r\x1b[1mdone\x1b[0m\x07\n",
            )
        return self.measure(config)


def test_the_summary_says_why_trials_failed_and_engine_text_reaches_no_terminal_raw(tmp_path):
    path = write_study(tmp_path / "s.toml", "fake-failing", ["w", "oom", "garbage"], parallel=(1, 2), sampler="grid")
    storage = f"sqlite:///{tmp_path / 's.db'}"
    with registered(FailingBackend()):
        result = run("study", str(path), "--storage", storage, "--quiet")
    assert result.exit_code == 0, result.output
    assert "4 trials failed: 2 engine exited (code 3), 2 out of memory" in result.output.splitlines()
    assert "\x1b" not in result.output and "\x00" not in result.output and "\x07" not in result.output
    study = optuna.load_study(study_name="fake-study", storage=storage)
    failed = [t for t in study.trials if TrialRecord.of(t).config["weights"] == "garbage"]
    assert [t.user_attrs["fail_reason"] for t in failed] == ["fake-server exited with code 3: boom\\x00\xff"] * 2
    assert failed[0].user_attrs["log_tail"] == "loading\n50%\ndone\\x07\n"


def test_a_study_without_failures_has_no_failures_line(tmp_path):
    path = write_study(tmp_path / "s.toml", "fake-failing", ["w"], parallel=(1, 2), sampler="grid")
    with registered(FailingBackend()):
        result = run("study", str(path), "--storage", f"sqlite:///{tmp_path / 's.db'}", "--quiet")
    assert result.exit_code == 0 and "0 failed" in result.output and "failed:" not in result.output


def test_an_unquoted_dotted_backend_table_is_told_to_quote_its_name(tmp_path):
    path = study(tmp_path, backend="fake.strict", extra="\n[backends.fake.strict]\nthreads = 2\n")
    backend = StrictBackend()
    backend.name = "fake.strict"
    with registered(backend):
        result = run("study", str(path), "--storage", f"sqlite:///{tmp_path / 's.db'}")
    assert result.exit_code == 2
    assert (
        f"{path}: [backends.fake]: no such backend (installed: fake.strict); a dot in a table name nests "
        'tables: write [backends."fake.strict"]'
    ) in result.output


def test_a_missing_database_driver_names_the_module_to_install(tmp_path):
    import importlib.util

    if importlib.util.find_spec("pymysql") is not None:
        pytest.skip("pymysql is installed: its absence is what is tested")
    result = run("best", "--storage", "mysql+pymysql://u@localhost/db")
    assert result.exit_code == 2
    assert "a driver for it" not in result.output
    assert "the database driver is missing" in result.output and "(pip install pymysql)" in result.output


def test_a_report_into_a_missing_directory_is_refused_before_the_study_runs(tmp_path):
    path = study(tmp_path)
    with registered(StrictBackend()) as (backend,):
        result = run(
            "study",
            str(path),
            "--storage",
            f"sqlite:///{tmp_path / 's.db'}",
            "--report",
            str(tmp_path / "no-dir" / "r.html"),
        )
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"Error: --report {tmp_path / 'no-dir' / 'r.html'}: {tmp_path / 'no-dir'}: no such "
        "directory (the report's directory must exist)"
    )
    assert backend.calls == [] and not (tmp_path / "s.db").exists()


def test_the_dashboard_on_a_busy_port_is_one_line_and_no_listening(tmp_path):
    import socket

    path = study(tmp_path)
    storage = f"sqlite:///{tmp_path / 's.db'}"
    with registered(StrictBackend()):
        assert run("study", str(path), "--storage", storage, "--trials", "1", "--quiet").exit_code == 0
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run("dashboard", "--storage", storage, "--port", str(port))
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        f"Error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use); give another --port"
    )
    assert "Listening" not in result.output and "optuna-dashboard for" not in result.output
