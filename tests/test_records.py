"""What a trial stores: long values in parts one line each (optuna-dashboard shows every user
attribute on one unwrapped line), read back whole by ``TrialRecord.of``."""

from __future__ import annotations

import json

import optuna

from autotune.study import records
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
    assert max(len(k) + len(json.dumps(v)) for k, v in stored.items() if k != "config") <= CELL_CHARS + 2
    assert stored["config"] == config  # identity fields stay whole: Optuna's queue reads them raw
    assert stored["metrics"] == {"_split": "dict"} and "metrics.aggregate_tok_s.values.0" in stored
    r = TrialRecord.of(study.trials[0])
    assert (r.metrics, r.log_tail, list(r.artifacts), r.config, r.worker) == (metrics, log, artifacts, config, "host:1")


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
    assert len(cells) <= 8  # the marker, 4 groups, the long note (a marker and 2 pieces); not 17 + 2
    assert all(len(k) + len(json.dumps(v)) <= CELL_CHARS + 2 for k, v in cells)
    assert records.joined(dict(cells), "metrics.decode_tok_s") == stat


def test_a_dict_stored_one_key_per_attribute_reads_as_before():
    stored = {"m": {"_split": "dict"}, "m.a": 1, "m.b": {"_split": "list"}, "m.b.0": "x", "m.c": {"_split": "text"},
              "m.c.0": "ab", "m.c.1": "c"}
    assert records.joined(stored, "m") == {"a": 1, "b": ["x"], "c": "abc"}


def test_keys_that_look_like_parts_keep_their_dict_whole():
    value = {"~0": "a" * 60, "b": "b" * 60}
    assert records.cells("f", value) == [("f", value)]
