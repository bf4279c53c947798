"""The openai-server backend: templates as data, checked up front; a real CPU study through the
llama-server template (launch, load, tear-down, deploy line, a failing command's log tail,
quality through logprobs) and the native llama-server backend sent the same load (its throughput
ratio printed).

The engine tests need a llama.cpp build (``autotune engine build llama.cpp --cpu --python``);
CI sets AUTOTUNE_REQUIRE_ENGINE=1, so there they fail rather than skip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import optuna
import pytest

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.errors import BackendError, ConfigError
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol, openai_api
from autotune.measure.openai_api import ServerCounters, disagreements, parse_prometheus
from autotune.modelfiles.models import model_from_gguf
from autotune.engine.scoring import ScoringUnsupportedError
from autotune.study.records import TrialRecord
from tests.engine_fixtures import STORIES, RecordedRequests, llama_cpp_module, llama_server_binary
from tests.plugins.test_cpu_tiny_study import TINY
from tests.plugins.test_llama_server_backend import servers_on

from autotune_plugins.llama_server import trial_run as llama_backend  # where the measurement (post_events) lives
from autotune_plugins.llama_server.backend import LlamaServerBackend
from autotune_plugins.llama_server.synth import write_model
from autotune_plugins.openai_server.backend import OpenAIServerBackend
from autotune_plugins.openai_server.templates import load_template, shipped, template_path

FAST = Protocol(warmup_runs=1, min_runs=3, max_runs=3, rel_spread_tol=0.5)


def make_ctx(base: Path, gpu: str = "t4", model: Path = STORIES, **settings) -> StudyContext:
    return StudyContext(
        gpu=get_gpu(gpu),
        model=model_from_gguf(model),
        workload=Workload(16, 32),
        vram_budget_bytes=get_gpu(gpu).vram_bytes - 2**30,
        protocol=FAST,
        settings=settings,
        base_dir=base,
        for_gpu=False,
    )


def cfg(weights: str, parallel: int = 1, ctx: int = 256, **options) -> TrialConfig:
    return TrialConfig("openai-server", weights, ctx, parallel, tuple(sorted(options.items())))


# ------------------------------------------------------------------ templates, without an engine


def test_every_shipped_template_renders_to_an_argument_list(tmp_path):
    assert shipped() == ["llama-server", "sglang", "tabbyapi", "tabbyapi-exllamav3", "tgi", "vllm"]
    (tmp_path / "model").mkdir()
    shutil.copy(STORIES, tmp_path / "m.gguf")
    b = OpenAIServerBackend()
    for name in shipped():
        t = load_template(template_path(name, tmp_path))
        assert t.docs.startswith("https://") and all(r.source for r in t.rules)
        weights = "m.gguf" if t.weights == "file" else "model"
        options = {"cache_type": next(iter(t.cache_type))}
        if t.flash_attn:
            options["flash_attn"] = next(iter(t.flash_attn))
        argv = b.argv(
            cfg(weights, 4, 1024, **options),
            make_ctx(tmp_path, template=name),
            host="127.0.0.1",
            port=8123,
            has_gpu=False,
        )
        assert not any("{" in a for a in argv), (name, argv)
        assert "8123" in argv and str(tmp_path) in " ".join(argv)
        assert str(1024) in argv or "4096" in argv  # ctx of one sequence, or the shared total
    vllm = b.argv(
        cfg("model", 4, 1024, cache_type="fp8", flash_attn=True),
        make_ctx(tmp_path, template="vllm"),
        host="127.0.0.1",
        port=8000,
        has_gpu=False,
    )
    assert vllm[:3] == [shutil.which("vllm") or "vllm", "serve", str(tmp_path / "model")]
    for flag, value in (
        ("--max-model-len", "1024"),
        ("--max-num-seqs", "4"),
        ("--kv-cache-dtype", "fp8"),
        ("--gpu-memory-utilization", "0.9"),
    ):
        assert vllm[vllm.index(flag) + 1] == value
    spec = '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}'  # a JSON value passes whole
    vllm = b.argv(
        cfg("model", 1, 1024, cache_type="auto", flash_attn=True, speculative_config=spec),
        make_ctx(tmp_path, template="vllm"),
        host="127.0.0.1",
        port=8000,
        has_gpu=False,
    )
    assert vllm[vllm.index("--speculative-config") + 1] == spec
    sglang = b.argv(
        cfg(
            "model",
            1,
            1024,
            cache_type=next(iter(load_template(template_path("sglang", tmp_path)).cache_type)),
            speculative_algorithm="EAGLE",
            speculative_num_steps=3,
            speculative_num_draft_tokens=4,
        ),
        make_ctx(tmp_path, template="sglang"),
        host="127.0.0.1",
        port=8000,
        has_gpu=False,
    )
    for flag, value in (
        ("--speculative-algorithm", "EAGLE"),
        ("--speculative-num-steps", "3"),
        ("--speculative-num-draft-tokens", "4"),
    ):
        assert sglang[sglang.index(flag) + 1] == value
    tabby = b.argv(
        cfg("model", 4, 1000, cache_type="k4v6", chunk_size=512),
        make_ctx(tmp_path, template="tabbyapi-exllamav3"),
        host="127.0.0.1",
        port=5000,
        has_gpu=False,
    )
    # exllamav3 reserves ceil((1000 + 1) / 256) = 4 pages a job: 4 jobs need 4096 tokens, not 4 x 1000
    for flag, value in (
        ("--backend", "exllamav3"),
        ("--max-seq-len", "1000"),
        ("--cache-size", "4096"),
        ("--cache-mode", "4,6"),
        ("--max-batch-size", "4"),
        ("--chunk-size", "512"),
        ("--output-chunking", "false"),
        ("--model-name", "model"),
    ):
        assert tabby[tabby.index(flag) + 1] == value
    llama = b.argv(
        cfg("m.gguf", 4, 1024, cache_type="q8_0", flash_attn=False, ubatch=128),
        make_ctx(tmp_path, template="llama-server"),
        host="127.0.0.1",
        port=8000,
        has_gpu=False,
    )
    for flag, value in (
        ("-c", "4096"),
        ("-np", "4"),
        ("-ctk", "q8_0"),
        ("-ctv", "q8_0"),
        ("-fa", "off"),
        ("-ub", "128"),
    ):
        assert llama[llama.index(flag) + 1] == value


def test_a_bad_placeholder_or_flag_mapping_names_the_file_and_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("""
[template]
command = ["srv", "{wieghts}", "{flash_attn}x", "{cache_type}"]
memory = "preallocated"
[cache_type]
f16 = "-ctk f16"
fp8 = 8
[flash_attn]
yes = ["-fa"]
[options]
ubatch = ["-ub", "{val}"]
[[rule]]
name = "r"
when = { kv_dtype = ["fp8"] }
reason = "no"
source = "here"
""")
    with pytest.raises(ConfigError) as err:
        load_template(bad)
    text = str(err.value)
    for expected in (
        f"{bad}: [template] command: unknown placeholder {{wieghts}}",
        "{flash_attn} must be an argument of its own",
        "[template] memory = 'preallocated'",
        f"{bad}: [cache_type] fp8 = 8: must be a list of arguments",
        f"{bad}: [flash_attn] yes: not a value this table maps (true or false)",
        f"{bad}: [options] ubatch: unknown placeholder {{val}}",
        "when kv_dtype: not an option of this template",
    ):
        assert expected in text, (expected, text)
    assert "f16 = " not in text  # a string is split into arguments, as documented


def test_a_study_with_a_bad_template_is_exit_2_before_anything_runs(tmp_path):
    shutil.copy(STORIES, tmp_path / "m.gguf")
    study = tmp_path / "s.toml"
    study.write_text(f"""[study]
name = "s"
[hardware]
gpu = "t4"
[model]
ref = "m.gguf"
[workload]
prompt_tokens = 16
output_tokens = 16
[[candidates]]
backend = "openai-server"
weights = ["m.gguf"]
[space]
ctx = [256]
parallel = [1]
[backends.openai-server]
executable = "{sys.executable}"
command = ["llama-server", "-m", "{{weights}}", "--port", "{{prot}}"]
""")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from autotune.cli import main; main()",
            "study",
            str(study),
            "--storage",
            f"sqlite:///{tmp_path / 's.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "AUTOTUNE_LOAD_PLUGINS": "openai_server"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "[backends.openai-server] command: unknown placeholder {prot}" in proc.stderr
    assert not (tmp_path / "s.db").exists()


def test_a_missing_executable_is_named_once_with_the_build_autotune_made(tmp_path, monkeypatch):
    # Issue 28: "backend openai-server: backend openai-server: ... install llama.cpp" right after
    # `autotune engine build llama.cpp`: the build is in autotune's cache, off PATH.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    ctx = make_ctx(tmp_path)
    (problem,) = OpenAIServerBackend().preflight(ctx)
    assert problem == (
        "template llama-server: 'llama-server' is not an executable here (not found on PATH): "
        "install llama.cpp, or set [backends.openai-server] executable to its path"
    )
    built = tmp_path / "cache" / "engines" / "llama.cpp-0.3.36-cpu" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    built.chmod(0o755)
    (problem,) = OpenAIServerBackend().preflight(ctx)
    assert problem.endswith(
        f'(not found on PATH): autotune\'s engine cache has one: set [backends.openai-server] executable = "{built}"'
    )
    # init names the backend once; so does a study file's candidate.
    import autotune_plugins.openai_server as openai_plugin
    from autotune.study_writer import draft_study
    from tests.conftest import plugin_registered

    with plugin_registered(openai_plugin, "openai_server"), pytest.raises(ConfigError) as raised:
        draft_study(str(STORIES), gpu="cpu")  # nothing else here can serve it: init says why, once
    assert "\n  backend openai-server: template llama-server: 'llama-server' is not an executable" in str(raised.value)
    assert str(raised.value).count("openai-server:") == 1


def test_a_pre_allocating_engine_is_admitted_by_its_fraction(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.safetensors").write_bytes(b"\0" * 1000)
    b = OpenAIServerBackend()
    h200 = get_gpu("h200")
    est = b.estimate_memory(cfg("model", 8, 4096), make_ctx(tmp_path, "h200", template="vllm"))
    assert est.total_bytes == int(0.9 * h200.vram_bytes)
    est = b.estimate_memory(cfg("model", 8, 4096), make_ctx(tmp_path, "h200", template="vllm", memory_fraction=0.5))
    assert est.total_bytes == int(0.5 * h200.vram_bytes)
    # A measured-only engine is weights + KV, to be corrected by the study's measured peaks.
    shutil.copy(STORIES, tmp_path / "m.gguf")
    est = b.estimate_memory(cfg("m.gguf", 2, 256, cache_type="f16"), make_ctx(tmp_path))
    assert est.weights_bytes == STORIES.stat().st_size and est.kv_bytes > 0 and est.overhead_bytes == 0


def test_validity_rules_and_mappings_refuse_before_launching(tmp_path):
    (tmp_path / "model").mkdir()
    shutil.copy(STORIES, tmp_path / "m.gguf")
    b = OpenAIServerBackend()
    reasons = b.check(
        cfg("model", 1, 256, cache_type="fp8", flash_attn=True), make_ctx(tmp_path, "t4", template="vllm")
    )
    assert reasons and "compute capability 8.9" in reasons[0]
    assert (
        b.check(cfg("model", 1, 256, cache_type="fp8", flash_attn=True), make_ctx(tmp_path, "h200", template="vllm"))
        == []
    )
    assert "7.0" in b.check(cfg("model", 1, 256), make_ctx(tmp_path, "p40", template="vllm"))[0]
    reasons = b.check(cfg("m.gguf", 1, 256, cache_type="q6", flash_attn=True), make_ctx(tmp_path))
    assert "template llama-server maps only f16, q8_0, q4_0" in reasons[0] and "[cache_type]" in reasons[0]
    assert "head size 8" in b.check(cfg("m.gguf", 1, 256, cache_type="q8_0", flash_attn=True), make_ctx(tmp_path))[0]


def test_an_engine_without_prompt_logprobs_refuses_quality_clearly(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(ScoringUnsupportedError, match=r"template tgi cannot score: TGI's /v1/completions has no echo"):
        OpenAIServerBackend().scoring.scorer("model", None, make_ctx(tmp_path, template="tgi"))


def test_server_metrics_beside_the_client_warn_beyond_five_percent():
    page = """# HELP vllm:generation_tokens_total x
vllm:generation_tokens_total{model_name="m"} 96.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 1.5
vllm:time_per_output_token_seconds_count{model_name="m"} 150
"""
    before = parse_prometheus(page.replace("96.0", "0").replace("1.5", "0.5").replace("150", "50"))
    after = parse_prometheus(page)
    counters = ServerCounters(
        "vllm:generation_tokens_total",
        "vllm:time_per_output_token_seconds_count",
        "vllm:time_per_output_token_seconds_sum",
    )
    server = counters.figures(before, after)
    assert server == {"generated_tokens": 96.0, "decode_tok_s": 100.0}
    assert disagreements(server, {"generated_tokens": 96.0, "decode_tok_s": 104.0}) == []
    (warning,) = disagreements(server, {"generated_tokens": 96.0, "decode_tok_s": 110.0})
    assert warning.startswith("decode_tok_s: the engine says 100, the client measured 110 (-9%)")


# ------------------------------------------------------------------ a real CPU study


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory) -> Path:
    binary = llama_server_binary()
    root = tmp_path_factory.mktemp("openai-server")
    shutil.copy(STORIES, root / "stories260K.gguf")
    (root / "study.toml").write_text(f"""[study]
name = "openai-cpu"
finish_top = 0

[hardware]
gpu = "t4"

[model]
ref = "stories260K.gguf"

[workload]
prompt_tokens = 16
output_tokens = 16

[measure]
warmup_runs = 1
min_runs = 2
max_runs = 2
rel_spread_tol = 0.5

[[candidates]]
backend = "openai-server"
weights = ["stories260K.gguf"]

[space]
ctx = [256]
parallel = [1, 2]
cache_type = ["f16", "q8_0"]
flash_attn = [true]

[backends.openai-server]
template = "llama-server"
executable = "{binary}"
extra_args = ["-t", "2"]
startup_timeout_s = 60
""")
    return root


def test_a_cpu_study_through_the_llama_server_template(study_dir):
    storage = f"sqlite:///{study_dir / 'study.db'}"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from autotune.cli import main; main()",
            "study",
            "study.toml",
            "--storage",
            storage,
            "--json",
        ],
        cwd=study_dir,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "AUTOTUNE_LOAD_PLUGINS": "openai_server"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["n_complete"] == 2  # parallel 1 and 2 with an f16 cache; q8_0 refused (head size 8)
    # ... once, before the search (issue 41): no q8_0 trial is proposed, none pruned.
    assert any(
        "[space] cache_type = 'q8_0': refused in every configuration of this study: cache_type q8_0: its "
        "block of 32 does not divide the head size 8" in line
        for line in summary["excluded_before_search"]
    )
    study = optuna.load_study(study_name="openai-cpu", storage=storage)
    for t in study.trials:
        if t.state == optuna.trial.TrialState.COMPLETE:
            m, facts = TrialRecord.of(t).metrics, TrialRecord.of(t).engine_facts
            assert m["aggregate_tok_s"]["median"] > 0 and m["aggregate_tok_s"]["n"] >= 2
            assert facts["template"] == "llama-server" and facts["engine_version"].startswith("llama-server: version")
            # The engine's own counters, read around each concurrent phase, saw the tokens the client counted.
            sm = facts["server_metrics"]
            assert sm["available"] and sm["server"]["generated_tokens"] == sm["client"]["generated_tokens"] > 0
        elif t.params.get("openai-server.cache_type") == "q8_0":
            assert t.state == optuna.trial.TrialState.PRUNED and "head size 8" in TrialRecord.of(t).prune_reason
    deploy = summary["best"]["deploy_command"]
    assert deploy.startswith(str(llama_server_binary().absolute()) + " -m " + str(study_dir / "stories260K.gguf"))
    assert (
        " -ctk f16 -ctv f16 -fa on " in deploy
        and "--port 8000" in deploy
        and deploy.endswith('[backends.openai-server] host = "0.0.0.0" serves other machines')
    )
    assert servers_on(study_dir) == []


def test_a_server_that_refuses_its_command_fails_with_its_own_log(study_dir):
    b = OpenAIServerBackend()
    ctx = make_ctx(
        study_dir, executable=str(llama_server_binary()), extra_args=["--no-such-flag"], startup_timeout_s=30
    )
    with pytest.raises(BackendError) as err:
        b.run(cfg("stories260K.gguf", 1, cache_type="f16", flash_attn=True), ctx)
    assert "llama-server server exited with code" in str(err.value)
    assert "--no-such-flag" in err.value.log_tail
    assert servers_on(study_dir) == []


# The flags of a llama-server command that change its speed, by every spelling llama-server takes.
SPEED_FLAGS = {
    "-t": "threads",
    "--threads": "threads",
    "-c": "ctx",
    "--ctx-size": "ctx",
    "-np": "slots",
    "--parallel": "slots",
    "-ctk": "cache_k",
    "--cache-type-k": "cache_k",
    "-ctv": "cache_v",
    "--cache-type-v": "cache_v",
    "-fa": "flash_attn",
    "--flash-attn": "flash_attn",
    "-b": "batch",
    "--batch-size": "batch",
    "-ub": "ubatch",
    "--ubatch-size": "ubatch",
    "-ngl": "gpu_layers",
    "--n-gpu-layers": "gpu_layers",
    "-m": "model",
    "--model": "model",
}


def _speed_flags(argv: Sequence[str]) -> dict[str, str]:
    return {SPEED_FLAGS[a]: b for a, b in zip(argv, argv[1:]) if a in SPEED_FLAGS}


def test_both_backends_send_the_native_backend_the_same_load(study_dir, monkeypatch):
    """The same configuration through openai-server's llama-server template and the native
    llama-server backend: the same server flags that set its speed (threads, context, slots,
    cache types, flash attention, batches, layers, model), the same prompt and output tokens for
    every request by the server's own count, and the same number of requests open at once. Their
    throughput ratio is printed, not asserted: on this 2-core VM it follows the neighbours (a
    tolerance of 10%, or twice the spread of one backend's two launches, failed at 11%). On a
    13M-parameter model, not stories260K: there a run is a few milliseconds of engine work, and
    the two request paths' own costs (text vs token ids, SSE parsing) decided the ratio (1.20)."""
    binary = str(llama_server_binary())
    tiny = study_dir / "tiny-f16.gguf"
    if not tiny.exists():
        write_model(TINY, tiny, vocab_from=study_dir / "stories260K.gguf", seed=0)
    config = dict(cache_type="f16", flash_attn=True)
    # Two runs of 64 tokens: what is asserted is the load each engine got, not its speed (192
    # tokens and three runs made it a quarter of a minute more on the 2-core VM, for the ratio).
    runs = Protocol(warmup_runs=1, min_runs=2, max_runs=2, rel_spread_tol=1.0)
    workload = Workload(64, 64)
    openai_ctx = replace(
        make_ctx(study_dir, executable=binary, extra_args=["-t", "1"], startup_timeout_s=30, model=tiny),
        protocol=runs,
        workload=workload,
    )
    # Not pinned, as the template's server is not: on a loaded machine a pinned engine shares its
    # one core with whatever else runs there, and the gap measured the pinning (seen: 0.73).
    native_ctx = replace(
        make_ctx(study_dir, threads=1, pin_cores=False, startup_timeout_s=30, model=tiny),
        protocol=runs,
        workload=workload,
    )
    sent = {
        "openai-server": RecordedRequests(openai_api.post_events),
        "llama-server": RecordedRequests(llama_backend.post_events),
    }
    monkeypatch.setattr(openai_api, "post_events", sent["openai-server"])
    monkeypatch.setattr(llama_backend, "post_events", sent["llama-server"])
    measured = {
        "openai-server": OpenAIServerBackend().run(cfg("tiny-f16.gguf", 2, 512, **config), openai_ctx),
        "llama-server": LlamaServerBackend().run(
            TrialConfig("llama-server", "tiny-f16.gguf", 512, 2, tuple(sorted(config.items()))), native_ctx
        ),
    }
    flags = {name: _speed_flags(m.attrs["argv"]) for name, m in measured.items()}
    if not any(m.attrs["gpu"] for m in measured.values()):  # no device to offload to: -ngl 999 and 0 alike
        for f in flags.values():
            f.pop("gpu_layers", None)
    assert flags["openai-server"] == flags["llama-server"], flags
    assert {"threads", "ctx", "slots", "cache_k", "cache_v", "flash_attn", "model"} <= set(flags["llama-server"])
    for name, requests in sent.items():
        assert requests.counts() == {(64, 64)}, (
            name,
            [r for r in requests.sent if (r.get("prompt"), r.get("output")) != (64, 64)],
        )
        assert requests.most_open == 2, name
        assert measured[name].attrs["prompt_tokens"] == 64
    # The same runs: the warm-up request, then each run (the warm-up run too) one request alone
    # and two at once.
    assert len(sent["openai-server"].sent) == len(sent["llama-server"].sent) == 1 + (1 + 2) * (1 + 2)
    rate = {name: m.metrics["aggregate_tok_s"].median for name, m in measured.items()}
    print(
        f"aggregate tok/s, 2 streams: {rate}; openai-server / llama-server = "
        f"{rate['openai-server'] / rate['llama-server']:.2f}"
    )
    assert servers_on(study_dir) == []


def test_quality_through_logprobs_matches_the_in_process_scorer(study_dir):
    llama_cpp_module()
    from autotune_plugins.llama_server.scoring import LlamaCppScorer

    # One thread each side (the log-probabilities do not depend on it; two wait for each other).
    ctx = make_ctx(study_dir, executable=str(llama_server_binary()), extra_args=["-t", "1"], scoring_ctx=256)
    requests = [("Once upon a time, there was a little girl", " named Lily."), ("The cat sat on the", " mat.")]
    text = "Once upon a time there was"
    with OpenAIServerBackend().scoring.scorer("stories260K.gguf", "f16", ctx) as served:
        got = served.loglikelihood(requests)
        tokens = served.tokenize(text, add_bos=True)
        rows = served.next_token_logprobs(tokens)
    with LlamaCppScorer(study_dir / "stories260K.gguf", "f16", {"threads": 1, "scoring_ctx": 256}) as local:
        want = local.loglikelihood(requests)
        assert local.tokenize(text, add_bos=True) == tokens
        ref = local.next_token_logprobs(tokens)
    for g, w in zip(got, want):
        assert (g.n_tokens, g.is_greedy) == (w.n_tokens, w.is_greedy)
        assert g.logprob == pytest.approx(w.logprob, abs=5e-3)
    # The server sends probabilities (their logarithm loses digits far down the tail) and evaluates
    # each prefix on top of its cache, the in-process scorer the whole window at once: the first
    # rows agree to 1e-6, later ones to about 1e-3.
    likely = ref > -12
    assert np.abs(rows[likely] - ref[likely]).max() < 1e-2
    assert np.abs(rows[0] - ref[0]).max() < 1e-4
    assert servers_on(study_dir) == []
