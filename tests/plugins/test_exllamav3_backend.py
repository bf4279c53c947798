"""The exllamav3 backend without a GPU: registration, declarations, space, rules, memory
arithmetic, the deploy line, the converter's recipe, and the worker protocol through a fake
worker (``exllamav3_fake_worker.py``); the real worker is run too, where exllamav3 is not
installed, to check that it says so."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest

from autotune.modelfiles import artifacts
from autotune.engine import cache_types
from autotune.toolkit import processes
from autotune.modelfiles.artifacts import ArtifactError, ensure
from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.errors import BackendError, ConfigError
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_hf_config
from tests.conftest import REPO, plugin_registered
from tests.plugins.test_exllamav2_backend import write_fake_modules, write_safetensors

from autotune_plugins.exllamav3 import declarations, formats, memory
from autotune_plugins.exllamav3.backend import DEFAULT_CACHES, SETTINGS, ExLlamaV3Backend, tabbyapi_args
from autotune_plugins.exllamav3.generator_settings import GeneratorSettings, generator_settings, pages_per_job
from autotune_plugins.exllamav3.recipes import convert_args_problem
from autotune_plugins.exllamav3.worker import check_fits

FAKE = Path(__file__).with_name("exllamav3_fake_worker.py")
FAST = Protocol(warmup_runs=1, min_runs=2, max_runs=3, rel_spread_tol=0.5)

# A tiny Qwen2-shaped model: 2 layers, hidden 128, 4 heads of 32, 2 KV heads (kv_dim 64), vocab 512.
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
    "quantization_config": {"quant_method": "exl3", "version": "1.6.5", "bits": 4.0, "head_bits": 6},
}


def exl3_linear(key: str, n_in: int, n_out: int, bits: int) -> dict[str, tuple[str, list[int]]]:
    """One EXL3 linear layer as the converter stores it (modules/quant/exl3_lib/quantize.py)."""
    return {
        f"{key}.trellis": ("I16", [n_in // 16, n_out // 16, 16 * bits]),
        f"{key}.suh": ("F16", [n_in]),
        f"{key}.svh": ("F16", [n_out]),
    }


def layer_tensors(i: int) -> dict[str, tuple[str, list[int]]]:
    p = f"model.layers.{i}"
    return {
        f"{p}.input_layernorm.weight": ("F16", [128]),
        **exl3_linear(f"{p}.self_attn.q_proj", 128, 128, 4),
        f"{p}.self_attn.q_proj.bias": ("F16", [128]),
        **exl3_linear(f"{p}.mlp.down_proj", 256, 128, 4),
    }


def write_exl3(d: Path, config: dict = CONFIG) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    (d / "tokenizer.json").write_text("{}")
    write_safetensors(
        d / "model-00001-of-00002.safetensors", {"model.embed_tokens.weight": ("F16", [512, 128]), **layer_tensors(0)}
    )
    write_safetensors(
        d / "model-00002-of-00002.safetensors",
        {**layer_tensors(1), "model.norm.weight": ("F16", [128]), **exl3_linear("lm_head", 128, 512, 6)},
    )
    return d


@pytest.fixture
def exl3_dir(tmp_path) -> Path:
    return write_exl3(tmp_path / "tiny-exl3-4.0")


def make_ctx(base: Path, **settings) -> StudyContext:
    return StudyContext(
        gpu=get_gpu("h200"),
        model=model_from_hf_config(base / "tiny-exl3-4.0"),
        workload=Workload(prompt_tokens=64, output_tokens=16),
        vram_budget_bytes=100 * 2**30,
        protocol=FAST,
        settings=settings,
        base_dir=base,
    )


def cfg(ctx: int = 512, parallel: int = 1, cache: str = "k4v6", **options) -> TrialConfig:
    return TrialConfig("exllamav3", "tiny-exl3-4.0", ctx, parallel, (("cache_type", cache), *options.items()))


def fake(mode: str) -> list[str]:
    return [sys.executable, str(FAKE), mode]


# ------------------------------------------------------------------ registration and declarations


def test_plugin_registers_without_torch_or_exllamav3():
    code = (
        "import sys, autotune_plugins.exllamav3 as p; from autotune_plugins.exllamav3 import backend, worker;"
        "b = []; p.register_backends(b.append); print(b[0].name, b[0].engine, len(b[0].settings),"
        " 'torch' in sys.modules, 'exllamav3' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.split() == ["exllamav3", "exllamav3", str(len(SETTINGS)), "False", "False"]


def test_registered_like_an_entry_point():
    import autotune_plugins.exllamav3 as plugin
    from autotune import plugins

    with plugin_registered(plugin, "exllamav3"):
        assert isinstance(plugins.get_backends()["exllamav3"], ExLlamaV3Backend)


def test_cache_types_are_fp16_and_every_k_v_pair_from_2_to_8():
    names = [c.name for c in declarations.CACHE_TYPES]
    assert names[0] == "fp16" and len(names) == 1 + 7 * 7 and "k4v6" in names and "k2v8" in names
    assert "k1v4" not in names and "k9v9" not in names
    by = {c.name: c for c in declarations.CACHE_TYPES}
    # cache/quant.py: K bits/8 + V bits/8 per element pair, plus an FP16 scale per 32 each
    assert by["k8v8"].bytes_per_element == Fraction(17, 16) and by["k4v4"].bytes_per_element == Fraction(9, 16)
    assert by["k4v6"].bytes_per_element == Fraction(11, 16) and by["k2v2"].bytes_per_element == Fraction(5, 16)
    assert by["fp16"].bytes_per_element == 2 and by["fp16"].dequant_layers == 0 and by["k4v6"].dequant_layers == 1
    assert (by["k4v6"].bits, by["k4v4"].bits, by["k8v8"].bits, by["fp16"].bits) == (5, 4, 8, 16)
    assert declarations.tabby_cache_mode("k4v6") == "4,6" and declarations.tabby_cache_mode("FP16") == "FP16"
    with pytest.raises(ValueError):
        declarations.cache_kv_bits("q8")


def test_the_declared_sizes_are_the_memory_models_sizes(exl3_dir):
    """Two owners would drift: the declaration (the twin's, the core's) and the backend's layout."""
    model = model_from_hf_config(exl3_dir)
    for ct in declarations.CACHE_TYPES:
        k, v = declarations.cache_kv_bits(ct.name) or (None, None)
        tokens = 1024
        assert memory.cache_bytes(model, k, v, tokens) == cache_types.kv_bytes_per_token(model, ct) * tokens, ct.name


def test_fp16_is_one_type_for_both_exllamas():
    import autotune_plugins.exllamav2.declarations as exl2

    fp16_2 = next(c for c in exl2.CACHE_TYPES if c.name == "fp16")
    fp16_3 = declarations.CACHE_TYPES[0]
    assert (fp16_2.bytes_per_element, fp16_2.bits, fp16_2.dequant_layers) == (
        fp16_3.bytes_per_element,
        fp16_3.bits,
        fp16_3.dequant_layers,
    )


def test_formats_accept_the_converters_range(tmp_path, exl3_dir):
    assert formats.bpw_of("4") == 4.0 and formats.bpw_of("1.0") == 1.0 and formats.spell(3.254) == "3.25"
    for bad in ("0.5", "8.5", "four", "nan"):
        with pytest.raises(ValueError):
            formats.bpw_of(bad)
    assert formats.head_bits_ok(6) and formats.head_bits_ok(16) and formats.head_bits_ok(2.5)
    assert not formats.head_bits_ok(4.5) and not formats.head_bits_ok(9)
    assert formats.quote(exl3_dir) == ("exl3:4.0", sum(f.stat().st_size for f in exl3_dir.glob("*.safetensors")))
    bad = write_exl3(tmp_path / "bad", {**CONFIG, "quantization_config": {"quant_method": "exl3", "bits": 12}})
    with pytest.raises(
        ConfigError, match=r"bad/config.json: quantization_config.bits = 12: an EXL3 model has 1.0 to 8.0"
    ):
        formats.quote(bad)


def test_predicted_weights_follow_the_trellis_layout(exl3_dir):
    model = model_from_hf_config(exl3_dir)  # hidden 128, q 128, kv 64, ffn 256, vocab 512, tied
    w = formats.exl3_weights(model, 4.0)

    def lin(n_in, n_out, bits):  # padded to 128, trellis in*out*bits/8, suh + svh FP16
        n_in, n_out = -(-n_in // 128) * 128, -(-n_out // 128) * 128
        return n_in * n_out * bits // 8 + 2 * (n_in + n_out)

    attn = lin(128, 128, 4) + 2 * lin(128, 64, 4) + lin(128, 128, 4)
    mlp = 2 * lin(128, 256, 4) + lin(256, 128, 4)
    norms_bias = 2 * (2 * 128 + 128 + 2 * 64)
    assert w.per_layer_bytes == (attn + mlp + norms_bias,) * 2
    assert w.output_bytes == lin(128, 512, 6) and not w.embedding_on_gpu and w.embedding_bytes == 512 * 128 * 2
    assert formats.exl3_weights(model, 4.0, head_bits=16).output_bytes == 512 * 128 * 2
    with pytest.raises(ConfigError, match="exl3:<bpw> with bpw 1.0-8.0"):
        formats.exl3_weights(model, 9.0)


# ------------------------------------------------------------------ generator, space, rules


def test_a_job_reserves_its_whole_response_plus_one_token_in_pages():
    # generator/pagetable.py Sequence.prepare: ceil((prompt + max_new_tokens + 1) / 256) pages
    assert (pages_per_job(255), pages_per_job(256), pages_per_job(600)) == (1, 2, 3)
    s = generator_settings("K4V6", 600, 3)
    assert (s.cache_type, s.max_seq_len, s.cache_tokens, s.pages, s.max_batch_size) == ("k4v6", 600, 2304, 9, 3)
    assert (s.k_bits, s.v_bits, s.jobs_at_once, s.chunk_size) == (4, 6, 3, 2048)
    assert GeneratorSettings.from_dict(s.to_dict()) == s
    assert generator_settings("fp16", 256, 1).cache_tokens == 512  # 257 tokens need a second page
    with pytest.raises(ConfigError, match="exllamav3 has fp16 or k<K>v<V> with K and V from 2 to 8"):
        generator_settings("q8", 512, 1)
    with pytest.raises(ConfigError, match="chunk_size 300: must be a multiple of 256"):
        generator_settings("fp16", 512, 1, chunk_size=300)


def test_the_prefill_chunk_never_exceeds_the_cache():
    # exllamav3's loader measures with batch_shape (1, max_chunk_size) against the cache and
    # asserts it fits ("Cache too small for batch shape"): one stream of ctx 1024 on the H200
    one = generator_settings("fp16", 1024, 1)
    assert (one.cache_tokens, one.chunk_size) == (1280, 1280)
    assert generator_settings("k4v4", 1024, 4).chunk_size == 2048  # a 5,120-token cache keeps the default
    assert generator_settings("fp16", 1024, 1, chunk_size=512).chunk_size == 512


def test_the_worker_refuses_jobs_the_cache_cannot_hold_together():
    s = generator_settings("fp16", 600, 3)
    check_fits(s, 500, 100)
    with pytest.raises(ConfigError, match="exceed max_seq_len 600"):
        check_fits(s, 550, 100)
    with pytest.raises(ConfigError, match="need 9 pages; the cache has 6"):
        check_fits(replace(s, cache_tokens=1536), 500, 100)


def test_parameters_keep_exllamav3_cache_types_as_given():
    b = ExLlamaV3Backend()
    (param,) = b.parameters({"cache_type": ["q8", "k8v8", "K4V6", "fp16", "k9v9", "k8v8", 8]})
    assert param.choices == ("k8v8", "K4V6", "fp16")
    assert b.parameters({})[0].choices == DEFAULT_CACHES
    assert b.parameters({"cache_type": ["q8_0"]})[0].choices == ()  # nothing of ours: the core says so
    _, chunk = b.parameters({"chunk_size": [512, 300, 2048, "x"]})
    assert chunk.name == "chunk_size" and chunk.choices == (512, 2048)


def test_check_rules(exl3_dir, tmp_path):
    b = ExLlamaV3Backend()
    c = make_ctx(tmp_path)
    assert b.check(cfg(), c) == []
    assert "exceeds the model's max_position_embeddings 4096" in b.check(cfg(ctx=4100), c)[0]
    assert "exllamav3 has fp16 or k<K>v<V>" in b.check(cfg(cache="q4"), c)[0]
    assert "chunk_size 1000: must be a multiple of 256" in b.check(cfg(chunk_size=1000), c)[0]
    assert b.check(cfg(chunk_size=512), c) == []
    assert "no such directory" in b.check_weights("missing-dir", c)
    plain = tmp_path / "fp16-model"
    write_exl3(plain, {k: v for k, v in CONFIG.items() if k != "quantization_config"})
    assert "quant_method 'exl3'" in b.check_weights("fp16-model", c)
    exl2 = tmp_path / "exl2-model"
    write_exl3(exl2, {**CONFIG, "quantization_config": {"quant_method": "exl2", "bits": 4.0}})
    assert "quant_method 'exl3'" in b.check_weights("exl2-model", c)
    # model/config.py: one architecture, and one exllamav3 knows
    write_exl3(tmp_path / "gpt2", {**CONFIG, "architectures": ["GPT2LMHeadModel"]})
    assert "architecture 'GPT2LMHeadModel' is not one exllamav3 1.6.5 loads" in b.check_weights("gpt2", c)
    assert b.check_weights("exl3:4.0", c) is None  # no source: nothing to say before it is made
    gpt2_source = replace(c, source=tmp_path / "gpt2")
    assert "GPT2LMHeadModel" in b.check_weights("exl3:4.0", gpt2_source)


def test_every_setting_is_declared_with_what_it_accepts(tmp_path, exl3_dir):
    declared = {s.name: s for s in SETTINGS}
    assert declared["chunk_size"].problem(300) and declared["chunk_size"].problem(512) is None
    assert declared["head_bits"].problem(4.5) and declared["head_bits"].problem(16.0) is None
    assert "-b: set by autotune" in declared["convert_args"].problem(["-b", "3"])
    assert "-w: set by autotune" in convert_args_problem(["-w", "/tmp"])
    assert declared["convert_args"].problem(["-cr", "100"]) is None
    assert declared["scoring_ctx"].problem(0) == "must be >= 1" and declared["scoring_ctx"].problem(1) is None
    assert (
        declared["cuda_context_mib"].problem(-1.0) == "must be >= 0"
        and declared["cuda_context_mib"].problem(0.0) is None
    )
    assert ExLlamaV3Backend().setting(make_ctx(tmp_path), "chunk_size") == 2048


# ------------------------------------------------------------------ memory


def test_directory_weights_are_its_tensor_bytes(exl3_dir):
    layer = 128 * 2 + (8 * 8 * 64 * 2 + 2 * 128 + 2 * 128) + 128 * 2 + (16 * 8 * 64 * 2 + 2 * 256 + 2 * 128)
    head = 8 * 32 * 96 * 2 + 2 * 128 + 2 * 512
    w = memory.exl3_dir_weights(exl3_dir, tied=True)
    assert (w.host_bytes, w.gpu_bytes) == (512 * 128 * 2, 2 * layer + 128 * 2 + head)
    assert not w.head_from_embedding and w.n_tensors == 1 + 2 * 8 + 1 + 3


def test_cache_bytes_follow_exllamav3s_layouts(exl3_dir):
    model = model_from_hf_config(exl3_dir)  # 2 layers, kv_dim 64
    assert memory.cache_bytes(model, None, None, 1024) == 2 * 2 * 1024 * 64 * 2  # K, V, FP16, layers
    words = 64 // 32
    # CacheLayer_quant: int32 (token_dim // 32 * bits) for K and V, FP16 (token_dim // 32) scales for each
    assert memory.cache_bytes(model, 4, 6, 1024) == 2 * (1024 * words * (4 + 6) * 4 + 2 * 1024 * words * 2)


def test_estimate_puts_the_bytes_where_exllamav3_does(exl3_dir, tmp_path):
    b = ExLlamaV3Backend()
    model = model_from_hf_config(exl3_dir)
    c = make_ctx(tmp_path, cuda_context_mib=100)
    est = b.estimate_memory(cfg(ctx=300, parallel=2, cache="k4v6"), c)
    cache = memory.cache_bytes(model, 4, 6, 2 * 512)  # 2 jobs x 2 pages
    # the loader's measuring pass stages 256 pages of FP16 K and V; its fp32 accumulator beside,
    # for the chunk cut to the 1,024-token cache
    staging = 2 * 65536 * 64 * 2 + 1024 * 4 * 32 * 4
    assert est.kv_bytes == cache + staging
    assert est.weights_bytes == memory.exl3_dir_weights(exl3_dir, True).gpu_bytes
    assert est.host_bytes == 512 * 128 * 2 and est.overhead_bytes == 100 * 2**20
    fp16 = b.estimate_memory(cfg(ctx=300, parallel=2, cache="fp16"), c)
    assert fp16.kv_bytes == memory.cache_bytes(model, None, None, 1024)  # no staging for an FP16 cache
    attn, mlp, logits = memory.transient_bytes(model, generator_settings("fp16", 300, 2))
    assert fp16.buffers_bytes == max(attn, mlp) + logits
    # a chunk of 144 rows or fewer reconstructs nothing (modules/quant/exl3.py); 1024 reconstructs
    _, small, _ = memory.transient_bytes(model, generator_settings("fp16", 300, 2, chunk_size=256))
    assert mlp - 1024 * (128 * 2 + 2 * 256 * 2) == 2 * 128 * 256 and small < mlp
    assert any("1024 tokens (4 pages of 256)" in n for n in est.notes)


# ------------------------------------------------------------------ deploy line and worker


def test_deploy_command_is_a_tabbyapi_launch(exl3_dir, tmp_path):
    b = ExLlamaV3Backend()
    cmd = b.deploy_command(cfg(ctx=600, parallel=4, cache="k4v6"), make_ctx(tmp_path))
    assert cmd.startswith(
        f"{sys.executable} main.py --model-dir {tmp_path} --model-name tiny-exl3-4.0 --backend exllamav3"
    )
    assert (
        "--max-seq-len 600 --cache-size 3072 --cache-mode 4,6 --max-batch-size 4 --chunk-size 2048 "
        "--output-chunking false --cuda-malloc-async false"
    ) in cmd
    assert "--host 127.0.0.1 --port 5000" in cmd and "--host 0.0.0.0 serves other machines" in cmd
    assert "--cache-mode FP16" in b.deploy_command(cfg(cache="fp16", chunk_size=512), make_ctx(tmp_path))


def test_the_deploy_line_serves_the_generator_the_worker_was_told_to_build(exl3_dir, tmp_path, monkeypatch):
    requests = tmp_path / "requests.jsonl"
    monkeypatch.setenv("EXL3_FAKE_REQUESTS", str(requests))  # EXL3_* reaches the worker (its own switches)
    b = ExLlamaV3Backend()
    config, c = cfg(ctx=600, parallel=4, cache="k8v8"), make_ctx(tmp_path, worker_command=fake("ok"))
    m = b.run(config, c)
    (load,) = [r for r in map(json.loads, requests.read_text().splitlines()) if r["op"] == "load"]
    measured = GeneratorSettings.from_dict(load["settings"])
    assert load["model_dir"] == str(exl3_dir) and m.attrs["generator"] == measured.to_dict()
    assert " ".join(tabbyapi_args(measured, exl3_dir)) in b.deploy_command(config, c)
    # the parent computes each run's metrics from the worker's requests (the fake's request alone
    # decodes at 100 + its sample number tok/s: the warm-up is sample 1)
    assert m.metrics["aggregate_tok_s"].n >= 2 and m.metrics["decode_tok_s"].values == (102.0, 103.0)
    assert m.attrs["engine_version"] == "exllamav3 1.6.5-fake" and not processes.live()


@pytest.mark.parametrize(
    "mode, settings, reason",
    [
        (
            "other-settings",
            {},
            r"instead of the .* asked for, so the measurement would not be what the deploy line serves",
        ),
        ("crash-on-load", {}, r"exited with code 3: died during 'load': torch.OutOfMemoryError"),
        ("hang-on-load", {"load_timeout_s": 1}, r"no answer to 'load' within 1 s \(hung; killed\)"),
    ],
)
def test_a_failing_worker_ends_the_trial_with_its_reason(exl3_dir, tmp_path, mode, settings, reason):
    with pytest.raises(BackendError, match=reason):
        ExLlamaV3Backend().run(cfg(parallel=2), make_ctx(tmp_path, worker_command=fake(mode), **settings))
    assert not processes.live()


def test_the_real_worker_says_when_exllamav3_is_missing(exl3_dir, tmp_path):
    import importlib.util

    if importlib.util.find_spec("exllamav3") is not None:
        pytest.skip("exllamav3 is installed here")
    with pytest.raises(
        BackendError,
        match=r"'load' failed: BackendError: exllamav3 is not importable .*"
        r"pip install -e '.\[exllamav3\]'",
    ):
        ExLlamaV3Backend().run(cfg(), make_ctx(tmp_path))
    assert not processes.live()


def test_preflight_says_what_is_missing_without_importing_torch_here(exl3_dir, tmp_path, monkeypatch):
    b = ExLlamaV3Backend()
    c = make_ctx(tmp_path)
    bare = tmp_path / "bare"
    write_fake_modules(bare, cuda_devices=1, exllamav2=False)
    monkeypatch.setenv("PYTHONPATH", str(bare))
    (problem,) = b.preflight(c)
    assert "exllamav3 cannot be imported by" in problem and "pip install -e '.[exllamav3]'" in problem
    assert "nvcc" in problem
    ready = tmp_path / "ready"
    write_fake_modules(ready, cuda_devices=1, exllamav2=False)
    (ready / "exllamav3").mkdir()
    (ready / "exllamav3" / "__init__.py").write_text("raise RuntimeError('preflight must not import exllamav3')\n")
    (ready / "torch" / "utils").mkdir()
    (ready / "torch" / "utils" / "__init__.py").write_text("")
    (ready / "torch" / "utils" / "cpp_extension.py").write_text(
        "import os\nCUDA_HOME = os.environ.get('FAKE_CUDA_HOME')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(ready))
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no nvcc to be found
    (problem,) = b.preflight(c)
    assert "no prebuilt extension and no CUDA toolkit is found" in problem
    monkeypatch.setenv("FAKE_CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setenv("AUTOTUNE_ENGINE_ENV", "FAKE_CUDA_HOME")
    assert b.preflight(c) == []
    assert b.preflight(make_ctx(tmp_path, worker_command=fake("ok"))) == []


# ------------------------------------------------------------------ the converter's recipe

# The converter's stand-in: python -m exllamav3.conversion.convert_model ARGS, logged to $CONVERT_LOG.
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from tests.plugins.test_exllamav3_backend import CONFIG, write_exl3
args = sys.argv[1:]
assert args[:2] == ["-m", "exllamav3.conversion.convert_model"], args
opt = dict(zip(args[2::2], args[3::2]))
with open(os.environ["CONVERT_LOG"], "a") as log:
    log.write(json.dumps(opt) + "\\n")
assert Path(opt["-w"]).is_dir() or not Path(opt["-w"]).exists()
if os.environ.get("CONVERT_REFUSE"):  # as convert_model.py does: an error line, exit status 0
    print(" !! Error: --bits must be between 1 and 8")
    sys.exit(0)
write_exl3(Path(opt["-o"]), {{**CONFIG, "quantization_config": {{"quant_method": "exl3", "bits": float(opt["-b"]),
                                                              "head_bits": float(opt["-hb"])}}}})
"""


@pytest.fixture
def source_ctx(tmp_path, monkeypatch) -> StudyContext:
    source = tmp_path / "tiny-fp16"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "quantization_config"}))
    (source / "tokenizer.json").write_text("{}")
    write_safetensors(source / "model.safetensors", {"model.embed_tokens.weight": ("F16", [512, 128])})
    python = tmp_path / "fake-python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CONVERT_LOG", str(tmp_path / "convert.log"))
    monkeypatch.setenv("AUTOTUNE_ENGINE_ENV", "CONVERT_LOG,CONVERT_REFUSE")
    monkeypatch.setenv(artifacts.ARTIFACTS_ENV, str(tmp_path / "cache"))
    artifacts._failed.clear()
    return StudyContext(
        gpu=get_gpu("h200"),
        model=model_from_hf_config(source),
        workload=Workload(64, 16),
        vram_budget_bytes=100 * 2**30,
        protocol=Protocol(),
        settings={"python": str(python)},
        base_dir=tmp_path,
        source=source,
    )


def test_each_bitrate_is_one_conversion_with_the_converters_own_flags(source_ctx, tmp_path):
    b = ExLlamaV3Backend()
    before = b.estimate_memory(TrialConfig("exllamav3", "exl3:4.0", 512, 1, (("cache_type", "k8v8"),)), source_ctx)
    assert "not converted yet" in before.notes[0]
    made = {bpw: ensure(b, f"exl3:{bpw}", source_ctx) for bpw in ("2.5", "4")}
    log = [json.loads(line) for line in (tmp_path / "convert.log").read_text().splitlines()]
    assert [(c["-b"], c["-hb"], c["-i"]) for c in log] == [
        ("2.5", "6", str(source_ctx.source)),
        ("4.0", "6", str(source_ctx.source)),
    ]
    for bpw, a in made.items():
        assert a.path == b.weights_path(f"exl3:{bpw}", source_ctx) and b.check_weights(str(a.path), source_ctx) is None
    assert ensure(b, "exl3:4.0", source_ctx).path == made["4"].path and len(log) == 2  # made once
    after = b.estimate_memory(TrialConfig("exllamav3", "exl3:4.0", 512, 1, (("cache_type", "k8v8"),)), source_ctx)
    assert "model-00001-of-00002.safetensors" in after.notes[0]
    assert b.check_weights(str(source_ctx.source), source_ctx) is None  # the FP16 source loads as it is
    other_head = replace(source_ctx, settings={**source_ctx.settings, "head_bits": 8.0})
    assert ensure(b, "exl3:4.0", other_head).path != made["4"].path  # another artifact


def test_a_converter_that_refuses_its_arguments_and_exits_0_fails_the_artifact(source_ctx, monkeypatch):
    monkeypatch.setenv("CONVERT_REFUSE", "1")
    with pytest.raises(ArtifactError, match="wrote no EXL3 config.json"):
        ensure(ExLlamaV3Backend(), "exl3:4.0", source_ctx)


def test_default_launch_is_tabbyapis_and_odd_kv_widths_refuse_a_quantized_cache(exl3_dir, tmp_path):
    b = ExLlamaV3Backend()
    c = make_ctx(tmp_path)
    default = b.default_launch("tiny-exl3-4.0", c)
    assert (default.config.ctx, default.config.parallel, default.config.option("cache_type")) == (4096, 1, "fp16")
    assert "TabbyAPI's exllamav3 defaults" in default.description
    # one KV head of 48: K/V rows of 48 values cannot be packed in groups of 32
    write_exl3(tmp_path / "odd", {**CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 48})
    odd = TrialConfig("exllamav3", "odd", 512, 1, (("cache_type", "k4v4"),))
    assert "K/V width 48 is not a multiple of 32" in b.check(odd, c)[0]
    assert b.check(replace(odd, options=(("cache_type", "fp16"),)), c) == []


def test_a_workloads_requests_reach_the_worker_and_its_requests_are_scored_by_the_core(exl3_dir, tmp_path, monkeypatch):
    from dataclasses import replace

    requests = tmp_path / "requests.jsonl"
    monkeypatch.setenv("EXL3_FAKE_REQUESTS", str(requests))
    lengths = ((20, 8), (60, 24), (100, 4))
    c = make_ctx(tmp_path, worker_command=fake("ok"))
    wl = replace(c.workload, requests=lengths, slo=(("ttft_p95_ms", 30.0),))
    m = ExLlamaV3Backend().run(cfg(parallel=2), replace(c, workload=wl))
    samples = [r for r in map(json.loads, requests.read_text().splitlines()) if r["op"] == "sample"]
    assert samples and all(r["requests"] == [list(x) for x in lengths] and r["concurrency"] == 2 for r in samples)
    # The fake's requests: 40 ms to the first token, each past the 30 ms target: no goodput.
    assert m.metrics["ttft_p95_ms"].median == pytest.approx(40.0) and m.metrics["goodput_req_s"].median == 0


def test_the_worker_runs_exllamav3_jobs_through_the_shared_request_loop(monkeypatch):
    """exllamav3's worker, as far as it runs without a GPU: its jobs (exllamav3's ``Job`` with a
    sampler) through the request loop it shares with ExLlamaV2's worker, and ``sample``'s answer."""
    import types

    from tests.plugins.test_exllamav2_backend import _FakeDynamicGenerator

    from autotune_plugins.exllamav3 import worker

    class Job:
        def __init__(self, input_ids, max_new_tokens, sampler, identifier):
            assert isinstance(sampler, Argmax)
            self.prompt, self.max_new_tokens, self.identifier, self.made = input_ids, max_new_tokens, identifier, 0

    class Argmax:
        pass

    fake = types.ModuleType("exllamav3")
    fake.Job, fake.ArgmaxSampler = Job, Argmax
    monkeypatch.setitem(sys.modules, "exllamav3", fake)
    engine = worker.Engine()
    cuda = types.SimpleNamespace(max_memory_allocated=lambda: 7, max_memory_reserved=lambda: 9)
    engine.torch = types.SimpleNamespace(tensor=lambda rows, dtype=None: rows, long=None, cuda=cuda)
    engine.base_ids, engine.vocab = [5, 6, 7], 2000
    engine.settings = generator_settings("fp16", 512, 2, 256)
    engine.generator = gen = _FakeDynamicGenerator(max_batch=8)
    enqueued = []
    monkeypatch.setattr(gen, "enqueue", lambda job: (enqueued.append(job), gen.jobs.append(job)))
    lengths = [(20, 3), (60, 5), (100, 2), (10, 4), (30, 1)]
    streams = engine.run_load(lengths, 2, None)
    assert [(s.prompt_tokens, s.output_tokens) for s in streams] == lengths
    assert gen.most == 2  # the closed loop kept 2 in flight, though the generator takes 8
    assert [len(j.prompt[0]) for j in enqueued] == [p for p, _ in lengths]
    assert len({j.prompt[0][0] for j in enqueued}) == len(lengths)  # each prompt its own first token
    # sample: the request alone, then max_batch_size (2) copies of it, the parent's fields.
    reply = engine.sample({"prompt_tokens": 40, "output_tokens": 6})
    assert reply["single"]["output_tokens"] == 6 and len(reply["streams"]) == 2
    assert (reply["max_allocated_bytes"], reply["max_reserved_bytes"]) == (7, 9)
    assert {"aggregate_tok_s", "ttft_ms", "e2e_p95_ms"} <= set(reply["metrics"])  # the core's serving_metrics
    with pytest.raises(ConfigError, match="exceed max_seq_len"):
        engine.sample({"prompt_tokens": 40, "output_tokens": 6, "requests": [[500, 100]]})
