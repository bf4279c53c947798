"""What a trial stores (schema 3): one user attribute per ``TrialRecord`` field holding its whole
value, and a few flat columns; schema-2 storages (long values in 72-column parts) are read as
they were and upgraded by ``autotune storage upgrade``."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import optuna
import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.errors import StorageError
from autotune.study import optuna_internals, records, schema2_cells
from autotune.study.records import TrialRecord, TrialState
from autotune.study.trial_result import TrialResult, commit

REPO = Path(__file__).resolve().parent.parent
GRID = REPO / "bench/results/offload_grids_h200/h200_grid_offload_dense-run1.db"  # committed, schema 2, in parts

LOG = "".join(f"load_tensors: layer {i:2d} assigned to device CUDA0, is_swa = 0\n" * 3 for i in range(30))
METRICS = {
    "aggregate_tok_s": {"median": 412.5, "values": [410.0 + i / 7 for i in range(40)], "spread": 0.01},
    "per_user_tok_s": {"median": 103.1, "values": [103.1], "spread": 0.0},
}
CONFIG = {"backend": "llama-server", "weights": "/models/" + "w" * 200, "ctx": 4096}


def _committed(study: optuna.Study, **fields) -> optuna.Trial:
    trial = study.ask()
    commit(study, trial, TrialResult().learn(**fields))
    return trial


def test_each_field_is_one_attribute_holding_its_whole_value(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(storage=url)
    _committed(
        study,
        metrics=METRICS,
        log_tail=LOG,
        config=CONFIG,
        worker="host:1",
        measured_vram_bytes=3 * 2**30,
        predicted_vram={"total_bytes": 2**31, "notes": ["n" * 300]},
        prune_reason="does not fit",
    )
    with sqlite3.connect(f"{tmp_path}/s.db") as conn:
        rows = dict(conn.execute("SELECT key, value_json FROM trial_user_attributes").fetchall())
    # a notebook reads a field with json.loads, whatever its length
    assert json.loads(rows["metrics"]) == METRICS and json.loads(rows["log_tail"]) == LOG
    assert json.loads(rows["config"]) == CONFIG
    assert {k: json.loads(rows[k]) for k in records.FLAT if k in rows} == {
        "aggregate_tok_s": 412.5,
        "per_user_tok_s": 103.1,
        "memory_measured_gib": 3.0,
        "memory_predicted_gib": 2.0,
        "reason": "does not fit",
    }
    assert set(rows) <= set(records.STORED) | set(records.FLAT) and len(rows) == 7 + 5
    r = TrialRecord.of(study.trials[0])
    assert (r.metrics, r.log_tail, r.config, r.worker) == (METRICS, LOG, CONFIG, "host:1")
    columns = set(study.trials_dataframe().columns)
    assert {"user_attrs_config", "user_attrs_reason", "user_attrs_aggregate_tok_s"} <= columns
    assert not any("~" in c or "." in c.removeprefix("user_attrs_") for c in columns)


def test_a_result_is_committed_in_steps_and_told_once():
    study = optuna.create_study()
    trial = study.ask()
    r = TrialResult().learn(config={"backend": "b"}, config_key="k")
    commit(study, trial, r)
    assert study.trials[0].user_attrs == {"config": {"backend": "b"}, "config_key": "k"}
    assert study.trials[0].state == TrialState.RUNNING
    with pytest.raises(KeyError, match="'colour' is not a TrialRecord field"):
        r.learn(colour="blue")
    r.learn(score={"values": [5.0], "feasible": False}).completed([5.0], {"vram_over_budget": 1.5})
    commit(study, trial, r)
    commit(study, trial, r)  # nothing new, already told: no second tell
    t = study.trials[0]
    assert t.state == TrialState.COMPLETE and t.values == [5.0]
    assert t.constraints == {"vram_over_budget": 1.5} and t.user_attrs["score_value"] == 5.0
    assert not TrialRecord.of(t).feasible


def test_a_schema_2_value_in_parts_is_read_whole():
    attrs = {
        "config": {"_split": "dict"},
        "config.~0": {"backend": "x", "ctx": 4096},
        "config.weights": "w" * 90,
        "notes": {"_split": "list"},
        "notes.0": "a",
        "notes.1": {"_split": "text"},
        "notes.1.0": "b c ",
        "notes.1.1": "d",
        "notes.2": schema2_cells.STALE,
    }
    assert schema2_cells.joined(attrs, "config") == {"backend": "x", "ctx": 4096, "weights": "w" * 90}
    assert schema2_cells.joined(attrs, "notes") == ["a", "b c d"]
    assert schema2_cells.is_part("config.~0", attrs) and not schema2_cells.is_part("config", attrs)


@pytest.fixture
def schema2_copy(tmp_path):
    path = tmp_path / "grid.db"
    shutil.copy(GRID, path)
    return f"sqlite:///{path}"


def _records(url: str) -> tuple[int, list[tuple]]:
    store = optuna.storages.RDBStorage(url)
    (summary,) = optuna.get_all_study_summaries(store, include_best_trial=False)
    study = optuna.load_study(study_name=summary.study_name, storage=store)
    out = []
    for t in study.get_trials(deepcopy=False):
        r = TrialRecord.of(t)
        out.append(
            (
                r.number,
                r.state,
                r.values,
                dict(r.constraints),
                *[json.dumps(getattr(r, name), sort_keys=True, default=str) for name in records.STORED],
            )
        )
    with sqlite3.connect(url[len("sqlite:///") :]) as conn:
        rows = conn.execute("SELECT count(*) FROM trial_user_attributes").fetchone()[0]
    return rows, out


def test_a_schema_2_storage_is_read_refused_for_writing_and_upgraded_to_the_same_records(schema2_copy):
    rows_before, before = _records(schema2_copy)
    store = optuna.storages.RDBStorage(schema2_copy)
    (summary,) = optuna.get_all_study_summaries(store, include_best_trial=False)
    study = optuna.load_study(study_name=summary.study_name, storage=store)
    assert any(schema2_cells.is_split(v) for t in study.get_trials() for v in t.user_attrs.values())
    records.check_schema(study, "grid.db")  # read as it is
    with pytest.raises(StorageError, match="schema version 2.*autotune storage upgrade grid.db"):
        records.check_schema(study, "grid.db", writing=True)
    result = CliRunner().invoke(cli, ["storage", "upgrade", schema2_copy], obj={})
    assert result.exit_code == 0, result.output
    assert "schema 2 -> 3" in result.output
    rows_after, after = _records(schema2_copy)
    assert after == before and rows_after < rows_before / 4
    study = optuna.load_study(study_name=summary.study_name, storage=schema2_copy)
    records.check_schema(study, "grid.db", writing=True)
    assert not any(schema2_cells.is_split(v) for t in study.get_trials() for v in t.user_attrs.values())
    again = CliRunner().invoke(cli, ["storage", "upgrade", schema2_copy], obj={})
    assert "schema 3, left as it is" in again.output


def test_a_checkpoint_in_one_transaction_stores_what_optunas_own_calls_store(tmp_path, monkeypatch):
    def stored(url: str) -> tuple:
        study = optuna.create_study(storage=url)
        trial = study.ask()
        r = TrialResult().learn(config=CONFIG, worker="w")
        commit(study, trial, r)
        commit(
            study, trial, r.learn(metrics=METRICS, measured_vram_bytes=2**30).completed([1.5], {"vram": -1.0, "q": 2})
        )
        t = study.trials[0]
        return t.user_attrs, t.system_attrs, t.constraints, t.values, t.state

    batched = stored(f"sqlite:///{tmp_path}/batched.db")
    monkeypatch.setattr(optuna_internals, "write_trial", lambda *args: False)
    assert stored(f"sqlite:///{tmp_path}/optunas.db") == batched
