"""Traffic on a real llama-server (CPU, the shipped stories260K): every request built to the
workload's lengths, closed loop and open loop, and a study under a latency target (issue 29)."""

from __future__ import annotations

import json
import subprocess
import sys

import optuna
import pytest

from autotune.engine.backend import StudyContext, TrialConfig
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_gguf
from autotune.study.records import TrialRecord
from autotune.engine.workload import Workload
from autotune_plugins.llama_server import trial_run as llama_backend  # where the measurement (post_events) lives
from autotune_plugins.llama_server.backend import LlamaServerBackend
from tests.engine_fixtures import STORIES, RecordedRequests, llama_server_binary

LENGTHS = ((20, 8), (60, 24), (100, 4))


@pytest.mark.parametrize("arrival", ["closed", "poisson"])
def test_every_request_has_its_own_lengths_on_the_engine(monkeypatch, arrival):
    llama_server_binary()
    wl = Workload(
        60,
        12,
        requests=LENGTHS * 2,
        arrival=arrival,
        rate=40.0 if arrival == "poisson" else None,
        slo=(("ttft_p95_ms", 10_000.0),),
    )
    ctx = StudyContext(
        gpu=get_gpu("t4"),
        model=model_from_gguf(STORIES),
        workload=wl,
        vram_budget_bytes=15 * 2**30,
        protocol=Protocol(warmup_runs=0, min_runs=2, max_runs=2, rel_spread_tol=1.0),
        settings={"threads": 1, "startup_timeout_s": 60},
        base_dir=STORIES.parent,
    )
    sent = RecordedRequests(llama_backend.post_events)
    monkeypatch.setattr(llama_backend, "post_events", sent)
    m = LlamaServerBackend().run(TrialConfig("llama-server", STORIES.name, 256, 2, (("flash_attn", True),)), ctx)
    # The warm-up and each run's request alone are the typical request; each run sends every
    # drawn request once, counted by the server itself.
    counted = [(r.get("prompt"), r.get("output")) for r in sent.sent]
    alone = [c for c in counted if c == (60, 12)]
    assert len(alone) == 3 and sorted(c for c in counted if c != (60, 12)) == sorted(LENGTHS * 4)
    if arrival == "closed":
        assert sent.most_open == 2
    stats = m.metrics
    assert stats["ttft_p50_ms"].median <= stats["ttft_p95_ms"].median <= stats["ttft_p99_ms"].median
    assert stats["e2e_p99_ms"].median >= stats["ttft_p99_ms"].median > 0
    # Every request met the loose target: goodput is the throughput.
    assert stats["goodput_tok_s"].median == pytest.approx(stats["aggregate_tok_s"].median)
    assert stats["goodput_req_s"].median * sum(o for _, o in LENGTHS * 2) == pytest.approx(
        stats["goodput_tok_s"].median * len(LENGTHS * 2)
    )


def test_a_cpu_study_with_a_lengths_file_and_a_latency_target(tmp_path):
    llama_server_binary()
    (tmp_path / "lengths.jsonl").write_text(
        "".join(json.dumps({"prompt_tokens": p, "output_tokens": o}) + "\n" for p, o in LENGTHS), encoding="utf-8"
    )
    (tmp_path / "slo.toml").write_text(
        f"""[study]
name = "slo"
sampler = "grid"
n_trials = 3
finish_top = 0
baseline = false
[hardware]
gpu = "t4"
[model]
ref = "{STORIES}"
[workload]
file = "lengths.jsonl"
requests = 6
[measure]
warmup_runs = 0
min_runs = 1
max_runs = 1
[[candidates]]
backend = "llama-server"
weights = ["{STORIES}"]
[space]
ctx = [256]
parallel = [1, 2, 4]
[backends.llama-server]
threads = 1
[objective]
ttft_p95_ms = 20000
itl_p99_ms = 20000
""",
        encoding="utf-8",
    )
    storage = f"sqlite:///{tmp_path / 'slo.db'}"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from autotune.cli import main; main()",
            "study",
            "slo.toml",
            "--storage",
            storage,
            "--json",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "AUTOTUNE_LOAD_PLUGINS": "llama_server"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    study = optuna.load_study(study_name="slo", storage=storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 3
    for t in done:
        r = TrialRecord.of(t)
        # Scored by goodput, each target a constraint computed from the trial's own percentile.
        assert t.value == pytest.approx(r.metrics["goodput_tok_s"]["median"])
        assert r.constraints["slo_ttft_p95_ms"] == pytest.approx(r.metrics["ttft_p95_ms"]["median"] / 20000 - 1)
        assert r.constraints["slo_itl_p99_ms"] == pytest.approx(r.metrics["itl_p99_ms"]["median"] / 20000 - 1)
    assert summary["best"]["metrics"]["goodput_tok_s"] == max(t.value for t in done)


def test_the_bench_function_against_a_running_server(tmp_path):
    """run_openai_load, what a bench script calls (beside aiperf or guidellm): per-request
    records with the lengths the server counted, closed loop and Poisson arrivals."""
    import socket
    import time

    import httpx

    from autotune.measure.load import run_openai_load

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(llama_server_binary()), "-m", str(STORIES), "--port", str(port), "-np", "2", "-c", "2048", "-t", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/v1"
        closed = run_openai_load(url, list(LENGTHS) * 2, concurrency=2, slo=(("ttft_p95_ms", 60_000.0),))
        assert [(r["prompt_tokens"], r["output_tokens"]) for r in closed.records] == list(LENGTHS) * 2
        assert closed.missed == () and closed.metrics["goodput_tok_s"] == pytest.approx(
            closed.metrics["aggregate_tok_s"]
        )
        opened = run_openai_load(url, list(LENGTHS), rate=50.0, seed=1)
        assert opened.metrics["offered_rate"] == 50.0 and len(opened.records) == 3
        assert all(r["e2e_ms"] >= r["ttft_ms"] > 0 for r in opened.records)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
