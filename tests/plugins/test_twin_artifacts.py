"""The twin predicts for the artifacts a real study names: EXL2 and Hugging Face directories
(GGUF files: tests/plugins/test_twin.py), and `prior = true` ranks a real ExLlamaV2 study.

The EXL2 directories are the hand-written ones of the exllamav2 backend's tests: a 2-layer
Qwen2 shape whose safetensors hold only headers and zeros.
"""

from __future__ import annotations

import json
from dataclasses import replace
import sys
from pathlib import Path

import pytest

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.errors import ConfigError
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_hf_config
from autotune.engine.formats import safetensors_dir_weights
from autotune.modelfiles.safetensors_dir import read_safetensors_dir
from autotune_plugins.exllamav2 import memory
from autotune_plugins.exllamav2.formats import exl2_quantization
from autotune_plugins.exllamav2.generator_settings import CACHE_CHOICES
from autotune_plugins.twin import TwinExllamaV2, TwinLlamaCpp, TwinMmlu, TwinVllm
from autotune_plugins.twin.formats import directory_format

# exl2_dir: the hand-written 4.0 bpw directory, a fixture here too.
from tests.plugins.test_exllamav2_backend import CONFIG, FAKE, exl2_dir, write_safetensors  # noqa: F401
from autotune.study.records import TrialRecord


def exl2_layer(i: int, bits: float) -> dict[str, tuple[str, list[int]]]:
    """One decoder layer of the tiny shape at ``bits`` per weight (q_weight rows = in x bits / 32)."""
    p = f"model.layers.{i}"
    return {
        f"{p}.input_layernorm.weight": ("F16", [128]),
        f"{p}.self_attn.q_proj.q_weight": ("I32", [int(128 * bits / 32), 128]),
        f"{p}.self_attn.q_proj.q_scale": ("I32", [4, 128]),
        f"{p}.self_attn.q_proj.q_perm": ("I16", [128]),
        f"{p}.self_attn.q_proj.bias": ("F16", [128]),
        f"{p}.mlp.down_proj.q_weight": ("I32", [int(256 * bits / 32), 128]),
    }


def make_exl2_dir(root: Path, bits: float, head_bits: int = 6) -> Path:
    """An EXL2 directory like the ``exl2_dir`` fixture's, at another bits per weight."""
    d = root / f"tiny-exl2-{bits}"
    d.mkdir()
    quant = {"quant_method": "exl2", "bits": bits, "head_bits": head_bits}
    (d / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": quant}))
    (d / "tokenizer.json").write_text("{}")
    write_safetensors(
        d / "output.safetensors",
        {
            "model.embed_tokens.weight": ("F16", [512, 128]),
            **exl2_layer(0, bits),
            **exl2_layer(1, bits),
            "model.norm.weight": ("F16", [128]),
            "lm_head.q_weight": ("I32", [128 * head_bits // 32, 512]),
        },
    )
    return d


def make_hf_dir(root: Path, dtype: str = "BF16", torch_dtype: str | None = "bfloat16") -> Path:
    """An unquantized Hugging Face directory of the same shape (tied: no lm_head tensor)."""
    d = root / "tiny-hf"
    d.mkdir()
    cfg = {k: v for k, v in CONFIG.items() if k != "quantization_config"}
    if torch_dtype:
        cfg["torch_dtype"] = torch_dtype
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = {"model.embed_tokens.weight": (dtype, [512, 128]), "model.norm.weight": (dtype, [128])}
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = (dtype, [128, 128])
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = (dtype, [128, 256])
    write_safetensors(d / "model.safetensors", tensors)
    return d


def ctx_for(base: Path, model_dir: Path, gpu: str = "h200") -> StudyContext:
    return StudyContext(
        gpu=get_gpu(gpu),
        model=model_from_hf_config(model_dir),
        workload=Workload(64, 16),
        vram_budget_bytes=100 * 2**30,
        protocol=Protocol(),
        base_dir=base,
    )


# ------------------------------------------------------------------------------ the core reader


def test_a_model_directory_reads_as_its_format_and_bytes(exl2_dir, tmp_path):
    d = read_safetensors_dir(exl2_dir)
    quant = exl2_quantization(d.config)
    assert directory_format(d) == "exl2:4.0" and (quant.bits, quant.head_bits) == (4.0, 6) and d.tied
    assert d.files == ("output-00001-of-00002.safetensors", "output-00002-of-00002.safetensors")
    w = safetensors_dir_weights(exl2_dir)
    # The same bytes the exllamav2 backend puts on the GPU and the host: one reader for both.
    exl2 = memory.exl2_weights(exl2_dir, tied=True)
    assert (w.embedding_bytes, w.output_bytes) == (exl2.host_bytes, exl2.head_bytes)
    assert w.total_bytes - w.embedding_bytes == exl2.gpu_bytes and len(w.per_layer_bytes) == 2
    assert w.per_layer_bytes[0] == w.per_layer_bytes[1] and not w.head_is_embedding
    hf = make_hf_dir(tmp_path)
    assert directory_format(read_safetensors_dir(hf)) == "gguf:BF16"
    assert safetensors_dir_weights(hf).head_is_embedding  # tied, no lm_head: the embedding serves
    # No torch_dtype: the layers' own element type.
    (hf / "config.json").write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "quantization_config"}))
    assert directory_format(read_safetensors_dir(hf)) == "gguf:BF16"
    with pytest.raises(ConfigError, match=r"no \*\.safetensors files"):
        read_safetensors_dir(tmp_path)


# ------------------------------------------------------------------------------ EXL2 directories


def test_the_exllamav2_twin_predicts_for_an_exl2_directory(exl2_dir, tmp_path):
    twin = TwinExllamaV2()
    ctx = ctx_for(tmp_path, exl2_dir)
    config = TrialConfig("twin-exllamav2", "tiny-exl2-4.0", 512, 2, (("cache_type", "q8"), ("flash_attn", True)))
    assert twin.as_format("tiny-exl2-4.0", ctx) == "exl2:4.0" and twin.check_weights("tiny-exl2-4.0", ctx) is None
    # Memory from the directory's own bytes, where ExLlamaV2 puts them: the embedding on the host.
    mem = twin.estimate_memory(config, ctx)
    exl2 = memory.exl2_weights(exl2_dir, tied=True)
    assert (mem.weights_bytes, mem.host_bytes) == (exl2.gpu_bytes, exl2.host_bytes)
    predicted = twin.predictor.predict(config, ctx)
    assert predicted["aggregate_tok_s"] > predicted["decode_tok_s"] > 0
    assert f"--model-dir {tmp_path} --model-name tiny-exl2-4.0 " in twin.deploy_command(config, ctx)
    # A 0.4M-parameter model is outside what the twin's quality model covers (0.5B to 1T): it
    # refuses to predict rather than report a drop of hundreds of points.
    with pytest.raises(ConfigError, match=r"361,600 parameters; the twin's quality model covers 0.5B to 1T"):
        TwinMmlu().evaluate(config, twin, ctx)


def test_a_lower_bpw_directory_is_predicted_smaller_and_faster(exl2_dir, tmp_path):
    twin = TwinExllamaV2()
    ctx = ctx_for(tmp_path, exl2_dir, gpu="t4")
    low = make_exl2_dir(tmp_path, 2.5, head_bits=4)
    high = TrialConfig("twin-exllamav2", "tiny-exl2-4.0", 512, 1, (("cache_type", "fp16"),))
    lower = TrialConfig("twin-exllamav2", low.name, 512, 1, (("cache_type", "fp16"),))
    assert twin.as_format(low.name, ctx) == "exl2:2.5"
    w_high, w_low = twin.scenario(high, ctx).weights, twin.scenario(lower, ctx).weights
    assert w_low.layers_bytes < w_high.layers_bytes
    assert w_low.output_bytes == 512 * 128 * 4 // 8  # the head's real bytes, at its 4 head bits
    assert twin.estimate_memory(lower, ctx).weights_bytes < twin.estimate_memory(high, ctx).weights_bytes
    assert twin.predictor.predict(lower, ctx)["decode_tok_s"] > twin.predictor.predict(high, ctx)["decode_tok_s"]


def test_what_the_twins_do_not_read_is_named_with_what_they_do(exl2_dir, tmp_path):
    ctx = ctx_for(tmp_path, exl2_dir)
    problem = TwinLlamaCpp().check_weights("tiny-exl2-4.0", ctx)
    assert problem == (
        f"{exl2_dir}: an EXL2 directory, which llama.cpp does not load (it loads GGUF files, or a format gguf:<TYPE>)"
    )
    assert "which vllm does not load" in TwinVllm().check_weights("tiny-exl2-4.0", ctx)
    hf = make_hf_dir(tmp_path)
    assert (
        "a Hugging Face directory, which exllamav2 does not load (it loads EXL2 directories"
        in TwinExllamaV2().check_weights(hf.name, ctx)
    )
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    (gptq / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": {"quant_method": "gptq"}}))
    write_safetensors(gptq / "model.safetensors", {"model.norm.weight": ("F16", [128])})
    assert (
        "quantization_config.quant_method 'gptq': the twin predicts EXL2 and EXL3 directories"
        in TwinVllm().check_weights("gptq", ctx)
    )
    wide = make_exl2_dir(tmp_path, 9.0)
    assert "quantization_config.bits = 9.0: the twin knows EXL2 at 2.0-8.0" in TwinExllamaV2().check_weights(
        wide.name, ctx
    )
    (exl2_dir / "config.json").unlink()
    assert "no config.json" in TwinExllamaV2().check_weights("tiny-exl2-4.0", ctx)


# ------------------------------------------------------------------------------ Hugging Face directories


def test_the_vllm_twin_predicts_an_unquantized_directory_as_its_element_type(exl2_dir, tmp_path):
    hf = make_hf_dir(tmp_path)
    twin = TwinVllm()
    config = TrialConfig("twin-vllm", hf.name, 512, 1, (("cache_type", "auto"), ("flash_attn", True)))
    ctx = ctx_for(tmp_path, hf)
    assert twin.as_format(hf.name, ctx) == "gguf:BF16" and twin.check_weights(hf.name, ctx) is None
    # vLLM keeps everything on the GPU: the whole directory's bytes.
    assert twin.estimate_memory(config, ctx).weights_bytes == safetensors_dir_weights(hf).total_bytes
    assert twin.predictor.predict(config, ctx)["decode_tok_s"] > 0
    assert twin.deploy_command(config, ctx).startswith(f"vllm serve {hf} ")
    # BF16 weights on a card without BF16: vLLM's own refusal, as for gguf:BF16.
    assert twin.predictor.predict(config, ctx_for(tmp_path, hf, gpu="v100-16gb")) is None


# ------------------------------------------------------------------------------ the prior


def test_exllamav2_cache_modes_are_the_twins(exl2_dir, tmp_path):
    """The prior hands the real backend's cache_type to the twin as it is: the names must agree."""
    twin = TwinExllamaV2()
    assert set(CACHE_CHOICES) == set(twin.cache_types)
    ctx = ctx_for(tmp_path, exl2_dir)
    # Each name means the same cache to both: the twin's bytes are the exllamav2 backend's.
    for cache in CACHE_CHOICES:
        config = TrialConfig("twin-exllamav2", "tiny-exl2-4.0", 1024, 1, (("cache_type", cache),))
        assert twin.estimate_memory(config, ctx).kv_bytes == memory.cache_bytes(ctx.model, cache, 1, 1024).total_bytes


def write_exl2_study(path: Path, weights: list[str], prior_trials: int) -> Path:
    fake = json.dumps([sys.executable, str(FAKE), "ok"])
    path.write_text(
        f"""[study]
name = "{path.stem}"
seed = 0
prior = true
prior_trials = {prior_trials}

[hardware]
gpu = "t4"

[model]
ref = "{weights[0]}"

[workload]
prompt_tokens = 64
output_tokens = 16

[measure]
warmup_runs = 0
min_runs = 1
max_runs = 1

[[candidates]]
backend = "exllamav2"
weights = {json.dumps(weights)}

[space]
ctx = [512]
parallel = [1]
cache_type = ["fp16", "q4"]

[backends.exllamav2]
worker_command = {fake}
paged = false
""",
        encoding="utf-8",
    )
    return path


def test_prior_ranks_a_real_exllamav2_study_over_exl2_directories(exl2_dir, tmp_path, twin_plugin):
    """`prior = true` on the real exllamav2 backend: the twin reads each EXL2 directory, the
    lower bpw is predicted faster and measured first, and the study runs (fake worker)."""
    import autotune_plugins.exllamav2 as exllamav2

    from autotune.config import load_study_config
    from autotune.study import StudyRunner, prepare_study, rank_by_prior
    from tests.conftest import plugin_registered

    low = make_exl2_dir(tmp_path, 2.5)
    path = write_exl2_study(tmp_path / "exl2-prior.toml", [exl2_dir.name, low.name], prior_trials=2)
    with plugin_registered(exllamav2, "exllamav2"):
        prepared = prepare_study(load_study_config(path), storage=f"sqlite:///{tmp_path / 'p.db'}")
        ranked = rank_by_prior(prepared)
        assert len(ranked) == 4 and {c.backend for c, _ in ranked} == {"exllamav2"}
        # Ordered by the twin's prediction for each directory, with the real backend's cache names.
        twin, ctx = TwinExllamaV2(), prepared.contexts["exllamav2"]
        for config, value in ranked:
            probe = TrialConfig("twin-exllamav2", config.weights, config.ctx, config.parallel, config.options)
            assert value == pytest.approx(twin.predictor.predict(probe, ctx)["aggregate_tok_s"])
        assert [v for _, v in ranked] == sorted((v for _, v in ranked), reverse=True)
        by_cache = {}
        for config, _ in ranked:
            by_cache.setdefault(config.option("cache_type"), []).append(config.weights)
        assert by_cache == {"fp16": [low.name, exl2_dir.name], "q4": [low.name, exl2_dir.name]}
        runner = StudyRunner(prepared)
        summary = runner.run(n_trials=3)
    assert summary.n_measured == 3
    first = [t for t in runner.study.trials if t.user_attrs.get("from_prior")]
    assert [TrialRecord.of(t).config_key for t in first] == [c.key for c, _ in ranked[:2]]


def test_the_prior_leaves_what_the_twin_cannot_speak_for_unranked(exl2_dir, tmp_path):
    """A cache mode the twin lacks, or weights it cannot read: no prediction, not a crash."""
    from autotune.study.predictor import predictor_for
    from autotune_plugins.exllamav2.backend import ExLlamaV2Backend

    real, twin = ExLlamaV2Backend(), TwinExllamaV2()
    backends = {twin.name: twin, real.name: real}
    ctx = ctx_for(tmp_path, exl2_dir)
    config = TrialConfig("exllamav2", exl2_dir.name, 512, 1, (("cache_type", "q8"),))
    predictor, predicted = predictor_for(real, config, ctx, backends)
    assert predictor is twin and predicted == twin.predictor.predict(replace(config, backend=twin.name), ctx)
    assert (
        predictor_for(real, TrialConfig("exllamav2", exl2_dir.name, 512, 1, (("cache_type", "q5"),)), ctx, backends)
        is None
    )
    (exl2_dir / "output-00002-of-00002.safetensors").write_bytes(b"\x01")  # the twin's ConfigError: no say
    assert predictor_for(real, config, ctx, backends) is None


# ------------------------------------------------------------------------------ autotune estimate


def estimate(*args: str):
    import autotune_plugins.exllamav2 as exllamav2
    import autotune_plugins.twin as twin_module
    from click.testing import CliRunner

    from autotune.cli import cli
    from tests.conftest import plugin_registered

    with plugin_registered(exllamav2, "exllamav2"), plugin_registered(twin_module, "twin"):
        return CliRunner().invoke(
            cli,
            ["estimate", "--gpu", "h200", "--ctx", "512", "--prompt-tokens", "64", "--output-tokens", "16", *args],
            obj={},
        )


def test_estimate_predicts_for_an_exl2_directory(exl2_dir):
    result = estimate("--model", str(exl2_dir), "--backend", "twin-exllamav2", "--cache", "q8", "--json")
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)
    assert r["config"]["backend"] == r["predictor"] == "twin-exllamav2" and r["verdict"] == "fits"
    assert r["vram"]["weights_bytes"] == memory.exl2_weights(exl2_dir, tied=True).gpu_bytes
    assert r["predicted"]["decode_tok_s"] > 0
    # The real backend estimates the memory; the twin, reading the same directory, the speed.
    real = json.loads(estimate("--model", str(exl2_dir), "--backend", "exllamav2", "--cache", "q8", "--json").output)
    assert real["config"]["backend"] == "exllamav2" and real["predictor"] == "twin-exllamav2"
    assert real["predicted"] == r["predicted"]
    wrong = estimate("--model", str(exl2_dir), "--backend", "twin-llama.cpp")
    assert wrong.exit_code == 2
    assert (
        f"--model '{exl2_dir}': {exl2_dir}: an EXL2 directory, which llama.cpp does not load (it loads GGUF "
        f"files, or a format gguf:<TYPE>)"
    ) in wrong.stderr


def test_estimate_predicts_for_a_hugging_face_directory(tmp_path):
    hf = make_hf_dir(tmp_path)
    result = estimate("--model", str(hf), "--backend", "vllm", "--cache", "auto", "--json")
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)
    assert r["config"]["backend"] == "twin-vllm" and r["predicted"]["decode_tok_s"] > 0
    assert r["vram"]["weights_bytes"] == safetensors_dir_weights(hf).total_bytes
