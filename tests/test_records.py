"""What a trial stores: long values in parts one line each (optuna-dashboard shows every user
attribute on one unwrapped line), read back whole by ``TrialRecord.of``."""

from __future__ import annotations

import json
import os
import unicodedata
import uuid

import optuna
import pytest

from autotune.study import records, trial_writes
from autotune.study.records import CELL_CHARS, TrialRecord


def test_long_values_are_stored_in_short_lines_and_read_back_whole():
    study = optuna.create_study()
    trial = study.ask()
    log = "".join(f"load_tensors: layer {i:2d} assigned to device CUDA0, is_swa = 0\n" * 3 for i in range(30))
    metrics = {"aggregate_tok_s": {"median": 412.5, "values": [410.0 + i / 7 for i in range(40)], "spread": 0.01},
               "ttft_ms": {"median": 80.0, "values": [80.0], "spread": 0.0}}
    artifacts = [{"format": "gguf:Q4_K_M", "path": "/cache/" + "a" * 150, "sha256": "f" * 64}]
    config = {"backend": "llama-server", "weights": "/models/" + "w" * 200, "ctx": 4096}
    records.write(trial, metrics=metrics, log_tail=log, artifacts=artifacts, config=config, worker="host:1")
    stored = study.trials[0].user_attrs
    assert max(len(k) + len(json.dumps(v)) for k, v in stored.items()) <= CELL_CHARS + 2
    assert stored["config"] == {"_split": "dict"}  # the configuration too: its weights are a path
    assert stored["metrics"] == {"_split": "dict"} and "metrics.aggregate_tok_s.values.00" in stored
    r = TrialRecord.of(study.trials[0])
    assert (r.metrics, r.log_tail, list(r.artifacts), r.config, r.worker) == (metrics, log, artifacts, config, "host:1")


TRICKY = [
    "x" * 300,                                                        # no separator at all
    "python -m " + "a" * 150 + " --flag " + "/very/long/path/" * 12,  # words longer than a line
    "model " + "qwen2.5-27b-article-exl2-3.5bpw " * 8,                 # words that fit: kept whole
    "  leading and trailing spaces, doubled  spaces,,commas;;  ",
    "line one\nline two\n\n" * 8,
    "漢字のモデル名はとても長い" * 12,                                     # wide characters count two columns
    "e\u0301" * 120 + " café naïve résumé " * 4,                       # combining marks stay with their letter
    "emoji 🚀🧪 " * 20,
]


@pytest.mark.parametrize("value", TRICKY, ids=range(len(TRICKY)))
def test_a_long_string_is_cut_only_after_a_separator_and_read_back_exactly(value):
    stored = dict(records.cells("deploy_command", value))
    parts = [v for k, v in stored.items() if k != "deploy_command"]
    assert "".join(parts) == value and records.joined(stored, "deploy_command") == value
    assert all(records.width(k) + records.width(v) <= CELL_CHARS for k, v in stored.items() if isinstance(v, str))
    for piece, following in zip(parts, parts[1:]):
        word = (piece.split()[-1:] or [""])[0] + (following.split()[:1] or [""])[0]
        # A cut inside a word is only for a word (no space, comma or slash in it) wider than a line.
        assert piece[-1] in " ,;\n/" or records.width(word) > CELL_CHARS - 8 - len("deploy_command"), (piece, following)
        assert not unicodedata.combining(following[0])
    assert list(stored) == sorted(stored)  # the dashboard lists attributes by name: .00 to .11, in order


def test_a_configuration_too_long_for_a_line_is_split_and_read_back_whole():
    study = optuna.create_study()
    trial = study.ask()
    config = {"backend": "llama-server", "weights": "/home/user/.cache/autotune/artifacts/" + "ab" * 20 + "/model.gguf",
              "ctx": 4096, "parallel": 4, "cache_type": "q8_0", "flash_attn": True}
    key = json.dumps(config, sort_keys=True, separators=(",", ":"))
    records.write(trial, config=config, config_key=key)
    stored = study.trials[0].user_attrs
    assert stored["config"] == {"_split": "dict"} and stored["config_key"] == {"_split": "text"}
    pieces = [stored[f"config_key.{i}"] for i in range(sum(k.startswith("config_key.") for k in stored))]
    assert all(p[-1] in ",/" for p in pieces[:-1]), pieces  # after an item, or in the path between names
    r = TrialRecord.of(study.trials[0])
    assert (r.config, r.config_key) == (config, key)


def test_a_split_dict_keeps_its_key_order_whatever_order_its_parts_are_read_in():
    # `best` printed a winner's values in another order on each call: the groups were joined in
    # the order of a set of their names, which differs from one process to the next.
    config = {f"k{i:02d}": "v" * 20 for i in range(12)} | {"long": "x" * 100}
    attrs = dict(records.cells("config", config))
    assert sum(k.startswith("config.~") for k in attrs) > 2  # several groups to put in order
    for order in (sorted(attrs), sorted(attrs, reverse=True)):
        joined = records.joined({k: attrs[k] for k in order}, "config")
        assert joined == config and list(joined) == list(config)


def test_a_value_written_again_leaves_no_stale_parts():
    study = optuna.create_study()
    trial = study.ask()
    records.write(trial, predicted_vram={"total_bytes": 1, "notes": ["n" * 100, "m" * 100], "kv_bytes": 5})
    records.write(trial, predicted_vram={"total_bytes": 2, "notes": ["short"]})
    assert TrialRecord.of(study.trials[0]).predicted_vram == {"total_bytes": 2, "notes": ["short"]}
    records.write(trial, predicted_vram={"total_bytes": 3, "notes": ["x" * 200], "kv_bytes": None})
    # A None is a value, not a missing part.
    assert TrialRecord.of(study.trials[0]).predicted_vram == {"total_bytes": 3, "notes": ["x" * 200], "kv_bytes": None}


def test_a_study_stored_before_values_were_split_reads_as_before():
    study = optuna.create_study()
    trial = study.ask()
    trial.set_user_attr("metrics", {"aggregate_tok_s": {"median": 1.0, "values": list(range(100))}})
    assert TrialRecord.of(study.trials[0]).metrics["aggregate_tok_s"]["values"] == list(range(100))


def test_the_short_items_of_a_long_dict_share_a_line():
    """Each attribute is written in a transaction of its own: one per key made a trial 131
    attributes and 38% of the default study's time."""
    stat = {"median": 39.0, "spread": 0.01, "mad": 0.1, "mean": 39.1, "stdev": 0.2, "min": 38.7, "max": 39.4,
            "n": 3, "values": [38.7, 39.0, 39.4], "warmups": [30.1], "unit": "tok/s", "stable": True,
            "rel_spread_tol": 0.05, "stop_reason": "stable", "warning": None, "note": "w" * 120}
    cells = records.cells("metrics.decode_tok_s", stat)
    assert len(cells) <= 12  # the marker, 7 groups, the long note (a marker and 3 pieces); not 17 + 2
    assert all(len(k) + len(json.dumps(v)) <= CELL_CHARS + 2 for k, v in cells)
    assert records.joined(dict(cells), "metrics.decode_tok_s") == stat


def test_a_dict_stored_one_key_per_attribute_reads_as_before():
    stored = {"m": {"_split": "dict"}, "m.a": 1, "m.b": {"_split": "list"}, "m.b.0": "x", "m.c": {"_split": "text"},
              "m.c.0": "ab", "m.c.1": "c"}
    assert records.joined(stored, "m") == {"a": 1, "b": ["x"], "c": "abc"}


def test_keys_that_look_like_parts_keep_their_dict_whole():
    value = {"~0": "a" * 60, "b": "b" * 60}
    assert records.cells("f", value) == [("f", value)]


def _optuna_and_batched(url_of, attrs, constraints):
    """One trial written through Optuna's calls one at a time, one through ``write``'s batch."""
    out = []
    for batched in (False, True):
        study = optuna.create_study(storage=url_of(batched), study_name="s")
        trial = study.ask()
        if batched:
            trial_writes.set_user_attrs(trial, attrs)
            trial_writes.set_constraints(trial, constraints)
        else:
            for k, v in attrs.items():
                trial.set_user_attr(k, v)
            for k, v in constraints.items():
                trial.set_constraint(k, v)
        seen = (dict(trial.user_attrs), trial.constraints)  # what the running trial holds
        study.tell(trial, 1.0)
        stored = optuna.load_study(study_name="s", storage=url_of(batched)).trials[0]
        out.append((seen, list(stored.user_attrs.items()), stored.system_attrs))
    return out


ATTRS = {"config": {"backend": "b", "ctx": 4096}, "note": "é" * 3, "n": 3, "none": None, "flag": True,
         "metrics": {"_split": "dict"}, "metrics.~0": {"median": 1.5}, "list": [1, 2.5, "x"]}


def test_a_batched_write_stores_what_optunas_calls_store(tmp_path):
    """``trial_writes.set_user_attrs`` and ``set_constraints`` write a trial in one transaction (one
    each per attribute made most of the default study's storage time): the stored attributes,
    as Optuna reads them back, and the running trial's view are Optuna's own."""
    a, b = _optuna_and_batched(lambda batched: f"sqlite:///{tmp_path}/{batched}.db", ATTRS, {"vram": -1.0, "q": 2})
    assert a == b
    assert dict(b[1]) == ATTRS and b[0][1] == {"vram": -1.0, "q": 2.0}


def test_storages_without_a_batch_take_optunas_calls(tmp_path):
    def journal(batched):
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(f"{tmp_path}/{batched}.log"))
    a, b = _optuna_and_batched(journal, ATTRS, {"vram": 0.5})
    assert a == b


def test_a_batched_write_to_a_finished_trial_is_refused_whole(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db")
    trial = study.ask()
    study.tell(trial, 1.0)
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        trial_writes.set_user_attrs(trial, {"a": 1, "b": 2})
    assert study.trials[0].user_attrs == {}


def test_a_constraint_set_twice_keeps_optunas_warning(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db")
    trial = study.ask()
    trial_writes.set_constraints(trial, {"a": 1.0, "b": 2.0})
    with pytest.warns(UserWarning, match="already set"):
        trial_writes.set_constraints(trial, {"a": 3.0, "c": 4.0})
    assert trial.constraints == {"a": 1.0, "b": 2.0, "c": 4.0}


def test_records_write_once_per_call(tmp_path, monkeypatch):
    """A record's attributes, the stale marks of a longer earlier value among them, reach the
    storage in one batch per ``write``."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db")
    trial = study.ask()
    records.write(trial, predicted_vram={"total_bytes": 1, "notes": ["n" * 100, "m" * 100]})
    batches = []
    real = trial_writes.set_user_attrs
    monkeypatch.setattr(trial_writes, "set_user_attrs", lambda t, attrs, *rest: (batches.append(dict(attrs)), real(t, attrs, *rest)))
    records.write(trial, predicted_vram={"total_bytes": 2, "notes": ["short"]}, worker="w")
    assert len(batches) == 1 and records.STALE in batches[0].values() and batches[0]["worker"] == "w"
    assert TrialRecord.of(study.trials[0]).predicted_vram == {"total_bytes": 2, "notes": ["short"]}


def test_held_fields_are_read_at_once_and_stored_with_the_next_write(tmp_path, monkeypatch):
    """``hold`` writes nothing; the trial reads the held fields at once, and the next ``write``
    stores them with its own in one batch, a field held twice with its last value."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db")
    trial = study.ask()
    batches = []
    real = trial_writes.set_user_attrs
    monkeypatch.setattr(trial_writes, "set_user_attrs", lambda t, attrs, *rest: (batches.append(dict(attrs)), real(t, attrs, *rest)))
    records.hold(trial, predicted_vram={"total_bytes": 1}, deploy_command="serve --a")
    records.hold(trial, predicted_vram={"total_bytes": 2})
    assert batches == [] and study.trials[0].user_attrs == {}
    assert trial.user_attrs["deploy_command"] == "serve --a"
    records.write(trial, worker="w")
    assert len(batches) == 1
    stored = TrialRecord.of(study.trials[0])
    assert (stored.predicted_vram, stored.deploy_command, stored.worker) == ({"total_bytes": 2}, "serve --a", "w")
    records.write(trial, config_key="k")  # nothing held any more
    assert set(batches[1]) == {"config_key"}


def test_constraints_are_stored_with_the_next_write_in_its_transaction(tmp_path, monkeypatch):
    """``records.set_constraints`` stores nothing by itself; the next ``write`` stores them and
    the fields in one transaction (one commit), as Optuna's ``set_constraint`` would store them."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/s.db")
    trial = study.ask()
    records.set_constraints(trial, {"vram_over_budget": 2.5, "per_user_below_min": -1.0})
    assert study.trials[0].constraints == {}
    import sqlalchemy

    commits = []

    def count(conn):
        commits.append(conn)

    engine = study._storage._backend.engine
    sqlalchemy.event.listen(engine, "commit", count)
    records.write(trial, prune_reason="does not fit")
    sqlalchemy.event.remove(engine, "commit", count)
    assert len(commits) == 1
    stored = study.trials[0]
    assert stored.constraints == {"vram_over_budget": 2.5, "per_user_below_min": -1.0}
    assert trial.constraints == stored.constraints
    assert TrialRecord.of(stored).prune_reason == "does not fit"


@pytest.mark.skipif(not os.environ.get("AUTOTUNE_TEST_POSTGRES_URL"),
                    reason="set AUTOTUNE_TEST_POSTGRES_URL to a PostgreSQL database to run")
def test_a_batched_write_stores_what_optunas_calls_store_in_postgres():
    import sqlalchemy

    url = os.environ["AUTOTUNE_TEST_POSTGRES_URL"]
    schemas = {b: f"batch_{uuid.uuid4().hex[:8]}" for b in (False, True)}
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        for s in schemas.values():
            conn.execute(sqlalchemy.text(f"CREATE SCHEMA {s}"))
    try:
        storages = {b: optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"options": f"-csearch_path={s}"}})
                    for b, s in schemas.items()}
        a, b = _optuna_and_batched(storages.__getitem__, ATTRS, {"vram": -1.0, "q": 2})
        assert a == b
    finally:
        with engine.begin() as conn:
            for s in schemas.values():
                conn.execute(sqlalchemy.text(f"DROP SCHEMA {s} CASCADE"))


def test_a_database_without_an_upsert_gets_optunas_per_key_write_in_one_session(tmp_path, monkeypatch):
    monkeypatch.setattr(trial_writes, "_upsert", lambda table, dialect, owner: None)
    a, b = _optuna_and_batched(lambda batched: f"sqlite:///{tmp_path}/{batched}.db", ATTRS, {"vram": -1.0})
    assert a == b
