"""``autotune quality`` on a real model: stories260K through llama.cpp (llama-cpp-python on the
engine build), for mmlu, ceval and kld. Skipped without the engine on a developer's machine,
failed in CI (AUTOTUNE_REQUIRE_ENGINE=1, see tests/engine_fixtures.py).

stories260K is far below chance-beating size on MMLU: these tests check the pipeline's real
figures (n scored items, accuracy in [0, 1], a standard error) and the KL proxy, not the level.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tests.conftest import plugin_registered, shared_file
from tests.engine_fixtures import llama_cpp_module, missing

import autotune_plugins.llama_server as llama_server_plugin
import autotune_plugins.quality as quality_plugin
from autotune_plugins.quality.commands import add_quality_command

if importlib.util.find_spec("lm_eval") is None:
    pytest.skip("lm-eval is not installed (pip install -e '.[test]')", allow_module_level=True)


@pytest.fixture(scope="module")
def engine_plugins():
    llama_cpp_module()  # skip or fail (CI) now, with the reason, when the bindings are missing
    with plugin_registered(llama_server_plugin, "llama_server"), plugin_registered(quality_plugin, "quality"):
        yield


@pytest.fixture(scope="module")
def stories_quants(tmp_path_factory) -> dict[str, Path]:
    """stories260K F32 and its Q8_0, Q4_0 and Q2_K quantizations made by the engine's llama-quantize."""
    from autotune.errors import AutotuneError
    from autotune_plugins.llama_server import engine
    from autotune_plugins.llama_server.synth import quantize

    try:
        engine.find_llama_quantize()
    except AutotuneError as exc:
        missing(f"no llama-quantize ({exc})")
    folder = tmp_path_factory.mktemp("stories")
    f32 = folder / "stories260K.gguf"
    shutil.copy(shared_file("models/stories260K.gguf"), f32)
    out = {"F32": f32}
    for qtype in ("Q8_0", "Q4_0", "Q2_K"):
        out[qtype] = quantize(f32, qtype, out=folder / f"stories260K-{qtype}.gguf", timeout_s=120)
    return out


def run_quality(*args: str) -> dict:
    # One thread: the scores do not depend on it, and two threads that wait for each other every
    # step made these runs slower by half at load 3 on the 2-core VM (three times at load 12).
    group = click.Group("autotune")
    add_quality_command(group)
    result = CliRunner().invoke(group, ["quality", "--backend", "llama-server", "--set", "threads=1", "--json", *args])
    assert result.exit_code == 0, result.output
    # stdout is the result alone; the progress lines go to stderr.
    assert "items, " in result.stderr or "windows, " in result.stderr
    return json.loads(result.stdout)


# (not "benchmark": pytest-benchmark owns a fixture of that name)
@pytest.mark.parametrize("bench, n_subjects", [("mmlu", 57), ("ceval", 52)])
def test_quality_command_scores_stories260k(engine_plugins, bench, n_subjects):
    weights = str(shared_file("models/stories260K.gguf"))
    out = run_quality("--weights", weights, "--benchmark", bench, "--per-subject", "1", "--shots", "0")
    assert out["benchmark"] == bench and out["n"] == n_subjects
    assert 0.0 <= out["accuracy"] <= 1.0
    # Accuracy is a count of right answers over n, and lm-eval's standard error goes with it.
    assert round(out["accuracy"] * out["n"], 6) == int(round(out["accuracy"] * out["n"]))
    p = out["accuracy"]
    assert out["stderr"] == pytest.approx((p * (1 - p) / (out["n"] - 1)) ** 0.5)
    assert out["seconds"] > 0
    assert len(out["details"]["subjects"]) == n_subjects


def test_kld_grows_as_the_bits_shrink(engine_plugins, stories_quants):
    import gguf

    ref = str(stories_quants["F32"])
    results = {
        q: run_quality("--weights", str(stories_quants[q]), "--reference", ref, "--benchmark", "kld")
        for q in ("F32", "Q8_0", "Q4_0", "Q2_K")
    }
    for out in results.values():
        assert set(out) >= {"benchmark", "n", "kld_mean", "top1_agreement", "stderr", "seconds"}
        assert out["n"] > 200
    assert results["F32"]["kld_mean"] == pytest.approx(0.0, abs=1e-9)
    assert results["F32"]["top1_agreement"] == 1.0
    assert 0.0 < results["Q8_0"]["kld_mean"] < results["Q4_0"]["kld_mean"]
    assert results["Q8_0"]["top1_agreement"] > results["Q4_0"]["top1_agreement"]
    # stories260K's rows are 64 wide, not a multiple of the 256-element k-quant block:
    # llama-quantize falls back to Q4_0 for every tensor Q2_K would take, so the two files
    # hold the same tensor types and must score the same, never better.
    types = {
        q: sorted(t.tensor_type.name for t in gguf.GGUFReader(stories_quants[q]).tensors) for q in ("Q4_0", "Q2_K")
    }
    assert types["Q2_K"] == types["Q4_0"]
    assert results["Q2_K"]["kld_mean"] == pytest.approx(results["Q4_0"]["kld_mean"], rel=1e-6)


def test_kld_without_a_reference_says_so(engine_plugins):
    group = click.Group("autotune")
    add_quality_command(group)
    weights = str(shared_file("models/stories260K.gguf"))
    result = CliRunner().invoke(
        group, ["quality", "--backend", "llama-server", "--weights", weights, "--benchmark", "kld"]
    )
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: --benchmark kld: needs --reference PATH")
