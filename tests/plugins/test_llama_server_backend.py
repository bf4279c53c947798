"""The llama-server backend: flags, rules, memory estimate against the engine's log, real runs.

Runs that launch llama-server are skipped when no build is found (``autotune engine build
llama.cpp``, ``AUTOTUNE_LLAMA_SERVER``, or ``llama-server`` on PATH).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.engine.backend import StudyContext, TrialConfig, Workload, quality_reference
from autotune.toolkit import processes
from autotune.errors import BackendError, ConfigError, EngineUnavailableError
from autotune.engine.cache_types import kv_bytes_per_token
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_gguf
from tests.conftest import REPO, shared_file
from tests.engine_fixtures import fake_engine, fake_engine_calls, llama_server_binary

from autotune_plugins.llama_server import backend as lsb, engine, startup_facts
from autotune_plugins.llama_server.backend import LlamaServerBackend
from autotune_plugins.llama_server.server import plan_cpus

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
    return TrialConfig(
        backend="llama-server",
        weights=weights,
        ctx=ctx,
        parallel=parallel,
        options=tuple(sorted({"cache_type": "f16", "flash_attn": True, **options}.items())),
    )


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


def test_deploy_command_translates_ctx_times_parallel(stories, monkeypatch):
    monkeypatch.setattr(lsb, "_has_gpu", lambda: True)
    b = LlamaServerBackend()
    c = make_ctx(stories)
    cmd = b.deploy_command(cfg("stories260K.gguf", ctx=300, parallel=3, cache_type="q8_0", flash_attn=False), c)
    assert f" -m {stories} " in cmd
    assert " -c 900 -np 3 " in cmd and "-ngl 999" in cmd and " -t 2 " in cmd
    assert "-fa off -ctk q8_0 -ctv q8_0" in cmd
    assert "--host 127.0.0.1 --port 8080" in cmd and "--fit off" in cmd
    assert "shared by the slots" in cmd and 'host = "0.0.0.0"' in cmd
    assert "-ngl 5 " in b.deploy_command(cfg("stories260K.gguf"), make_ctx(stories, gpu_layers=5))
    assert "-ub 256" in b.deploy_command(cfg("stories260K.gguf", ubatch=256), c)
    exposed = b.deploy_command(cfg("stories260K.gguf"), make_ctx(stories, host="0.0.0.0", port=9000))
    assert "--host 0.0.0.0 --port 9000" in exposed and "listens on 0.0.0.0" in exposed
    monkeypatch.setattr(lsb, "_has_gpu", lambda: False)
    cpu = b.deploy_command(cfg("stories260K.gguf"), c)
    assert "-ngl 0 " in cpu and not cpu.startswith("CUDA_VISIBLE_DEVICES")


def deploy_tokens(line: str) -> tuple[str | None, list[str]]:
    """(CUDA_VISIBLE_DEVICES prefix, argv) of a deploy line, its comment left out."""
    tokens = shlex.split(line, comments=True)
    devices = None
    if tokens[0].startswith("CUDA_VISIBLE_DEVICES="):
        devices = tokens.pop(0).split("=", 1)[1]
    return devices, tokens


def without_port(argv: list[str]) -> list[str]:
    i = argv.index("--port")
    return argv[: i + 1] + ["PORT"] + argv[i + 2 :]


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_deploy_line_is_the_launched_argv(stories, tmp_path, monkeypatch, gpu):
    """What a trial starts, token by token, is what the deploy line says (the port aside)."""
    monkeypatch.setattr(lsb, "_has_gpu", lambda: gpu)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = fake_engine(tmp_path)
    b = LlamaServerBackend()
    c = make_ctx(stories, binary=str(fake), threads=1, gpu_layers=7)
    config = cfg("stories260K.gguf", ctx=300, parallel=3, cache_type="q8_0", ubatch=128)
    devices, deployed = deploy_tokens(b.deploy_command(config, c))
    with pytest.raises(BackendError, match="exited with code 1"):
        b.run(config, c)  # the fake records its start and exits: the trial fails, as it should
    [call] = fake_engine_calls(fake)
    assert without_port(call["argv"]) == without_port(deployed)
    assert call["argv"][0] == str(fake.absolute()) and Path(deployed[0]).is_absolute()
    assert ("-ngl", "7" if gpu else "0") in zip(deployed, deployed[1:])
    assert call["cuda_visible_devices"] == devices == ("0" if gpu else None)
    assert not processes.live()


def test_deploy_line_without_the_engine(stories, monkeypatch):
    """deploy_command runs before any launch: a missing engine still gives the line, and where
    the engine is expected."""

    def nowhere(settings=None, **kwargs):
        raise engine.EngineNotFoundError("llama-server not found (no build in /x, none on PATH)")

    monkeypatch.setattr(engine, "find_llama_server", nowhere)
    b = LlamaServerBackend()
    line = b.deploy_command(cfg("stories260K.gguf"), make_ctx(stories))
    _, argv = deploy_tokens(line)
    assert argv[0] == "llama-server" and "-c" in argv
    assert "autotune engine build llama.cpp" in line and "/bin/" in line
    given = b.deploy_command(cfg("stories260K.gguf"), make_ctx(stories, binary="/opt/llama/llama-server"))
    assert deploy_tokens(given)[1][0] == "/opt/llama/llama-server"


def test_a_missing_engine_stops_the_study(stories, tmp_path, monkeypatch):
    """Missing, not executable, or unable to run: preflight names the remedy where it can tell,
    and run() raises the error that stops a study at its first trial instead of failing every
    trial alike."""
    b = LlamaServerBackend()
    missing = make_ctx(stories, binary=str(tmp_path / "nowhere" / "llama-server"))
    [problem] = b.preflight(missing)
    assert "nowhere" in problem and "autotune engine build llama.cpp" in problem
    with pytest.raises(EngineUnavailableError):
        b.run(cfg("stories260K.gguf"), missing)

    (tmp_path / "plain").mkdir()
    not_executable = fake_engine(tmp_path / "plain")
    not_executable.chmod(0o644)
    ctx = make_ctx(stories, binary=str(not_executable))
    [problem] = b.preflight(ctx)
    assert "no executable llama-server" in problem and "autotune engine build llama.cpp" in problem
    with pytest.raises(EngineUnavailableError):
        b.run(cfg("stories260K.gguf"), ctx)

    def nowhere(settings=None, **kwargs):
        raise engine.EngineNotFoundError("llama-server not found: run `autotune engine build llama.cpp`")

    with monkeypatch.context() as m:
        m.setattr(engine, "find_llama_server", nowhere)
        [problem] = b.preflight(make_ctx(stories))
        assert "autotune engine build llama.cpp" in problem

    # A binary whose libraries are missing answers nothing, and a shell reports exit 127.
    (tmp_path / "broken").mkdir()
    cannot_run = fake_engine(tmp_path / "broken", exit_code=127)
    ctx = make_ctx(stories, binary=str(cannot_run))
    with pytest.raises(EngineUnavailableError, match="cannot run here"):
        b.run(cfg("stories260K.gguf"), ctx)


def test_an_engine_that_runs_passes_preflight(stories, tmp_path):
    assert LlamaServerBackend().preflight(make_ctx(stories, binary=str(fake_engine(tmp_path)))) == []


def test_a_cpu_build_on_a_machine_with_a_card_fails_preflight(stories, monkeypatch):
    # The CPU build would run every trial on the CPU while the study believes it measures the card.
    import autotune_plugins.llama_server.backend as backend_mod

    binary = llama_server_binary()  # the CPU build CI makes
    monkeypatch.setattr(backend_mod, "_has_gpu", lambda: True)
    [problem] = LlamaServerBackend().preflight(make_ctx(stories, binary=str(binary)))
    # The study file's candidate or init names the backend: the problem itself does not (once, not twice).
    assert "backend llama-server" not in problem and "autotune engine build llama.cpp --cuda-arch 75" in problem
    monkeypatch.setattr(backend_mod, "_has_gpu", lambda: False)
    assert LlamaServerBackend().preflight(make_ctx(stories, binary=str(binary))) == []


def test_settings_are_declared_and_checked(stories):
    b = LlamaServerBackend()
    declared = {s.name: s for s in b.settings}
    read = set(re.findall(r'value\(ctx, "(\w+)"\)', Path(lsb.__file__).read_text()))
    assert read <= set(declared), read - set(declared)
    assert {
        "binary",
        "threads",
        "gpu_layers",
        "host",
        "port",
        "startup_timeout_s",
        "request_timeout_s",
        "stability_metric",
        "scoring_ctx",
        "pin_cores",
    } <= set(declared)
    assert all(s.help for s in b.settings)
    c = make_ctx(stories)
    assert b.setting(c, "host") == "127.0.0.1" and b.setting(c, "port") == 8080
    assert declared["gpu_layers"].problem("all") is None and declared["gpu_layers"].problem(0) is None
    assert declared["gpu_layers"].problem("most") and declared["gpu_layers"].problem(-1)
    assert declared["startup_timeout_s"].problem("soon") and declared["port"].problem(70000)
    assert declared["stability_metric"].problem("speed")
    with pytest.raises(ConfigError, match=r"\[backends.llama-server\] gpu_layers = 'most'"):
        b.gpu_layers(make_ctx(stories, gpu_layers="most"))
    assert "weight_families" not in vars(LlamaServerBackend)


def test_parameters_filter_the_study_space():
    b = LlamaServerBackend()
    params = {
        p.name: p.choices
        for p in b.parameters({"cache_type": ["fp16", "q8_0", "q4", "q4_0"], "flash_attn": [True, False]})
    }
    assert params == {"cache_type": ("q8_0", "q4_0"), "flash_attn": (True, False)}
    params = {p.name: p.choices for p in b.parameters({"ubatch": [128, 512]})}
    assert params["ubatch"] == (128, 512) and params["cache_type"] == ("f16", "q8_0", "q4_0")
    assert quality_reference(b, {"cache_type": ("q4_0", "f16"), "flash_attn": (False, True)}) == {
        "cache_type": "f16",
        "flash_attn": True,
    }


def test_parameters_never_substitute_a_value():
    """A value the engine does not understand is dropped, never replaced by a default: with
    nothing left the choices are empty and the core reports the value with ``accepted``."""
    b = LlamaServerBackend()
    params = {p.name: p for p in b.parameters({"flash_attn": ["no"], "cache_type": ["q9_0"], "ubatch": [0, True]})}
    assert params["flash_attn"].choices == () and params["flash_attn"].accepted == (True, False)
    assert params["cache_type"].choices == () and set(params["cache_type"].accepted) == {"f16", "q8_0", "q4_0"}
    assert params["ubatch"].choices == () and params["ubatch"].accepted
    only = {p.name: p.choices for p in b.parameters({"flash_attn": [False, 1], "cache_type": ["q4_0"]})}
    assert only == {"flash_attn": (False,), "cache_type": ("q4_0",)}  # 1 is not true


def test_cpu_plan_keeps_the_client_off_the_engines_cores():
    plan = plan_cpus(2, True, allowed=[0, 1, 2, 3])
    assert plan.engine == (2, 3) and plan.client == (0, 1) and "pinned" in plan.note
    two = plan_cpus(2, True, allowed=[0, 1])
    assert two.engine is None and "no core for the load generator" in two.note
    assert plan_cpus(1, False, allowed=[0, 1]).engine is None


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin"
)
def test_launch_pins_the_engine(stories, tmp_path):
    fake = fake_engine(tmp_path)
    b = LlamaServerBackend()
    before = os.sched_getaffinity(0)
    with pytest.raises(BackendError):
        b.run(cfg("stories260K.gguf"), make_ctx(stories, binary=str(fake), threads=1))
    [call] = fake_engine_calls(fake)
    assert call["affinity"] == [max(before)]
    assert os.sched_getaffinity(0) == before  # autotune's own thread got its cores back


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


def test_weights_that_are_not_a_regular_file_are_named_for_what_they_are(stories, tmp_path):
    """Not "no such file" for what exists; and a FIFO or a device is never opened (it would block)."""
    b = LlamaServerBackend()
    c = make_ctx(stories)
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    where = " (weights are GGUF paths relative to the study file)"
    assert b.check_weights("/dev/zero", c) == f"/dev/zero: is a character device, not a regular file{where}"
    assert b.check_weights(str(tmp_path), c) == f"{tmp_path}: is a directory, not a regular file{where}"
    assert b.check_weights(str(fifo), c) == f"{fifo}: is a named pipe (FIFO), not a regular file{where}"
    (tmp_path / "gone.gguf").symlink_to(tmp_path / "nowhere.gguf")
    assert (
        b.check_weights(str(tmp_path / "gone.gguf"), c)
        == f"{tmp_path / 'gone.gguf'}: a symbolic link to {tmp_path / 'nowhere.gguf'}, which does not exist{where}"
    )
    assert b.check_weights(str(stories), c) is None  # absolute paths too


def test_estimate_reads_the_file(stories, monkeypatch, engine_plugins):
    b = LlamaServerBackend()
    c = make_ctx(stories)
    on_cpu = b.estimate_memory(cfg("stories260K.gguf", ctx=600, parallel=2), c) if not lsb._has_gpu() else None
    monkeypatch.setattr(lsb, "_has_gpu", lambda: True)
    est = b.estimate_memory(cfg("stories260K.gguf", ctx=600, parallel=2), c)
    model = model_from_gguf(stories)
    # each slot's cache is padded to 256 cells: 2 x 768
    assert est.kv_bytes == 2 * 768 * kv_bytes_per_token(model, "f16")
    # token_embd (F32) stays on the host, beside the pinned CUDA_Host compute buffer: 2 residual-wide
    # F32 values per token of the micro-batch (512, clamped to the 1200 cells) and the F16 mask
    pinned = 512 * (2 * model.hidden_size * 4 + 768 * 2)
    assert (est.host_bytes, est.host_buffers_bytes) == (512 * 64 * 4, pinned)
    assert est.buffers_bytes > 0 and est.overhead_bytes > 0
    q = b.estimate_memory(cfg("stories260K.gguf", ctx=600, parallel=2, cache_type="q4_0"), c)
    assert q.kv_bytes < est.kv_bytes / 3
    if on_cpu is not None:  # a CPU server: every tensor in host RAM, no CUDA context
        assert on_cpu.overhead_bytes == 0 and on_cpu.weights_bytes == est.weights_bytes + est.host_bytes


# ------------------------------------------------------------------------------ real engine


def test_run_measures_and_matches_the_logged_buffers(server_binary, stories, engine_plugins):
    startup_facts._STARTUP_FACTS.clear()  # this test's first configuration is the one launched for the facts
    b = LlamaServerBackend()
    c = make_ctx(stories, startup_facts=True)
    config = cfg("stories260K.gguf", ctx=600, parallel=2)
    m = b.run(config, c)
    assert m.metrics["decode_tok_s"].median > 0
    assert m.metrics["aggregate_tok_s"].median > 0 and m.metrics["per_user_tok_s"].median > 0
    assert m.metrics["prefill_tok_s"].median > 0 and m.metrics["ttft_ms"].median > 0
    a = m.attrs
    assert {"model_buffer_mib", "kv_buffer_mib", "compute_buffer_mib"} <= set(a)
    assert a["spilled"] is False and a["engine_version"].startswith("llama.cpp")
    assert " -c 1200 -np 2 " in a["command"]
    # What ran is what a user is told to run.
    assert without_port(a["argv"]) == without_port(deploy_tokens(b.deploy_command(config, c))[1])
    # The engine's own timings beside the client's, and what the load generator cost.
    assert a["engine_timings"]["streams_decode_tok_s_sum"] > 0 and a["engine_timings"]["single_decode_tok_s"] > 0
    # ttft_ms is the client's (as for every backend): it includes the engine's prompt time.
    assert m.metrics["ttft_ms"].median >= a["engine_timings"]["single_prompt_ms"] > 0
    assert a["client_timings"]["aggregate_tok_s"] == pytest.approx(m.metrics["aggregate_tok_s"].median)
    assert a["client_timings"]["streams_decode_tok_s_median"] > 0
    assert a["load_generator"]["client_cpu_cores"] > 0 and a["load_generator"]["note"]
    est = b.estimate_memory(config, c)
    # Weights: the engine maps every tensor (token_embd on the host, the rest where -ngl says).
    logged_weights = sum(a["model_buffer_mib"].values()) * MiB
    assert abs(est.weights_bytes + est.host_bytes - logged_weights) <= 0.01 * logged_weights
    # KV: the logged cell count exactly, the logged MiB (2 decimals) within 1%.
    model = model_from_gguf(stories)
    assert est.kv_bytes == a["kv_cells"] * kv_bytes_per_token(model, "f16")
    logged_kv = sum(a["kv_buffer_mib"].values()) * MiB
    assert abs(est.kv_bytes - logged_kv) <= 0.01 * est.kv_bytes
    # Measured at the engine's default verbosity, as deployed: the buffers came from a launch
    # of their own, at -lv 4, which a second configuration of the same file does not repeat.
    assert "-lv" not in a["argv"] and "startup_facts_of" not in a
    other = cfg("stories260K.gguf", ctx=300, parallel=1)
    o = b.run(other, c).attrs
    assert o["startup_facts_of"] == config.key and o["model_buffer_mib"] == a["model_buffer_mib"]
    assert "kv_buffer_mib" not in o and "compute_buffer_mib" not in o  # those were another config's
    # Off (the default), a trial records none and launches once.
    assert "model_buffer_mib" not in b.run(other, make_ctx(stories)).attrs
    assert servers_on(stories) == [] and not processes.live()


@pytest.mark.parametrize(
    "weights, options, reason",
    [
        ("stories260K.gguf", {"cache_type": "q9_9"}, "q9_9"),
        ("stories260K.gguf", {"cache_type": "q8_0"}, "does not divide"),
        ("missing.gguf", {}, "missing.gguf"),
    ],
)
def test_engine_failures_carry_the_engines_reason(server_binary, stories, weights, options, reason):
    b = LlamaServerBackend()
    with pytest.raises(BackendError) as info:
        b.run(cfg(weights, **options), make_ctx(stories))
    assert "exited" in str(info.value) and reason in str(info.value)
    assert info.value.log_tail
    assert servers_on(stories) == [] and servers_on(stories.parent / "missing.gguf") == []


def test_no_server_survives_a_failed_measurement(server_binary, stories, monkeypatch):
    b = LlamaServerBackend()

    def boom(self, server):
        assert servers_on(stories), "the server should be up here"
        raise RuntimeError("client broke")

    monkeypatch.setattr(LlamaServerBackend, "base_tokens", boom)
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


def test_without_the_python_bindings_quality_is_refused_before_the_study(monkeypatch):
    """A quality metric would fail every trial without llama-cpp-python: the metric says so
    when the study is prepared (exit 2 with the remedy), and `autotune init` leaves it out."""
    import importlib.util

    from autotune_plugins.llama_server.backend import LlamaServerBackend
    from autotune_plugins.quality.metrics import KldMetric

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    why = KldMetric().supports(LlamaServerBackend())
    assert why is not None and why.startswith(
        "llama-cpp-python is not installed: run `autotune engine build llama.cpp --python`"
    )
