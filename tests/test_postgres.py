"""Several workers on one study through PostgreSQL (set AUTOTUNE_TEST_POSTGRES_URL to run).

Example: AUTOTUNE_TEST_POSTGRES_URL=postgresql://autotune@127.0.0.1:5433/autotune; `.ci/run`
starts a throwaway server and sets it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections import Counter

import optuna
import pytest

from autotune.study import open_storage, trial_record
from autotune.study.summary import chosen_best
from autotune.study.records import TrialRecord

if __package__:  # tests/ is a package
    from .fake_backends import BlockingBackend, interleave_two_workers, write_study
else:
    from fake_backends import BlockingBackend, interleave_two_workers, write_study

GIVEN_URL = os.environ.get("AUTOTUNE_TEST_POSTGRES_URL")


URL = GIVEN_URL

pytestmark = pytest.mark.skipif(not GIVEN_URL, reason="set AUTOTUNE_TEST_POSTGRES_URL to a PostgreSQL database to run")

State = optuna.trial.TrialState


def _autotune(*args: str) -> list[str]:
    return [sys.executable, "-c", "from autotune.cli import main; main()", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("AUTOTUNE_LOAD_PLUGINS", None)
    return env


def test_plain_postgresql_url_opens():
    url = GIVEN_URL
    if url.startswith("postgresql+"):
        url = "postgresql://" + url.split("://", 1)[1]
    optuna.get_all_study_summaries(open_storage(url), include_best_trial=False)


@pytest.fixture
def study_copy(tmp_path, default_study_path):
    """The default study under a name no other run of this test has used."""
    name = f"pg-{uuid.uuid4().hex[:12]}"
    text = default_study_path.read_text(encoding="utf-8")
    assert text.count('name = "v100-qwen27b"') == 1
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace('name = "v100-qwen27b"', f'name = "{name}"'), encoding="utf-8")
    return name, path


def test_two_workers_share_one_study(study_copy, tmp_path):
    name, path = study_copy
    # Create the schema first: two workers creating it at once is another matter
    # (test_workers_start_at_once_on_a_fresh_database).
    open_storage(URL)
    procs = [
        subprocess.Popen(
            _autotune("study", str(path), "--storage", URL, "--seed", str(seed), "--trials", "20", "--json", "--quiet"),
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for rc, out, err in results:
        assert rc == 0, err
        report = json.loads(out)
        assert report["study"] == name and report["storage"] == URL
        assert report["n_measured"] == 20 or report["converged"]

    study = optuna.load_study(study_name=name, storage=open_storage(URL))
    trials = study.get_trials()
    numbers = [t.number for t in trials]
    assert not [n for n, c in Counter(numbers).items() if c > 1], "trial numbers duplicated"
    assert sorted(numbers) == list(range(len(trials))), "trial numbers lost"
    assert not study.get_trials(states=(State.RUNNING, State.WAITING))
    complete = [TrialRecord.of(t).config_key for t in study.get_trials(states=(State.COMPLETE,))]
    workers = {t.user_attrs["worker"] for t in trials}
    assert len(workers) == 2, "both workers must have run trials"
    for t in trials:
        if t.user_attrs.get("answered_from") is not None:
            assert t.state == State.PRUNED
    # Every launch is one COMPLETE trial (the twin never fails).
    reports = [json.loads(out) for _, out, _ in results]
    assert len(complete) == sum(r["n_measured"] for r in reports)

    result = subprocess.run(
        _autotune("best", "--storage", URL, "--study", name, "--json"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    best_report = json.loads(result.stdout)
    # The best is the finish's choice where it made one (a tie goes to the smaller footprint:
    # the default study's ExLlamaV2 queue ties parallel 1, 2 and 4), else the best trial; its
    # figures are the finish's medians, its first run kept beside them.
    direct = chosen_best(study)
    assert direct is not None
    expected = json.loads(json.dumps(trial_record(direct), default=str))
    shown = best_report["best"]
    assert shown["number"] == direct.number
    headline = {"metrics", "spreads", "first_run", "runs"}
    assert {k: v for k, v in shown.items() if k not in headline} == {
        k: v for k, v in expected.items() if k not in headline
    }
    assert shown.get("first_run", {"metrics": expected["metrics"]})["metrics"] == expected["metrics"]
    assert best_report["n_trials"] == len(trials)
    assert best_report["n_complete"] == len(complete)

    twice = [key for key, n in Counter(complete).items() if n > 1]
    assert not twice, f"configurations measured by both workers: {twice}"


def test_best_without_study_name_lists_the_studies(study_copy, tmp_path):
    # The shared database holds several studies: naming none is an error that lists them.
    name, _ = study_copy
    for suffix in ("a", "b"):
        optuna.create_study(study_name=f"{name}-{suffix}", storage=open_storage(URL))
    result = subprocess.run(
        _autotune("best", "--storage", URL, "--json"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "several studies" in result.stderr
    assert f"{name}-a" in result.stderr and f"{name}-b" in result.stderr


@pytest.fixture
def fresh_database():
    """A new, empty database on the same server (skipped when the role may not create one)."""
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(URL)
    admin = psycopg.connect(
        host=url.host, port=url.port, user=url.username, password=url.password, dbname=url.database, autocommit=True
    )
    name = f"autotune_fresh_{uuid.uuid4().hex[:12]}"
    try:
        with admin.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
    except psycopg.Error as exc:
        admin.close()
        pytest.skip(f"cannot create a database on {url.host}:{url.port}: {exc}")
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_workers_open_a_fresh_database_at_once(fresh_database):
    # Threads released by a barrier open the storage at the same moment, as workers started
    # together by a job scheduler do; processes race the same way, only less reproducibly.
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker() -> None:
        barrier.wait()
        try:
            open_storage(fresh_database)
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, [f"{type(e).__name__}: {str(e).splitlines()[0]}" for e in errors]
    assert optuna.get_all_study_summaries(open_storage(fresh_database), include_best_trial=False) == []


def test_two_workers_never_measure_one_configuration_twice(tmp_path):
    path = write_study(
        tmp_path / "race.toml", "fake-blocking", ["a", "bb"], parallel=(1, 2, 4), name=f"race-{uuid.uuid4().hex[:12]}"
    )
    backend = BlockingBackend()
    x, study = interleave_two_workers(URL, path, backend)
    assert [c.key for c in backend.calls].count(x.key) == 1, "X was launched twice"
