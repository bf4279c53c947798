"""The llama-server backend: flags, rules, memory estimate against the engine's log, real runs.

Runs that launch llama-server are skipped when no build is found (``autotune engine build
llama.cpp``, ``AUTOTUNE_LLAMA_SERVER``, or ``llama-server`` on PATH).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.backend import StudyContext, TrialConfig, Workload
from autotune import processes
from autotune.errors import BackendError
from autotune.formats import kv_bytes_per_token
from autotune.hardware import get_gpu
from autotune.measure import Protocol
from autotune.models import model_from_gguf
from tests.conftest import REPO, shared_file
from tests.engine_fixtures import llama_server_binary

from autotune_plugins.llama_server import backend as lsb
from autotune_plugins.llama_server.backend import LlamaServerBackend

MiB = 2**20
FAST = Protocol(warmup_runs=0, min_runs=1, max_runs=2, rel_spread_tol=0.5)


@pytest.fixture(scope="module")
def server_binary() -> Path:
    return llama_server_binary()


@pytest.fixture
def stories(tmp_path) -> Path:
    """stories260K.gguf copied under a unique path, so its processes can be found in /proc."""
    dst = tmp_path / "stories260K.gguf"
    shutil.copy(shared_file("models/stories260K.gguf"), dst)
    return dst


def make_ctx(model_path: Path, **settings) -> StudyContext:
    return StudyContext(
        gpu=get_gpu("t4"),
        model=model_from_gguf(model_path),
        workload=Workload(prompt_tokens=32, output_tokens=16),
        vram_budget_bytes=15 * 2**30,
        protocol=FAST,
        settings={"threads": 2, "startup_timeout_s": 30, **settings},
        base_dir=model_path.parent,
    )


def cfg(weights: str, ctx: int = 256, parallel: int = 1, **options) -> TrialConfig:
    return TrialConfig(backend="llama-server", weights=weights, ctx=ctx, parallel=parallel,
                       options=tuple(sorted({"cache_type": "f16", "flash_attn": True, **options}.items())))


def servers_on(path: Path) -> list[int]:
    """Pids of live processes whose command line names ``path`` (zombies excluded)."""
    pids = []
    needle = str(path).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "cmdline").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            pids.append(int(entry.name))
    return pids


# ------------------------------------------------------------------------------ no engine needed


def test_deploy_command_translates_ctx_times_parallel(stories):
    b = LlamaServerBackend()
    c = make_ctx(stories)
    cmd = b.deploy_command(cfg("stories260K.gguf", ctx=300, parallel=3, cache_type="q8_0", flash_attn=False), c)
    assert cmd.startswith(f"llama-server -m {stories} ")
    assert " -c 900 -np 3 " in cmd and "-ngl 999" in cmd
    assert "-fa off -ctk q8_0 -ctv q8_0" in cmd
    assert "--host 0.0.0.0 --port 8080 --fit off" in cmd
    assert "shared by the slots" in cmd
    assert "-ngl 5 " in b.deploy_command(cfg("stories260K.gguf"), make_ctx(stories, gpu_layers=5))
    assert "-ub 256" in b.deploy_command(cfg("stories260K.gguf", ubatch=256), c)


def test_parameters_filter_the_study_space():
    b = LlamaServerBackend()
    params = {p.name: p.choices for p in b.parameters({"cache_type": ["fp16", "q8_0", "q4", "q4_0"],
                                                        "flash_attn": [True, False]})}
    assert params == {"cache_type": ("q8_0", "q4_0"), "flash_attn": (True, False)}
    params = {p.name: p.choices for p in b.parameters({"ubatch": [128, 512]})}
    assert params["ubatch"] == (128, 512) and params["cache_type"] == ("f16", "q8_0", "q4_0")
    assert b.quality_reference({"cache_type": ("q4_0", "f16"), "flash_attn": (False, True)}) == \
        {"cache_type": "f16", "flash_attn": True}


def test_check_rules(stories, tmp_path):
    b = LlamaServerBackend()
    c = make_ctx(stories)
    assert b.check(cfg("stories260K.gguf"), c) == []
    no_fa = b.check(cfg("stories260K.gguf", cache_type="q8_0", flash_attn=False), c)
    assert any("flash_attn" in r for r in no_fa)
    # stories260K's heads are 8 wide: q8_0's 32-element block does not divide them.
    assert any("does not divide" in r for r in b.check(cfg("stories260K.gguf", cache_type="q8_0"), c))
    assert any("context length 2048" in r for r in b.check(cfg("stories260K.gguf", ctx=4096), c))
    assert "no such file" in b.check(cfg("missing.gguf"), c)[0]
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + bytes(100))
    assert "not a GGUF" in b.check_weights("junk.gguf", c)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(8))
    assert b.check_weights("broken.gguf", c) is not None
    assert b.check_weights(str(stories), c) is None  # absolute paths too


def test_estimate_reads_the_file(stories, monkeypatch):
    b = LlamaServerBackend()
    c = make_ctx(stories)
    on_cpu = b.estimate_memory(cfg("stories260K.gguf", ctx=600, parallel=2), c) if not lsb._has_gpu() else None
    monkeypatch.setattr(lsb, "_has_gpu", lambda: True)
    est = b.estimate_memory(cfg("stories260K.gguf", ctx=600, parallel=2), c)
    model = model_from_gguf(stories)
    # each slot's cache is padded to 256 cells: 2 x 768
    assert est.kv_bytes == 2 * 768 * kv_bytes_per_token(model, "f16")
    assert est.host_bytes == 512 * 64 * 4  # token_embd (F32) stays on the host
    assert est.buffers_bytes > 0 and est.overhead_bytes > 0
    q = b.estimate_memory(cfg("stories260K.gguf", ctx=600, parallel=2, cache_type="q4_0"), c)
    assert q.kv_bytes < est.kv_bytes / 3
    if on_cpu is not None:  # a CPU server: every tensor in host RAM, no CUDA context
        assert on_cpu.overhead_bytes == 0 and on_cpu.weights_bytes == est.weights_bytes + est.host_bytes


# ------------------------------------------------------------------------------ real engine


def test_run_measures_and_matches_the_logged_buffers(server_binary, stories):
    b = LlamaServerBackend()
    c = make_ctx(stories)
    config = cfg("stories260K.gguf", ctx=600, parallel=2)
    m = b.run(config, c)
    assert m.metrics["decode_tok_s"].median > 0
    assert m.metrics["aggregate_tok_s"].median > 0 and m.metrics["per_user_tok_s"].median > 0
    assert m.metrics["prefill_tok_s"].median > 0 and m.metrics["ttft_ms"].median > 0
    a = m.attrs
    assert {"model_buffer_mib", "kv_buffer_mib", "compute_buffer_mib"} <= set(a)
    assert a["spilled"] is False and a["engine_version"].startswith("llama.cpp")
    assert " -c 1200 -np 2 " in a["command"]
    est = b.estimate_memory(config, c)
    # Weights: the engine maps every tensor (token_embd on the host, the rest where -ngl says).
    logged_weights = sum(a["model_buffer_mib"].values()) * MiB
    assert abs(est.weights_bytes + est.host_bytes - logged_weights) <= 0.01 * logged_weights
    # KV: the logged cell count exactly, the logged MiB (2 decimals) within 1%.
    model = model_from_gguf(stories)
    assert est.kv_bytes == a["kv_cells"] * kv_bytes_per_token(model, "f16")
    logged_kv = sum(a["kv_buffer_mib"].values()) * MiB
    assert abs(est.kv_bytes - logged_kv) <= 0.01 * est.kv_bytes
    assert servers_on(stories) == [] and not processes.live()


@pytest.mark.parametrize("weights, options, reason", [
    ("stories260K.gguf", {"cache_type": "q9_9"}, "q9_9"),
    ("stories260K.gguf", {"cache_type": "q8_0"}, "does not divide"),
    ("missing.gguf", {}, "missing.gguf"),
])
def test_engine_failures_carry_the_engines_reason(server_binary, stories, weights, options, reason):
    b = LlamaServerBackend()
    with pytest.raises(BackendError) as info:
        b.run(cfg(weights, **options), make_ctx(stories))
    assert "exited" in str(info.value) and reason in str(info.value)
    assert info.value.log_tail
    assert servers_on(stories) == [] and servers_on(stories.parent / "missing.gguf") == []


def test_no_server_survives_a_failed_measurement(server_binary, stories, monkeypatch):
    b = LlamaServerBackend()

    def boom(self, server, n):
        assert servers_on(stories), "the server should be up here"
        raise RuntimeError("client broke")

    monkeypatch.setattr(LlamaServerBackend, "prompt_tokens", boom)
    with pytest.raises(BackendError, match="client broke"):
        b.run(cfg("stories260K.gguf"), make_ctx(stories))
    assert servers_on(stories) == [] and not processes.live()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_server_survives_autotune_being_stopped_or_killed(server_binary, stories, tmp_path, sig):
    script = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from tests.plugins.test_llama_server_backend import cfg, make_ctx
from autotune_plugins.llama_server.backend import LlamaServerBackend
b = LlamaServerBackend()
c = make_ctx(Path({str(stories)!r}))
server = b.launch(cfg("stories260K.gguf"), c, False, Path({str(tmp_path)!r}))
b.wait_ready(server, 30)
print(server.proc.pid, flush=True)
time.sleep(60)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    pid = None
    try:
        pid = int(child.stdout.readline())
        assert pid in servers_on(stories)
        child.send_signal(sig)
        child.wait(timeout=20)
        deadline = time.monotonic() + 5
        while servers_on(stories) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert servers_on(stories) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if pid is not None and pid in servers_on(stories):  # the test failed: do not leave it behind
            os.killpg(pid, signal.SIGKILL)
