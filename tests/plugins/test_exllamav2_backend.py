"""The exllamav2 backend without a GPU: registration, space, rules, memory, and the worker protocol.

The worker protocol is exercised end to end with fake workers (``exllamav2_fake_worker.py``)
that crash, hang, die by signal or answer; the real worker is run too, where exllamav2 is
not installed, to check that it reports that instead of dying silently.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.engine.backend import StudyContext, TrialConfig, Workload, quality_reference
from autotune.errors import BackendError, ConfigError
from autotune.toolkit import processes
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol, StreamResult
from autotune.modelfiles.models import model_from_hf_config
from autotune.modelfiles.safetensors_dir import SAFETENSORS_DTYPE_BYTES, read_safetensors_header
from tests.conftest import REPO, plugin_registered

from autotune_plugins.exllamav2 import memory
from autotune_plugins.shared import protocol
from autotune_plugins.exllamav2.backend import SETTINGS, ExLlamaV2Backend, tabbyapi_args
from autotune_plugins.exllamav2.generator_settings import GeneratorSettings, generator_settings
from autotune_plugins.exllamav2.worker import (
    SCORE_CHUNK,
    attention_path,
    check_paged,
    prompt_ids,
    sample_metrics,
    score_passes,
)

FAKE = Path(__file__).with_name("exllamav2_fake_worker.py")
FAST = Protocol(warmup_runs=1, min_runs=2, max_runs=3, rel_spread_tol=0.5)

# A tiny Qwen2-shaped model: 2 layers, hidden 128, 4 heads of 32, 2 KV heads, vocab 512.
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "quantization_config": {"quant_method": "exl2", "bits": 4.0, "head_bits": 6},
}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A safetensors file written by hand: header + zero bytes. Returns the data bytes."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return offset


def layer_tensors(i: int) -> dict[str, tuple[str, list[int]]]:
    p = f"model.layers.{i}"
    return {
        f"{p}.input_layernorm.weight": ("F16", [128]),
        f"{p}.self_attn.q_proj.q_weight": ("I32", [16, 128]),
        f"{p}.self_attn.q_proj.q_scale": ("I32", [4, 128]),
        f"{p}.self_attn.q_proj.q_perm": ("I16", [128]),
        f"{p}.self_attn.q_proj.bias": ("F16", [128]),
        f"{p}.mlp.down_proj.q_weight": ("I32", [32, 128]),
    }


@pytest.fixture
def exl2_dir(tmp_path) -> Path:
    d = tmp_path / "tiny-exl2-4.0"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "tokenizer.json").write_text("{}")
    write_safetensors(
        d / "output-00001-of-00002.safetensors", {"model.embed_tokens.weight": ("F16", [512, 128]), **layer_tensors(0)}
    )
    write_safetensors(
        d / "output-00002-of-00002.safetensors",
        {
            **layer_tensors(1),
            "model.norm.weight": ("F16", [128]),
            "lm_head.q_weight": ("I32", [96, 512]),
            "lm_head.q_scale": ("I32", [8, 512]),
        },
    )
    return d


def make_ctx(base: Path, **settings) -> StudyContext:
    return StudyContext(
        gpu=get_gpu("h200"),
        model=model_from_hf_config(base / "tiny-exl2-4.0"),
        workload=Workload(prompt_tokens=64, output_tokens=16),
        vram_budget_bytes=100 * 2**30,
        protocol=FAST,
        settings={"paged": False, **settings},
        base_dir=base,
    )


def cfg(ctx: int = 512, parallel: int = 1, cache: str = "q4") -> TrialConfig:
    return TrialConfig("exllamav2", "tiny-exl2-4.0", ctx, parallel, (("cache_type", cache),))


def fake(mode: str, pidfile: Path | None = None) -> list[str]:
    return [sys.executable, str(FAKE), mode] + ([str(pidfile)] if pidfile else [])


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its reaper does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def pids_of(pidfile: Path) -> list[int]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if pidfile.is_file() and pidfile.read_text().endswith("\n"):
            return [int(p) for p in pidfile.read_text().split()]
        time.sleep(0.02)
    raise AssertionError("the fake worker never wrote its pids")


# ------------------------------------------------------------------ registration and space


def test_plugin_registers_without_torch_or_exllamav2():
    code = (
        "import sys, autotune_plugins.exllamav2 as p; from autotune_plugins.exllamav2 import backend, worker, scorer;"
        "b = []; p.register_backends(b.append); print(b[0].name, b[0].engine, len(b[0].settings),"
        " 'torch' in sys.modules, 'exllamav2' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.split() == ["exllamav2", "exllamav2", str(len(SETTINGS)), "False", "False"]


def test_registered_like_an_entry_point():
    import autotune_plugins.exllamav2 as plugin
    from autotune import plugins

    with plugin_registered(plugin, "exllamav2"):
        assert isinstance(plugins.get_backends()["exllamav2"], ExLlamaV2Backend)


def test_parameters_keep_exllamav2_cache_modes_as_given():
    b = ExLlamaV2Backend()
    (param,) = b.parameters({"cache_type": ["f16", "Q8", "q8_0", "fp16", "q4", "q8", "q4"]})
    # "Q8" is not how autotune names the mode: left for the core to report, never rewritten.
    assert param.name == "cache_type" and param.choices == ("fp16", "q4", "q8")
    assert param.accepted == ("fp16", "q8", "q6", "q4")
    assert b.parameters({"cache_type": ["q8_0"]})[0].choices == ()  # nothing of ours: no stand-in
    assert b.parameters({})[0].choices == ("fp16", "q8", "q6", "q4")
    assert quality_reference(b, {"cache_type": ("q4", "q8", "fp16")}) == {"cache_type": "fp16"}


def test_generator_settings_by_attention_support():
    paged = generator_settings("Q8", 600, 2, paged=True)
    # two jobs of 600 tokens take 3 pages each: 2 x pad256(600), not pad256(1200)
    assert (paged.mode, paged.cache_batch_size, paged.cache_max_seq_len, paged.max_batch_size) == (
        "dynamic",
        1,
        1536,
        2,
    )
    assert paged.max_seq_len == 768 and paged.cache_type == "q8"
    one = generator_settings("fp16", 600, 1, paged=False)
    assert (one.mode, one.cache_batch_size, one.cache_max_seq_len) == ("dynamic", 1, 768)
    assert (paged.jobs_at_once, one.jobs_at_once) == (2, 1)
    # unpaged, by default the dynamic generator queues the jobs in a one-sequence cache, as a server would
    queued = generator_settings("q4", 600, 4, paged=False)
    assert (queued.mode, queued.cache_batch_size, queued.cache_tokens, queued.max_batch_size) == ("dynamic", 1, 768, 4)
    assert queued.jobs_at_once == 1 and queued.to_dict()["jobs_at_once"] == 1
    many = generator_settings("q4", 600, 4, paged=False, unpaged_parallel="batched")
    assert (many.mode, many.cache_batch_size, many.cache_max_seq_len, many.cache_tokens) == ("batched", 4, 768, 3072)
    assert many.jobs_at_once == 4
    assert GeneratorSettings.from_dict(many.to_dict()) == many
    with pytest.raises(ConfigError, match="queue, batched"):
        generator_settings("q4", 600, 4, paged=False, unpaged_parallel="serial")
    with pytest.raises(ConfigError, match="FP16, Q8, Q6, Q4"):
        generator_settings("q8_0", 512, 1, paged=True)


def test_a_rope_base_exllamav2_cannot_read_is_refused(exl2_dir, tmp_path):
    # transformers 5 writes the base under rope_parameters only; ExLlamaV2 0.3.2 would use 10000
    b = ExLlamaV2Backend()
    c = make_ctx(tmp_path)
    config_file = exl2_dir / "config.json"
    config_file.write_text(json.dumps({**CONFIG, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}))
    problem = b.check_weights("tiny-exl2-4.0", c)
    assert problem and str(config_file) in problem and 'add "rope_theta": 1000000.0' in problem
    assert b.check(cfg(), c) == [problem]
    config_file.write_text(json.dumps({**CONFIG, "rope_theta": 1e6, "rope_parameters": {"rope_theta": 1e6}}))
    assert b.check_weights("tiny-exl2-4.0", c) is None


def test_scoring_passes_cover_every_token_once_and_split_where_a_server_would():
    # a continuation of 3 after a context of 7: its first row (index 6) opens the second pass
    assert score_passes(10, [0, 10 - 3 - 1]) == [(0, 6), (6, 10)]
    # a whole text in chunks; cuts outside (0, n) and repeats are ignored
    assert score_passes(150, range(0, 150, SCORE_CHUNK)) == [(0, 64), (64, 128), (128, 150)]
    assert score_passes(5, [-2, 0, 5, 9, 3, 3]) == [(0, 3), (3, 5)]
    assert score_passes(1, [0, -1]) == [(0, 1)]


def test_check_rules(exl2_dir, tmp_path):
    b = ExLlamaV2Backend()
    c = make_ctx(tmp_path)
    assert b.check(cfg(), c) == []
    assert "exceeds the model's max_position_embeddings 4096" in b.check(cfg(ctx=4100), c)[0]
    assert "at most 256 jobs" in b.check(cfg(parallel=300), c)[0]
    assert "no such directory" in b.check_weights("missing-dir", c)
    plain = tmp_path / "fp16-model"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "quantization_config"}))
    assert "quant_method 'exl2'" in b.check_weights("fp16-model", c)


def test_deploy_command_is_a_tabbyapi_launch(exl2_dir, tmp_path):
    b = ExLlamaV2Backend()
    cmd = b.deploy_command(cfg(ctx=600, parallel=4, cache="q8"), make_ctx(tmp_path, paged=True))
    assert cmd.startswith(f"{sys.executable} main.py --model-dir {tmp_path} --model-name tiny-exl2-4.0")
    assert "--max-seq-len 768 --cache-size 3072 --cache-mode Q8 --max-batch-size 4" in cmd
    # Listening on this machine only unless asked: the line says how to serve others.
    assert "--host 127.0.0.1 --port 5000" in cmd and "--host 0.0.0.0 serves other machines" in cmd
    # the deploy line serves what was measured: unpaged, one request at a time, and says so
    queued = b.deploy_command(cfg(ctx=600, parallel=4, cache="q8"), make_ctx(tmp_path))
    assert "--cache-size 768 " in queued and "serves the 4 users one at a time, as measured" in queued
    # Batched passes have no server: the line is the offline batch job that delivers them.
    batched = b.deploy_command(cfg(ctx=600, parallel=4, cache="q8"), make_ctx(tmp_path, unpaged_parallel="batched"))
    assert batched.startswith(f"{sys.executable} examples/deprecated/batched_inference.py  # an offline batch job")
    assert "ExLlamaV2Cache(batch_size=4, max_seq_len=768), cache mode Q8" in batched and "main.py" not in batched
    assert "TabbyAPI would take them one at a time" in batched
    with pytest.raises(ConfigError, match="unpaged_parallel 'serial': use one of queue, batched"):
        b.deploy_command(cfg(), make_ctx(tmp_path, unpaged_parallel="serial"))


@pytest.mark.parametrize("settings", [{"paged": True}, {}, {"unpaged_parallel": "batched"}])
def test_the_deploy_line_serves_the_generator_the_worker_was_told_to_build(exl2_dir, tmp_path, monkeypatch, settings):
    requests = tmp_path / "requests.jsonl"
    monkeypatch.setenv("EXL2_FAKE_REQUESTS", str(requests))
    monkeypatch.setenv("AUTOTUNE_ENGINE_ENV", "EXL2_FAKE_REQUESTS")  # the worker gets only what it is given
    b = ExLlamaV2Backend()
    config, c = cfg(ctx=600, parallel=4, cache="q8"), make_ctx(tmp_path, worker_command=fake("ok"), **settings)
    m = b.run(config, c)
    (load,) = [r for r in map(json.loads, requests.read_text().splitlines()) if r["op"] == "load"]
    measured = GeneratorSettings.from_dict(load["settings"])
    assert load["model_dir"] == str(exl2_dir) and m.attrs["generator"] == measured.to_dict()
    line = b.deploy_command(config, c)
    if measured.mode == "batched":  # no server: the batch job, with the measured cache's shape
        assert f"ExLlamaV2Cache(batch_size={measured.cache_batch_size}, max_seq_len={measured.max_seq_len})" in line
    else:
        assert " ".join(tabbyapi_args(measured, exl2_dir)) in line


def test_a_worker_that_builds_another_generator_fails_the_trial(exl2_dir, tmp_path):
    c = make_ctx(tmp_path, worker_command=fake("other-settings"), paged=True)
    with pytest.raises(
        BackendError, match="instead of the .* asked for, so the measurement would not be what the deploy line serves"
    ):
        ExLlamaV2Backend().run(cfg(parallel=2), c)
    assert not processes.live()


def test_the_worker_refuses_paged_settings_it_cannot_page():
    paged, unpaged = generator_settings("q8", 600, 2, paged=True), generator_settings("q8", 600, 2, paged=False)
    with pytest.raises(BackendError, match="no flash-attn >= 2.5.7 .* paged = false"):
        check_paged(paged, has_paged_attention=False, no_flash_attn=False)
    with pytest.raises(BackendError, match="the model's config turns flash-attn off"):
        check_paged(paged, has_paged_attention=True, no_flash_attn=True)
    check_paged(paged, has_paged_attention=True, no_flash_attn=False)
    check_paged(unpaged, has_paged_attention=False, no_flash_attn=True)


def test_every_setting_is_declared_with_what_it_accepts(exl2_dir, tmp_path):
    declared = {s.name: s for s in SETTINGS}
    assert set(declared) == {
        "python",
        "worker_command",
        "paged",
        "unpaged_parallel",
        "startup_timeout_s",
        "load_timeout_s",
        "request_timeout_s",
        "cuda_context_mib",
        "scoring_ctx",
        "stability_metric",
        "convert_args",
    }
    assert declared["unpaged_parallel"].choices == ("queue", "batched")
    assert declared["paged"].problem("yes") and declared["paged"].problem(True) is None
    assert declared["paged"].problem("auto") is None and declared["paged"].problem(1)
    assert "> 0" in declared["startup_timeout_s"].problem(0) and declared["load_timeout_s"].problem("soon")
    assert declared["worker_command"].problem([]) and declared["worker_command"].problem(["python", 3])
    assert 'one of "decode_tok_s"' in declared["stability_metric"].problem("tok/s")
    assert declared["scoring_ctx"].problem(0) == "must be >= 1" and declared["scoring_ctx"].problem(1) is None
    assert (
        declared["cuda_context_mib"].problem(-1.0) == "must be >= 0"
        and declared["cuda_context_mib"].problem(0.0) is None
    )
    assert "-cf: set by autotune" in declared["convert_args"].problem(["-cf", "x"])
    assert declared["convert_args"].problem(["-hsol", "16"]) is None and declared["convert_args"].problem("-l 512")
    c = make_ctx(tmp_path)
    assert ExLlamaV2Backend().setting(c, "load_timeout_s") == 900.0  # a default has one owner


def write_fake_modules(root: Path, cuda_devices: int, exllamav2: bool = True) -> None:
    """Importable stand-ins for torch (with ``cuda_devices`` devices) and, optionally, exllamav2."""
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(
        f"class cuda:\n    is_available = staticmethod(lambda: {cuda_devices} > 0)\n"
        f"    device_count = staticmethod(lambda: {cuda_devices})\n"
    )
    if exllamav2:
        (root / "exllamav2").mkdir()
        (root / "exllamav2" / "__init__.py").write_text("raise RuntimeError('preflight must not import exllamav2')\n")


def test_preflight_says_what_is_missing_without_importing_torch_here(exl2_dir, tmp_path, monkeypatch):
    b = ExLlamaV2Backend()
    c = make_ctx(tmp_path)
    bare = tmp_path / "bare"
    write_fake_modules(bare, cuda_devices=0, exllamav2=False)
    monkeypatch.setenv("PYTHONPATH", str(bare))
    (problem,) = b.preflight(c)
    assert "exllamav2 cannot be imported by" in problem and "pip install -e '.[exllamav2]'" in problem
    no_gpu = tmp_path / "no-gpu"
    write_fake_modules(no_gpu, cuda_devices=0)
    monkeypatch.setenv("PYTHONPATH", str(no_gpu))
    (problem,) = b.preflight(c)
    assert f"torch in {sys.executable} sees no CUDA device (CUDA_VISIBLE_DEVICES='0')" in problem
    ready = tmp_path / "ready"
    write_fake_modules(ready, cuda_devices=1)
    monkeypatch.setenv("PYTHONPATH", str(ready))
    assert b.preflight(c) == []
    missing_python = str(tmp_path / "no-such-python")
    assert "python = " in b.preflight(make_ctx(tmp_path, python=missing_python))[0]
    # A worker command of the user's own is theirs to vouch for.
    assert b.preflight(make_ctx(tmp_path, worker_command=fake("ok"))) == []


# ------------------------------------------------------------------ memory


def test_safetensors_headers_give_exact_bytes(exl2_dir):
    emb = 512 * 128 * 2
    layer = 128 * 2 + 16 * 128 * 4 + 4 * 128 * 4 + 128 * 2 + 128 * 2 + 32 * 128 * 4
    head = 96 * 512 * 4 + 8 * 512 * 4
    w = memory.exl2_weights(exl2_dir, tied=True)
    assert (w.host_bytes, w.head_bytes, w.gpu_bytes) == (emb, head, 2 * layer + 128 * 2 + head)
    assert not w.head_from_embedding and w.n_tensors == 1 + 12 + 1 + 2


def test_tied_model_without_head_loads_the_embedding_again(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    write_safetensors(
        d / "output.safetensors",
        {"model.embed_tokens.weight": ("F16", [512, 128]), "model.norm.weight": ("F16", [128])},
    )
    w = memory.exl2_weights(d, tied=True)
    assert w.head_from_embedding and w.gpu_bytes == 512 * 128 * 2 + 256 and w.host_bytes == 512 * 128 * 2


def test_malformed_safetensors_is_named(tmp_path):
    bad = tmp_path / "output.safetensors"
    raw = json.dumps({"x": {"dtype": "F16", "shape": [4], "data_offsets": [0, 6]}}).encode()
    bad.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(ConfigError, match=r"output.safetensors: tensor 'x': data_offsets \[0, 6\]"):
        read_safetensors_header(bad)
    bad.write_bytes(b"\x01")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        read_safetensors_header(bad)


def test_cache_bytes_follow_exllamav2_layouts(exl2_dir):
    model = model_from_hf_config(exl2_dir)  # 2 layers, 2 KV heads of 32
    values = 1 * 1024 * 2 * 2  # batch x tokens x kv heads x layers
    assert memory.cache_bytes(model, "FP16", 1, 1024).total_bytes == 2 * values * 32 * 2
    q8, q6, q4 = (memory.cache_bytes(model, c, 1, 1024) for c in ("q8", "q6", "q4"))
    scales = 2 * values * (32 // 32) * 2  # FP16 scale per 32 values, for K and V
    temp = 2 * 1024 * 64 * 2  # one FP16 K and V buffer of one layer's cache
    assert (q8.data_bytes, q8.scale_bytes, q8.temp_bytes) == (2 * values * 32, scales, temp)
    assert q6.data_bytes == values * 32 + values * 16  # K 8-bit storage, V 4-bit
    assert q4.data_bytes == 2 * values * 16


def test_estimate_puts_the_bytes_where_exllamav2_does(exl2_dir, tmp_path):
    b = ExLlamaV2Backend()
    est = b.estimate_memory(cfg(ctx=300, parallel=2, cache="q4"), make_ctx(tmp_path, paged=True, cuda_context_mib=100))
    model = model_from_hf_config(exl2_dir)
    # paged: one cache row of 2 x pad256(300) = 1024 tokens
    assert est.kv_bytes == memory.cache_bytes(model, "q4", 1, 1024).total_bytes
    assert est.weights_bytes == memory.exl2_weights(exl2_dir, True).gpu_bytes
    assert est.host_bytes == 512 * 128 * 2 and est.overhead_bytes == 100 * 2**20
    assert est.buffers_bytes >= memory.scratch_bytes(model)
    assert any("ExLlamaV2Cache_Q4(batch_size=1, max_seq_len=1024)" in n for n in est.notes)
    queued = b.estimate_memory(cfg(ctx=300, parallel=2, cache="q4"), make_ctx(tmp_path))
    assert any("ExLlamaV2Cache_Q4(batch_size=1, max_seq_len=512)" in n for n in queued.notes)
    batched = b.estimate_memory(cfg(ctx=300, parallel=2, cache="q4"), make_ctx(tmp_path, unpaged_parallel="batched"))
    assert any("ExLlamaV2Cache_Q4(batch_size=2, max_seq_len=512)" in n for n in batched.notes)


# ------------------------------------------------------------------ worker: pure parts


def test_serve_answers_every_request_and_survives_errors():
    def boom(req):
        raise RuntimeError("CUDA error: device-side assert")

    requests = [
        {"id": 1, "op": "load"},
        {"id": 2, "op": "sample"},
        {"id": 3, "op": "nope"},
        {"id": 4, "op": "tokenize"},
        {"id": 5, "op": "exit"},
        {"id": 6, "op": "load"},
    ]
    inp = io.BytesIO(b"".join(protocol.encode(r) for r in requests))
    out = io.BytesIO()
    rc = protocol.serve(
        {"load": lambda r: {"loaded": True}, "sample": boom, "tokenize": lambda r: {"x": float("nan")}}, inp, out
    )
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert rc == 0 and [r["id"] for r in replies] == [1, 2, 3, 4, 5]
    assert replies[0] == {"id": 1, "ok": True, "loaded": True}
    assert replies[1]["ok"] is False and replies[1]["type"] == "RuntimeError" and "device-side" in replies[1]["error"]
    assert "unknown op 'nope'" in replies[2]["error"]
    assert replies[3]["ok"] is False and replies[3]["type"] == "ValueError"  # NaN cannot cross
    assert protocol.serve({}, io.BytesIO(b""), io.BytesIO()) == 1  # parent gone: stop


def test_attention_path_follows_exllamav2s_order():
    assert attention_path({"flash_attn": True, "xformers": True, "sdpa": True}, paged=True) == "flash_attn_paged"
    assert attention_path({"flash_attn": True, "xformers": True, "sdpa": True}, paged=False) == "flash_attn"
    assert attention_path({"flash_attn": False, "xformers": True, "sdpa": True}, paged=False) == "xformers"
    assert attention_path({"sdpa": True}, paged=False) == "sdpa"
    assert attention_path({}, paged=False) == "matmul"


def test_prompts_differ_in_their_first_token_only():
    a, b = prompt_ids([5, 6, 7], 8, 1, 32000), prompt_ids([5, 6, 7], 8, 2, 32000)
    assert a[1:] == b[1:] == [6, 7, 5, 6, 7, 5, 6] and a[0] != b[0]
    assert prompt_ids([5], 3, 7, 100) == [7, 5, 5]  # small vocabulary: stays inside it


def test_sample_metrics_use_the_shared_definitions():
    from autotune.measure import ConcurrentResult

    single = StreamResult.from_timestamps(64, 17, 0.0, 0.05, 0.21)
    two = ConcurrentResult(streams=(single, StreamResult.from_timestamps(64, 17, 0.0, 0.1, 0.5)), wall_s=0.5)
    m = sample_metrics(single, two)
    assert m["decode_tok_s"] == pytest.approx(100.0) and m["ttft_ms"] == pytest.approx(50.0)
    assert m["aggregate_tok_s"] == pytest.approx(34 / 0.5) and m["prefill_tok_s"] == pytest.approx(1280.0)


# ------------------------------------------------------------------ worker: processes


def test_run_with_a_worker_that_answers(exl2_dir, tmp_path):
    pidfile = tmp_path / "pids"
    m = ExLlamaV2Backend().run(cfg(parallel=4), make_ctx(tmp_path, worker_command=fake("ok", pidfile)))
    assert m.metrics["aggregate_tok_s"].n >= 2 and m.metrics["aggregate_tok_s"].warmups
    assert m.metrics["decode_tok_s"].median == 100.0
    assert m.attrs["attention_path"] == "sdpa" and m.attrs["generator"]["max_batch_size"] == 4
    assert wait_gone(pids_of(pidfile)) == [] and not processes.live()


@pytest.mark.parametrize(
    "mode, settings, reason",
    [
        ("crash-on-load", {}, r"exited with code 3: died during 'load': RuntimeError: CUDA out of memory"),
        ("signal-on-sample", {}, r"was killed by SIGKILL: died during 'sample': Segmentation fault"),
        ("hang-on-load", {"load_timeout_s": 1}, r"no answer to 'load' within 1 s \(hung; killed\)"),
        ("silent", {"startup_timeout_s": 1}, r"no answer to start \(hello\) within 1 s"),
        ("error-on-sample", {}, r"'sample' failed: AssertionError: Total sequence length exceeds cache size"),
    ],
)
def test_a_failing_worker_ends_the_trial_with_its_reason_and_leaves_nothing(exl2_dir, tmp_path, mode, settings, reason):
    pidfile = tmp_path / "pids"
    c = make_ctx(tmp_path, worker_command=fake(mode, pidfile), **settings)
    started = time.monotonic()
    with pytest.raises(BackendError, match=reason) as info:
        ExLlamaV2Backend().run(cfg(), c)
    assert time.monotonic() - started < 20
    if mode in ("crash-on-load", "signal-on-sample"):
        assert info.value.log_tail.strip(), "the stderr tail travels with the error"
    assert wait_gone(pids_of(pidfile)) == [], "the worker and its child must be gone"
    assert not processes.live()


def test_garbage_on_the_protocol_stream_is_reported(exl2_dir, tmp_path):
    c = make_ctx(tmp_path, worker_command=fake("noise"), startup_timeout_s=1)
    with pytest.raises(BackendError, match="printed on its protocol stream: not a protocol line.*Loading extension"):
        ExLlamaV2Backend().run(cfg(), c)


def test_the_real_worker_says_when_exllamav2_is_missing(exl2_dir, tmp_path):
    pytest.importorskip("importlib").util.find_spec("exllamav2") is None or pytest.skip("exllamav2 is installed here")
    with pytest.raises(BackendError, match=r"'load' failed: BackendError: exllamav2 is not importable"):
        ExLlamaV2Backend().run(cfg(), make_ctx(tmp_path))
    assert not processes.live()


def test_scorer_refuses_unusable_weights(tmp_path):
    from autotune.engine.scoring import ScoringError

    (tmp_path / "tiny-exl2-4.0").mkdir()
    (tmp_path / "tiny-exl2-4.0" / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ScoringError, match="no tokenizer.json"):
        ExLlamaV2Backend().scoring.scorer("tiny-exl2-4.0", "q8", make_ctx(tmp_path))
    assert ExLlamaV2Backend().scoring is not None


def test_no_worker_survives_autotune_being_stopped(tmp_path):
    pidfile = tmp_path / "pids"
    script = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from autotune_plugins.shared.worker_process import WorkerProcess
w = WorkerProcess({fake("ok", pidfile)!r}, Path({str(tmp_path / "w.log")!r}))
w.start(10)
print("up", flush=True)
time.sleep(60)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert child.stdout.readline().strip() == "up"
        pids = pids_of(pidfile)
        assert all(alive(p) for p in pids)
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=20)
        assert wait_gone(pids) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for p in pids_of(pidfile) if pidfile.exists() else []:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("search", [None, (0.5, 8.0)], ids=["closed-loop", "rate-search"])
def test_a_workloads_requests_reach_the_worker_and_its_streams_are_scored_by_the_core(
    exl2_dir, tmp_path, monkeypatch, search
):
    from dataclasses import replace

    requests = tmp_path / "requests.jsonl"
    monkeypatch.setenv("EXL2_FAKE_REQUESTS", str(requests))
    monkeypatch.setenv("AUTOTUNE_ENGINE_ENV", "EXL2_FAKE_REQUESTS")
    lengths = ((20, 8), (60, 24), (100, 4))
    c = make_ctx(tmp_path, worker_command=fake("ok"), paged=True)
    wl = replace(
        c.workload,
        requests=lengths,
        slo=(("ttft_p95_ms", 100.0),),
        **({"arrival": "poisson", "rate_search": search} if search else {}),
    )
    m = ExLlamaV2Backend().run(cfg(parallel=2), replace(c, workload=wl))
    samples = [r for r in map(json.loads, requests.read_text().splitlines()) if r["op"] == "sample"]
    assert samples and all(r["requests"] == [list(x) for x in lengths] and r["concurrency"] == 2 for r in samples)
    # The fake worker's streams: 50 ms to the first token, then 100 tok/s, all within the target.
    assert m.metrics["ttft_p95_ms"].median == pytest.approx(50.0) and m.metrics["itl_p50_ms"].median == pytest.approx(
        10.0
    )
    assert m.metrics["goodput_req_s"].median > 0
    if search:  # every rate met the target: the search's upper bound, each run trying it first
        assert m.metrics["rate_req_s"].median == 8.0 and all(r["arrivals"] for r in samples)


class _FakeDynamicGenerator:
    """ExLlamaV2's dynamic generator as the worker drives it: jobs enqueued, ``max_batch`` of
    them stepped at once (the rest wait), one token per step each, ``eos`` at max_new_tokens."""

    def __init__(self, max_batch: int):
        self.max_batch, self.jobs, self.running, self.most = max_batch, [], [], 0

    def reset_page_table(self) -> None:
        pass

    def enqueue(self, job) -> None:
        self.jobs.append(job)

    def num_remaining_jobs(self) -> int:
        return len(self.jobs) + len(self.running)

    def iterate(self) -> list[dict]:
        while self.jobs and len(self.running) < self.max_batch:
            self.running.append(self.jobs.pop(0))
        self.most = max(self.most, len(self.running))
        out = []
        for job in list(self.running):
            job.made += 1
            done = job.made >= job.max_new_tokens
            out.append(
                {
                    "stage": "streaming",
                    "identifier": job.identifier,
                    "token_ids": _Ids(1),
                    "eos": done,
                    "new_tokens": job.made,
                }
            )
            if done:
                self.running.remove(job)
        return out


class _Ids:
    def __init__(self, n: int):
        self.n = n

    def numel(self) -> int:
        return self.n


def test_the_worker_serves_each_request_its_own_lengths_closed_loop(monkeypatch):
    import types

    from autotune_plugins.exllamav2 import worker

    class Job:
        def __init__(self, input_ids, max_new_tokens, gen_settings, identifier):
            self.prompt, self.max_new_tokens, self.identifier, self.made = input_ids, max_new_tokens, identifier, 0

    fake = types.ModuleType("exllamav2.generator")
    fake.ExLlamaV2DynamicJob = Job
    fake.ExLlamaV2Sampler = types.SimpleNamespace(Settings=types.SimpleNamespace(greedy=lambda: None))
    monkeypatch.setitem(sys.modules, "exllamav2", types.ModuleType("exllamav2"))
    monkeypatch.setitem(sys.modules, "exllamav2.generator", fake)
    engine = worker.Engine()
    engine.torch = types.SimpleNamespace(tensor=lambda rows, dtype=None: rows, long=None)
    engine.generator = _FakeDynamicGenerator(max_batch=8)
    engine.base_ids, engine.vocab = [5, 6, 7], 100
    lengths = [(20, 3), (60, 5), (100, 2), (10, 4), (30, 1)]
    streams = engine._dynamic_load(lengths, 2, None)
    # Every request to its lengths, in order; the closed loop kept 2 in flight, never more.
    assert [(s.prompt_tokens, s.output_tokens) for s in streams] == lengths
    assert engine.generator.most == 2
    assert all(s.start_s <= s.start_s + s.ttft_ms / 1000 <= s.end_s for s in streams)
    # Open loop: each request enqueued at its arrival time, whatever is in flight.
    engine.generator = _FakeDynamicGenerator(max_batch=1)
    arrivals = [0.0, 0.02, 0.04]
    streams = engine._dynamic_load(lengths[:3], 2, arrivals)
    assert [(s.prompt_tokens, s.output_tokens) for s in streams] == lengths[:3]
    assert all(s.start_s - streams[0].start_s >= a - 1e-6 for s, a in zip(streams, arrivals))
