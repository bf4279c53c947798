"""bench/study_table.py: the per-trial table of a measured study and its roofline shares."""

from __future__ import annotations

import importlib.util
import json

import optuna
import pytest

from autotune.study.records import SCHEMA_ATTR, SCHEMA_VERSION
from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("study_table", REPO / "bench" / "study_table.py")
study_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study_table)

GB = 1e9


def metric(median: float) -> dict:
    return {"median": median, "n": 2, "unit": "tok/s"}


def measured(
    config: dict,
    decode: float,
    aggregate: float,
    jobs: int | None,
    weights: int,
    predicted: int,
    nvml: int,
    residual: int,
) -> optuna.trial.FrozenTrial:
    facts = {"attention_path": "sdpa", "generator": {"mode": "dynamic"}}
    if jobs is not None:
        facts["generator"]["jobs_at_once"] = jobs
    attrs = {
        "config": config,
        "metrics": {
            "decode_tok_s": metric(decode),
            "aggregate_tok_s": metric(aggregate),
            "per_user_tok_s": metric(decode),
            "ttft_ms": metric(20.0),
            "prefill_tok_s": metric(5000.0),
        },
        "predicted_vram": {"weights_bytes": weights, "kv_bytes": 1000, "total_bytes": predicted},
        "measured_vram_bytes": nvml,
        "vram_prediction_error": (predicted - nvml) / nvml,
        "vram_residual_bytes": residual,
        "engine_facts": facts,
        "deploy_command": "serve it",
    }
    return optuna.trial.create_trial(state=optuna.trial.TrialState.COMPLETE, value=aggregate, user_attrs=attrs)


@pytest.fixture()
def storage(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(study_name="t", storage=url, direction="maximize")
    study.set_user_attr(SCHEMA_ATTR, SCHEMA_VERSION)  # as autotune writes every study
    # ExLlamaV2 queueing 4 jobs: one decoded at a time
    study.add_trial(
        measured(
            {"backend": "exllamav2", "weights": "m-exl2-4.0", "ctx": 1024, "parallel": 4, "cache_type": "q8"},
            decode=200.0,
            aggregate=180.0,
            jobs=1,
            weights=800_000_000,
            predicted=2_100_000_000,
            nvml=2_000_000_000,
            residual=-100_000_000,
        )
    )
    # llama-server with 8 slots records no jobs_at_once: all 8 decode together
    study.add_trial(
        measured(
            {"backend": "llama-server", "weights": "m.gguf", "ctx": 1024, "parallel": 8, "cache_type": "q8_0"},
            decode=400.0,
            aggregate=800.0,
            jobs=None,
            weights=960_000_000,
            predicted=1_700_000_000,
            nvml=1_690_000_000,
            residual=-10_000_000,
        )
    )
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.PRUNED,
            user_attrs={
                "config": {"backend": "llama-server", "weights": "m.gguf", "ctx": 1024, "parallel": 16},
                "prune_reason": "needs 150 GiB of a 139 GiB budget",
            },
        )
    )
    return url


def test_rows_give_roofline_shares_by_jobs_decoded_together(storage):
    rows = study_table.rows(study_table.load_study(storage), bandwidth_gb_s=4800.0)
    queued, slots, pruned = rows
    assert queued["options"] == {"cache_type": "q8"} and queued["jobs_at_once"] == 1
    assert queued["roofline_share_single"] == pytest.approx(800e6 * 200.0 / (4800 * GB))
    assert queued["roofline_share_aggregate"] == pytest.approx(800e6 * 180.0 / (4800 * GB))  # one step per token
    assert slots["jobs_at_once"] == 8
    assert slots["roofline_share_aggregate"] == pytest.approx(960e6 * 800.0 / 8 / (4800 * GB))
    # error against NVML with the study's correction, and of the raw model (measured - residual)
    assert queued["vram_prediction_error"] == pytest.approx(0.05)
    assert queued["raw_vram_prediction_error"] == pytest.approx(0.05)
    assert slots["raw_vram_prediction_error"] == pytest.approx(10e6 / 1690e6)
    assert pruned["state"] == "PRUNED" and pruned["reason"] == "needs 150 GiB of a 139 GiB budget"
    assert "decode_tok_s" not in pruned


def test_cli_writes_json_and_markdown(storage, tmp_path, capsys):
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    assert study_table.main([storage, "--gpu", "h200", "--json", str(out_json), "--md", str(out_md)]) == 0
    assert [r["trial"] for r in json.loads(out_json.read_text())] == [0, 1, 2]
    lines = out_md.read_text().splitlines()
    assert lines[0].startswith("| trial | backend |") and lines[1].count("---") == lines[0].count("|") - 1
    assert lines[2].startswith("| 0 | exllamav2 | m-exl2-4.0 | q8 | 4 | 1 | 200 | 180 |")
    assert "| 2 | llama-server | m.gguf |  | 16 | pruned: needs 150 GiB of a 139 GiB budget |" in lines[4]
    assert "over 4800 GB/s" in lines[-1]
    assert study_table.main([f"sqlite:///{tmp_path / 'empty.db'}"]) == 2
    assert "empty.db does not exist" in capsys.readouterr().err
    assert not (tmp_path / "empty.db").exists()  # a reader never creates a database


def test_kld_column_from_the_trial_or_from_kld_artifacts_json(storage, tmp_path):
    study = study_table.load_study(storage)
    recorded = measured(
        {"backend": "exllamav3", "weights": "exl3:4.0", "ctx": 1024, "parallel": 1, "cache_type": "fp16"},
        decode=300.0,
        aggregate=300.0,
        jobs=1,
        weights=900_000_000,
        predicted=2_000_000_000,
        nvml=2_000_000_000,
        residual=0,
    )
    recorded.user_attrs["quality"] = {"metric": "kld", "value": 0.0123, "drop_points": 1.23}
    study.add_trial(recorded)
    kld = tmp_path / "kld.json"
    kld.write_text(
        json.dumps(
            [
                {"backend": "exllamav2", "weights": "m-exl2-4.0", "cache_type": "q8", "kld_mean": 0.0456},
                {"backend": "exllamav2", "weights": "m-exl2-4.0", "cache_type": "fp16", "kld_mean": 0.0400},
                {"backend": "exllamav3", "weights": "exl3:4.0", "cache_type": "fp16", "kld_mean": 0.9},
                {"backend": "llama-server", "weights": "m.gguf", "cache_type": "q8_0", "error": "no scorer"},
            ]
        )
    )
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    assert study_table.main([storage, "--json", str(out_json), "--md", str(out_md), "--kld", str(kld)]) == 0
    by_trial = {r["trial"]: r.get("kld") for r in json.loads(out_json.read_text())}
    # The cache type matches too; what the trial recorded itself wins; a failed row gives nothing.
    assert by_trial == {0: 0.0456, 1: None, 2: None, 3: 0.0123}
    lines = out_md.read_text().splitlines()
    assert all(line.count("|") == lines[0].count("|") for line in lines[:6])
    assert lines[2].endswith("| 0.04560 |") and lines[5].endswith("| 0.01230 |")
