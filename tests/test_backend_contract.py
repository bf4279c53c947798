"""One contract, every backend: what the study relies on from a backend's ``run``.

As optuna runs one suite over every storage, this runs one over every backend there is here:
the twin, llama-server on a real CPU engine, openai-server on the same engine through its
llama-server template, ExLlamaV2 on the fake worker, and the example plugin. The measurement
is the core's (``autotune.measure.measure_engine``), so each backend must honour the study's
protocol (how many runs), its probe (multi-fidelity ends a launch after its first run), give
the five quantities of a run, and measure its default launch (the baseline) the same way.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import pytest

from autotune.engine.backend import BaseBackend, StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import PROBE_STOP, SERVING_UNITS, Protocol
from autotune.modelfiles.models import get_model, model_from_gguf
from tests.conftest import REPO, shared_file

TWO_RUNS = Protocol(warmup_runs=1, min_runs=2, max_runs=2, rel_spread_tol=1.0)


@dataclass
class Case:
    backend: BaseBackend
    config: TrialConfig
    ctx: StudyContext
    weights_for_default: str | None  # what default_launch is asked about (None: no baseline)


def twin_case(tmp_path: Path) -> Case:
    from autotune_plugins.twin import TwinLlamaCpp

    gpu = get_gpu("v100-16gb")
    ctx = StudyContext(
        gpu=gpu,
        model=get_model("qwen2.5-27b-article"),
        workload=Workload(1500, 800),
        vram_budget_bytes=gpu.vram_bytes,
        protocol=TWO_RUNS,
        settings={"noise": 0.02},
    )
    config = TrialConfig("twin-llama.cpp", "gguf:Q4_0", 4096, 2, (("cache_type", "q8_0"), ("flash_attn", True)))
    return Case(TwinLlamaCpp(), config, ctx, "gguf:Q4_0")


def _stories(tmp_path: Path) -> Path:
    path = tmp_path / "stories260K.gguf"
    shutil.copy(shared_file("models/stories260K.gguf"), path)
    return path


def llama_server_case(tmp_path: Path) -> Case:
    from tests.engine_fixtures import llama_server_binary
    from autotune_plugins.llama_server.backend import LlamaServerBackend

    llama_server_binary()  # skipped without a build (failed under AUTOTUNE_REQUIRE_ENGINE=1)
    stories = _stories(tmp_path)
    gpu = get_gpu("t4")
    ctx = StudyContext(
        gpu=gpu,
        model=model_from_gguf(stories),
        workload=Workload(32, 16),
        vram_budget_bytes=2**33,
        protocol=TWO_RUNS,
        settings={"threads": 2, "startup_timeout_s": 60},
        base_dir=tmp_path,
        for_gpu=False,
    )
    config = TrialConfig("llama-server", stories.name, 256, 2, (("cache_type", "f16"), ("flash_attn", True)))
    return Case(LlamaServerBackend(), config, ctx, stories.name)


def openai_server_case(tmp_path: Path) -> Case:
    from tests.engine_fixtures import llama_server_binary
    from autotune_plugins.openai_server.backend import OpenAIServerBackend

    binary = str(llama_server_binary())
    stories = _stories(tmp_path)
    gpu = get_gpu("t4")
    ctx = StudyContext(
        gpu=gpu,
        model=model_from_gguf(stories),
        workload=Workload(16, 16),
        vram_budget_bytes=2**33,
        protocol=TWO_RUNS,
        settings={"executable": binary, "extra_args": ["-t", "2"], "startup_timeout_s": 60},
        base_dir=tmp_path,
        for_gpu=False,
    )
    config = TrialConfig("openai-server", stories.name, 256, 2, (("cache_type", "f16"), ("flash_attn", True)))
    return Case(OpenAIServerBackend(), config, ctx, None)  # it declines a baseline: no defaults of its own


def exllamav2_case(tmp_path: Path) -> Case:
    import sys

    from tests.plugins.test_exllamav2_backend import CONFIG, FAKE, layer_tensors, write_safetensors
    from autotune.modelfiles.models import model_from_hf_config
    from autotune_plugins.exllamav2.backend import ExLlamaV2Backend

    d = tmp_path / "tiny-exl2-4.0"
    d.mkdir()
    import json

    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "tokenizer.json").write_text("{}")
    write_safetensors(
        d / "model.safetensors",
        {
            "model.embed_tokens.weight": ("F16", [512, 128]),
            **layer_tensors(0),
            **layer_tensors(1),
            "model.norm.weight": ("F16", [128]),
        },
    )
    ctx = StudyContext(
        gpu=get_gpu("h200"),
        model=model_from_hf_config(d),
        workload=Workload(64, 16),
        vram_budget_bytes=100 * 2**30,
        protocol=TWO_RUNS,
        settings={"paged": False, "worker_command": [sys.executable, str(FAKE), "ok"]},
        base_dir=tmp_path,
    )
    config = TrialConfig("exllamav2", d.name, 512, 2, (("cache_type", "q4"),))
    return Case(ExLlamaV2Backend(), config, ctx, d.name)


def exllamav3_case(tmp_path: Path) -> Case:
    import sys

    from tests.plugins.test_exllamav3_backend import FAKE, write_exl3
    from autotune.modelfiles.models import model_from_hf_config
    from autotune_plugins.exllamav3.backend import ExLlamaV3Backend

    d = write_exl3(tmp_path / "tiny-exl3-4.0")
    ctx = StudyContext(
        gpu=get_gpu("h200"),
        model=model_from_hf_config(d),
        workload=Workload(64, 16),
        vram_budget_bytes=100 * 2**30,
        protocol=TWO_RUNS,
        settings={"worker_command": [sys.executable, str(FAKE), "ok"]},
        base_dir=tmp_path,
    )
    config = TrialConfig("exllamav3", d.name, 512, 2, (("cache_type", "k4v6"),))
    return Case(ExLlamaV3Backend(), config, ctx, d.name)


def example_case(tmp_path: Path) -> Case:
    path = REPO / "examples" / "autotune-example-plugin" / "autotune_example_plugin.py"
    spec = importlib.util.spec_from_file_location("autotune_example_plugin_contract", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    gpu = get_gpu("t4")
    ctx = StudyContext(
        gpu=gpu,
        model=get_model("qwen2.5-7b"),
        workload=Workload(32, 16),
        vram_budget_bytes=gpu.vram_bytes,
        protocol=TWO_RUNS,
        settings={"scale": 65536},
    )
    config = TrialConfig("example-echo", "gguf:Q8_0", 512, 2, (("cache_type", "f16"),))
    return Case(module.EchoBackend(), config, ctx, None)


CASES: dict[str, Callable[[Path], Case]] = {
    "twin": twin_case,
    "llama-server": llama_server_case,
    "openai-server": openai_server_case,
    "exllamav2-fake-worker": exllamav2_case,
    "exllamav3-fake-worker": exllamav3_case,
    "example-plugin": example_case,
}


@pytest.fixture(params=list(CASES))
def case(request, tmp_path) -> Case:
    return CASES[request.param](tmp_path)


def assert_a_run_of_every_quantity(stats: dict[str, Any], n: int, stop: str | None = None) -> None:
    assert set(SERVING_UNITS) <= set(stats), f"missing {sorted(set(SERVING_UNITS) - set(stats))}"
    for name in SERVING_UNITS:
        s = stats[name]
        assert s.n == n, f"{name}: {s.n} runs, the protocol asked for {n}"
        assert all(math.isfinite(v) and v >= 0 for v in s.values), (name, s.values)
        if stop is not None:
            assert s.stop_reason == stop, (name, s.stop_reason)
    assert stats["aggregate_tok_s"].median > 0 and stats["decode_tok_s"].median > 0


def test_a_run_follows_the_studys_protocol(case):
    m = case.backend.run(case.config, case.ctx)
    assert_a_run_of_every_quantity(m.metrics, n=2)
    assert len(m.metrics["aggregate_tok_s"].warmups) == 1


def test_the_probe_ends_a_launch_after_its_first_run(case):
    heard: list[dict[str, float]] = []

    def probe(first_run):
        heard.append(dict(first_run))
        return False  # far below the leader: stop

    m = case.backend.run(case.config, replace(case.ctx, probe=probe))
    assert len(heard) == 1 and set(SERVING_UNITS) <= set(heard[0])  # it saw the whole first run
    assert_a_run_of_every_quantity(m.metrics, n=1, stop=PROBE_STOP)


def test_the_default_launch_is_measured_the_same_way(case):
    """The baseline (``study/baseline.py``) is a backend's default launch run like any trial."""
    if case.weights_for_default is None:
        assert case.backend.default_launch(case.config.weights, case.ctx) is None
        return
    launch = case.backend.default_launch(case.weights_for_default, case.ctx)
    assert launch is not None and launch.description
    m = case.backend.run(launch.config, case.ctx)
    assert_a_run_of_every_quantity(m.metrics, n=2)


def test_the_deploy_line_is_one_shell_line(case):
    line = case.backend.deploy_command(case.config, case.ctx)
    assert line.strip() and "\n" not in line and "\r" not in line
