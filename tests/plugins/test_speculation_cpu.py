"""Speculative decoding searched for real on the CPU: a study over spec type and draft length on
the shipped stories260K, the model itself as its draft and an n-gram lookup on the looping text
it writes, with the acceptance read from llama-server's own counters; and the draft's memory
against the engine's start-up log.

Needs a llama.cpp build (CI makes one and sets AUTOTUNE_REQUIRE_ENGINE=1, so these fail there
rather than skip).
"""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from autotune.toolkit import processes
from autotune.engine.backend import TrialConfig
from autotune.config import load_study_config
from autotune.study import records
from autotune_plugins.llama_server import draft_memory, memory
from autotune_plugins.llama_server.backend import LlamaServerBackend
from autotune_plugins.llama_server.synth import SynthSpec, write_model
from tests.engine_fixtures import STORIES, llama_server_binary
from tests.plugins.test_llama_server_backend import make_ctx

MiB = 2**20


@pytest.fixture
def llama_plugin(monkeypatch):
    import autotune_plugins.llama_server as llama_server
    from tests.conftest import plugin_registered

    monkeypatch.setattr("autotune_plugins.llama_server.backend._has_gpu", lambda: False)
    with plugin_registered(llama_server, "llama_server"):
        yield


def _study(path: Path) -> Path:
    # 256 output tokens: stories260K at temperature 0 starts its story over within them, which
    # is the repetition an n-gram lookup drafts from (16 tokens of prompt give it nothing).
    path.write_text(
        f"""[study]
name = "speculation"
sampler = "grid"
baseline = false
finish_top = 0

[hardware]
gpu = "cpu"

[model]
ref = "{STORIES}"

[workload]
prompt_tokens = 16
output_tokens = 256

[measure]
warmup_runs = 0
min_runs = 1
max_runs = 1

[[candidates]]
backend = "llama-server"
weights = ["{STORIES}"]
draft = ["{STORIES}"]

[space]
ctx = [512]
parallel = [1]
cache_type = ["f16"]
flash_attn = [true]
spec_type = ["none", "draft-simple", "ngram-simple"]
spec_n_max = [2, 6]
spec_ngram_n = [2]

[backends.llama-server]
threads = 1
""",
        encoding="utf-8",
    )
    return path


def test_a_study_over_spec_type_and_n_max_reads_acceptance_from_the_engine(tmp_path, llama_plugin):
    from autotune.study.runner import run_study

    llama_server_binary()
    storage = f"sqlite:///{tmp_path / 's.db'}"
    run_study(load_study_config(_study(tmp_path / "spec.toml")), n_trials=4, storage=storage)
    study = optuna.load_study(study_name="speculation", storage=storage)
    done = [r for r in records.records(study) if r.state == records.TrialState.COMPLETE]
    by = {(r.trial_config.option("spec_type"), r.trial_config.option("spec_n_max")): r for r in done if r.config}
    assert set(by) == {("none", None), ("draft-simple", 2), ("draft-simple", 6), ("ngram-simple", None)}, by.keys()
    assert by[("none", None)].acceptance is None  # no speculation: nothing stored, nothing assumed
    for n_max in (2, 6):
        acc = by[("draft-simple", n_max)].acceptance
        # Its own draft at temperature 0 proposes what the target samples: nearly all accepted.
        assert acc["drafted"] > 0 and acc["rate"] >= 0.95, acc
        assert acc["generated"] == 2 * 256 and acc["requests"] == 2  # one alone, one stream
        assert f"--spec-draft-n-max {n_max}" in by[("draft-simple", n_max)].deploy_command
        assert "-md " in by[("draft-simple", n_max)].deploy_command
    ngram = by[("ngram-simple", None)].acceptance
    assert ngram["accepted"] > 0 and ngram["rate"] < 1, ngram  # the loop is found, not every guess
    assert "--spec-ngram-simple-size-n 2" in by[("ngram-simple", None)].deploy_command
    print({k: v.acceptance for k, v in by.items()})
    assert not processes.live()
    # "Why not a neighbour": speculation switched on or off is one value changed, with the draft
    # and its length it brings in at their best measured values (not a configuration the engine
    # refuses for a missing draft), and a draft length is no neighbour where nothing is drafted.
    why = study.user_attrs[records.WHY_BEST_ATTR]
    best = study.user_attrs.get("best_config") or next(r.config for r in done if r.number == study.best_trial.number)
    if best.get("spec_type") == "none":
        assert not [line for line in why if line.startswith("spec_n_max")], why
        (on,) = [line for line in why if line.startswith("spec_type draft-simple")]
        assert "(with draft " in on and "spec_n_max " in on and "measured score" in on, on
    else:
        (off,) = [line for line in why if line.startswith("spec_type none")]
        assert "(with" not in off and "measured score" in off, off


def test_the_drafts_memory_is_what_the_engine_allocates(tmp_path):
    """A draft of another shape (2 layers of 128, stories260K's vocabulary) beside stories260K,
    2 slots, a q8_0 draft cache: its model, KV and compute buffers as llama.cpp logs them."""
    llama_server_binary()
    draft = write_model(
        SynthSpec(arch="llama", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, ffn=384, context_length=2048),
        tmp_path / "draft.gguf",
        vocab_from=STORIES,
        seed=0,
    ).path
    backend = LlamaServerBackend()
    ctx = make_ctx(STORIES, threads=1)
    config = TrialConfig(
        "llama-server",
        str(STORIES),
        600,
        2,
        (
            ("cache_type", "f16"),
            ("draft", str(draft)),
            ("draft_cache_type", "q8_0"),
            ("flash_attn", True),
            ("spec_n_max", 3),
            ("spec_type", "draft-simple"),
        ),
    )
    predicted = draft_memory.draft_estimate(backend, config, ctx, on_gpu=False)
    server = backend.launch(config, ctx, False, tmp_path, verbose=True)
    try:
        backend.wait_ready(server, 60)
        target, logged = draft_memory.split_log(server.log())
    finally:
        processes.stop(server.proc)
    weights, kv, compute = (
        sum(logged[k].values()) * MiB for k in ("model_buffer_mib", "kv_buffer_mib", "compute_buffer_mib")
    )
    print(
        f"draft: weights {predicted.weights_bytes / MiB:.2f}/{weights / MiB:.2f} MiB, KV {predicted.kv_bytes / MiB:.3f}/"
        f"{kv / MiB:.3f}, compute {predicted.buffers_bytes / MiB:.2f}/{compute / MiB:.2f} (model/log)"
    )
    # The log prints MiB with 2 decimals.
    assert abs(predicted.weights_bytes - weights) <= max(0.01 * weights, 0.006 * MiB)
    assert abs(predicted.kv_bytes - kv) <= max(0.01 * kv, 0.006 * MiB)
    assert abs(predicted.buffers_bytes - compute) <= 0.05 * compute
    assert logged["kv_cells"] == memory.LAYOUT.cells(600, 2)  # the target's slots, as many cells
    # and the judge's estimate holds both models
    both = backend.estimate_memory(config, ctx)
    alone = backend.estimate_memory(
        TrialConfig("llama-server", str(STORIES), 600, 2, (("cache_type", "f16"), ("flash_attn", True))), ctx
    )
    assert both.total_bytes == alone.total_bytes + predicted.total_bytes
    assert sum(target["kv_buffer_mib"].values()) * MiB == pytest.approx(alone.kv_bytes, abs=0.006 * MiB)
