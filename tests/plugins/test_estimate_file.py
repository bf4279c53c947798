"""`autotune estimate --model FILE.gguf`: the memory breakdown of a real file, for a named card."""

from __future__ import annotations

import json

from click.testing import CliRunner

import autotune_plugins.llama_server as llama_plugin
import autotune_plugins.twin as twin_plugin
from autotune.cli import cli
from autotune.engine.cache_types import kv_bytes_per_token, resolve
from autotune_plugins.llama_server.declarations import CACHE_TYPES
from autotune_plugins.llama_server.formats import gguf_file_weights
from autotune.modelfiles.models import model_from_gguf
from autotune_plugins.llama_server import memory
from tests.conftest import plugin_registered, shared_file


def run(*args: str):
    with plugin_registered(llama_plugin, "llama_server"), plugin_registered(twin_plugin, "twin"):
        return CliRunner().invoke(cli, list(args), obj={})


def test_a_gguf_file_is_its_own_weights():
    path = shared_file("models/stories260K.gguf")
    result = run(
        "estimate",
        "--model",
        str(path),
        "--backend",
        "llama-server",
        "--ctx",
        "1000",
        "--parallel",
        "2",
        "--gpu",
        "t4",
        "--flash-attn",
        "--prompt-tokens",
        "600",
        "--output-tokens",
        "200",
        "--json",
    )
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)
    model = model_from_gguf(path)
    w = gguf_file_weights(path)
    # For the named card, even on a machine without it: a CUDA context, the head on the GPU.
    assert r["vram"]["overhead_bytes"] == memory.CUDA_CONTEXT_BYTES
    assert r["vram"]["weights_bytes"] == w.gpu_bytes and r["vram"]["host_bytes"] == w.embedding_bytes
    f16 = resolve("f16", CACHE_TYPES)  # llama.cpp's own declaration (the plugins are unregistered here)
    assert r["vram"]["kv_bytes"] == 2 * 1024 * kv_bytes_per_token(model, f16)  # 2 slots x pad256(1000)
    assert r["config"]["weights"] == str(path)
    assert r["predictor"] == "twin-llama.cpp" and r["predicted"]["decode_tok_s"] > 0  # its F32 type, read from the file
    text = run(
        "estimate",
        "--model",
        str(path),
        "--backend",
        "llama-server",
        "--ctx",
        "1000",
        "--gpu",
        "t4",
        "--prompt-tokens",
        "600",
        "--output-tokens",
        "200",
    )
    assert "KV: 1024 cells" in text.output and "MiB of budget 14.75 GiB" in text.output
    # The study's judge: a ctx that cannot hold the workload (1500 + 800 by default) is refused.
    refused = run("estimate", "--model", str(path), "--backend", "llama-server", "--ctx", "1000", "--gpu", "t4")
    assert refused.exit_code == 2 and "ctx 1000 cannot hold the workload" in refused.output


def test_a_catalog_model_still_needs_its_weights_format():
    result = run("estimate", "--model", "qwen2.5-7b", "--backend", "llama.cpp", "--ctx", "4096", "--gpu", "t4")
    assert result.exit_code == 2
    assert "--weights is needed" in result.output and "gguf:Q4_K_M" in result.output


def test_an_engine_name_with_a_file_reaches_the_real_backend():
    path = shared_file("models/stories260K.gguf")
    result = run(
        "estimate",
        "--model",
        str(path),
        "--backend",
        "llama.cpp",
        "--ctx",
        "1000",
        "--gpu",
        "t4",
        "--prompt-tokens",
        "600",
        "--output-tokens",
        "200",
        "--json",
    )
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)
    assert r["config"]["backend"] == "llama-server" and r["predictor"] == "twin-llama.cpp"
    assert r["resolved"] == (
        "--backend llama.cpp with a file or directory as weights: estimated by llama-server, the engine's real backend"
    )


def test_the_real_backend_name_with_a_format_reaches_the_twin():
    result = run(
        "estimate",
        "--model",
        "qwen2.5-7b",
        "--backend",
        "llama-server",
        "--weights",
        "gguf:Q4_K_M",
        "--ctx",
        "4096",
        "--gpu",
        "t4",
        "--json",
    )
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)
    assert r["config"]["backend"] == "twin-llama.cpp" and r["verdict"] == "fits"


def test_a_format_without_a_twin_installed_says_what_would_estimate_it():
    with plugin_registered(llama_plugin, "llama_server"):
        result = CliRunner().invoke(
            cli,
            [
                "estimate",
                "--model",
                "qwen2.5-7b",
                "--backend",
                "llama-server",
                "--weights",
                "gguf:Q4_K_M",
                "--ctx",
                "4096",
                "--gpu",
                "t4",
            ],
            obj={},
        )
    assert result.exit_code == 2
    assert (
        "--weights 'gguf:Q4_K_M' is a format, which only a digital twin estimates, and no backend of engine "
        "llama.cpp is one (installed: llama-server)"
    ) in result.stderr


def test_readme_file_example_is_invalid_for_a_model_of_2048_tokens():
    # The README's second estimate line, on the one GGUF file the tests ship.
    path = shared_file("models/stories260K.gguf")
    result = run(
        "estimate",
        "--model",
        str(path),
        "--backend",
        "llama-server",
        "--ctx",
        "4096",
        "--parallel",
        "4",
        "--cache",
        "q8_0",
        "--flash-attn",
        "--gpu",
        "v100-16gb",
    )
    assert result.exit_code == 2
    assert ": fits" not in result.stdout and "INVALID" in result.stdout
    # llama-server's own rule says it; the estimate does not say it a second time.
    assert result.stderr.count("exceeds the model's context length 2048") == 1
    assert "its block of 32 does not divide the head size 8" in result.stderr


def test_the_twin_named_predicts_for_the_file_itself():
    """`--model FILE.gguf --backend twin-llama.cpp`: the twin reads the file (format from its
    header, bytes from its tensor table); no real backend is put in its place."""
    path = shared_file("models/stories260K.gguf")
    result = run(
        "estimate",
        "--model",
        str(path),
        "--backend",
        "twin-llama.cpp",
        "--ctx",
        "1000",
        "--gpu",
        "t4",
        "--prompt-tokens",
        "600",
        "--output-tokens",
        "200",
        "--json",
    )
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)
    assert r["config"]["backend"] == r["predictor"] == "twin-llama.cpp" and r["resolved"] is None
    assert r["vram"]["weights_bytes"] == gguf_file_weights(path).gpu_bytes and r["predicted"]["decode_tok_s"] > 0
    # A twin of an engine that does not load GGUF files names the flag and what it loads.
    wrong = run("estimate", "--model", str(path), "--backend", "twin-exllamav2", "--ctx", "1000", "--gpu", "t4")
    assert wrong.exit_code == 2
    assert (
        f"--model '{path}': {path}: a GGUF file, which exllamav2 does not load (it loads EXL2 directories"
        in wrong.stderr
        and "or a format exl2:<bpw>)" in wrong.stderr
    )


def test_a_model_path_that_is_no_model_names_the_flag(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    result = run("estimate", "--model", str(text), "--backend", "twin-llama.cpp", "--ctx", "1000", "--gpu", "t4")
    assert result.exit_code == 2
    assert f"--model {text}: not a .gguf file, a config.json or a model directory" in result.stderr
