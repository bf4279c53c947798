"""Tests for autotune.engine.formats (the registry of weight formats; the GGUF and EXL2 sizes their plugins
declare) and autotune.engine.cache_types (KV-cache element types)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from pathlib import Path

import pytest

from tests.conftest import shared_file

from autotune.errors import ConfigError, UnknownNameError
from autotune.engine.cache_types import catalog, cache_bytes_per_element, cache_fixed_bytes, kv_bytes_per_token
from autotune.engine.formats import WeightsBreakdown, bits_per_weight, normalize_format, parse_format, weights_for
from autotune.modelfiles.models import get_model, model_from_gguf
from autotune_plugins.exllamav2.formats import exl2_weights
from autotune_plugins.llama_server.formats import predict_gguf_weights
from autotune_plugins.llama_server.quant import GGML_TYPES, GGUF_FILE_TYPES, gguf_tensor_plan


@pytest.fixture
def stories() -> Path:
    """llama2.c's stories260K as a GGUF file (shared/models/)."""
    return shared_file("models/stories260K.gguf")


@pytest.fixture
def article():
    return get_model("qwen2.5-27b-article")


@pytest.fixture
def qwen7b():
    return get_model("qwen2.5-7b")


# ---------------------------------------------------------------------------------- ggml types


@pytest.mark.parametrize(
    ("name", "block_bytes", "block_size"),
    [
        ("F32", 4, 1),
        ("F16", 2, 1),
        ("BF16", 2, 1),
        ("Q8_0", 34, 32),
        ("Q4_0", 18, 32),
        ("Q4_1", 20, 32),
        ("Q5_0", 22, 32),
        ("Q5_1", 24, 32),
        ("Q2_K", 84, 256),
        ("Q3_K", 110, 256),
        ("Q4_K", 144, 256),
        ("Q5_K", 176, 256),
        ("Q6_K", 210, 256),
    ],
)
def test_ggml_block_layouts(name, block_bytes, block_size):
    assert GGML_TYPES[name].block_bytes == block_bytes
    assert GGML_TYPES[name].block_size == block_size


def test_q8_k_is_not_a_file_type():
    assert "Q8_K" not in GGML_TYPES


def test_required_file_types_exist():
    for ft in ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K", "F16"):
        assert ft in GGUF_FILE_TYPES


# --------------------------------------------------------------------------------- GGUF sizes


def test_stories260k_f32_matches_the_real_file(stories):
    m = model_from_gguf(stories)
    b = predict_gguf_weights(m, "F32")
    # Tensor data is 292,800 F32 values; the file adds ~14 KB of metadata and padding.
    assert b.total_bytes == 292_800 * 4
    assert 0 < stories.stat().st_size - b.total_bytes < 20_000


def test_stories260k_odd_widths_fall_back(stories):
    # Rows of 64 do not hold 256-element K-quant blocks, rows of 172 not even 32-element ones:
    # llama.cpp falls back to Q5_0 (Q4_K's fallback) and then F16 for those.
    plan = {t.name: t.ggml_type for t in gguf_tensor_plan(model_from_gguf(stories), "Q4_K_M")}
    assert plan["blk.0.ffn_down.weight"] == "F16"
    assert plan["blk.1.attn_q.weight"] == "Q5_0"
    assert plan["output.weight"] == "Q8_0"


def test_q4_k_m_recipe_follows_llama_quant(qwen7b):
    plan = {t.name: t.ggml_type for t in gguf_tensor_plan(qwen7b, "Q4_K_M")}
    assert plan["token_embd.weight"] == "Q4_K"
    assert plan["output.weight"] == "Q6_K"
    assert plan["output_norm.weight"] == "F32"
    assert plan["blk.0.attn_q.bias"] == "F32"
    # use_more_bits(i, 28): i < 3, i >= 24, or (i - 3) % 3 == 2.
    more = {i for i in range(28) if i < 3 or i >= 24 or (i - 3) % 3 == 2}
    for i in range(28):
        want = "Q6_K" if i in more else "Q4_K"
        assert plan[f"blk.{i}.attn_v.weight"] == want
        assert plan[f"blk.{i}.ffn_down.weight"] == want
        assert plan[f"blk.{i}.ffn_up.weight"] == "Q4_K"
        assert plan[f"blk.{i}.attn_norm.weight"] == "F32"


def test_q3_k_m_and_q2_k_recipes(qwen7b):
    q3 = {t.name: t.ggml_type for t in gguf_tensor_plan(qwen7b, "Q3_K_M")}
    assert q3["blk.0.attn_v.weight"] == "Q5_K" and q3["blk.2.attn_v.weight"] == "Q4_K"
    assert q3["blk.0.ffn_down.weight"] == "Q5_K" and q3["blk.5.ffn_down.weight"] == "Q4_K"
    assert q3["blk.5.attn_output.weight"] == "Q4_K" and q3["blk.5.ffn_gate.weight"] == "Q3_K"
    q2 = {t.name: t.ggml_type for t in gguf_tensor_plan(qwen7b, "Q2_K")}
    assert q2["blk.3.attn_v.weight"] == "Q4_K"  # GQA 7 >= 4
    assert q2["blk.3.ffn_down.weight"] == "Q3_K"
    assert q2["output.weight"] == "Q6_K"
    q8 = {t.ggml_type for t in gguf_tensor_plan(qwen7b, "Q8_0") if len(t.shape) == 2}
    assert q8 == {"Q8_0"}


def test_70b_attn_v_gets_q5_k():
    plan = {t.name: t.ggml_type for t in gguf_tensor_plan(get_model("llama-2-70b"), "Q4_K_M")}
    assert plan["blk.10.attn_v.weight"] == "Q5_K"  # not a use_more_bits layer; 70B rule


def test_order_q4_k_m_over_q4_0_over_q3_k_m(qwen7b):
    sizes = {ft: predict_gguf_weights(qwen7b, ft).total_bytes for ft in ("Q4_K_M", "Q4_0", "Q3_K_M")}
    assert sizes["Q4_K_M"] > sizes["Q4_0"] > sizes["Q3_K_M"]


def test_qwen25_7b_q4_k_m_near_the_published_file():
    # Qwen's own qwen2.5-7b-instruct-q4_k_m.gguf is 4.68e9 bytes.
    total = predict_gguf_weights(get_model("qwen2.5-7b"), "Q4_K_M").total_bytes
    assert abs(total - 4.68e9) / 4.68e9 < 0.10


def test_gguf_sizes_ordered_by_type(qwen7b):
    order = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "F16", "F32"]
    sizes = [predict_gguf_weights(qwen7b, ft).total_bytes for ft in order]
    assert sizes == sorted(sizes)
    assert len(set(sizes)) == len(sizes)


def test_gguf_breakdown_parts(qwen7b):
    b = predict_gguf_weights(qwen7b, "F16")
    assert b.embedding_bytes == b.output_bytes == 2 * qwen7b.n_embedding_params
    assert len(b.per_layer_bytes) == 28
    assert b.other_bytes == 4 * 3584  # output_norm in F32
    assert b.total_bytes == b.embedding_bytes + b.output_bytes + b.layers_bytes + b.other_bytes
    # llama.cpp keeps token_embd on the host; the head and the layers go to the GPU.
    assert not b.embedding_on_gpu
    assert b.gpu_bytes == b.total_bytes - b.embedding_bytes
    assert b.host_bytes == b.embedding_bytes


def test_gguf_tied_embeddings_have_no_output_tensor(qwen7b):
    tied = dataclasses.replace(qwen7b, tie_embeddings=True)
    b = predict_gguf_weights(tied, "Q4_K_M")
    assert b.output_bytes == 0
    assert b.head_is_embedding
    # Tied: token_embd is quantized like the output (Q6_K), and also sits on the GPU as the head.
    assert b.embedding_bytes == qwen7b.n_embedding_params * 210 // 256
    assert b.gpu_bytes == b.total_bytes


# --------------------------------------------------------------------------------- EXL2 sizes


def test_exl2_breakdown(article):
    b = exl2_weights(article, 4.0)
    assert b.embedding_on_gpu is False
    assert b.embedding_bytes == 2 * article.n_embedding_params  # FP16, in system RAM
    assert b.output_bytes == article.n_embedding_params * 6 // 8  # head at 6 bits
    assert b.gpu_bytes == b.total_bytes - b.embedding_bytes
    assert len(set(b.per_layer_bytes)) == 1
    assert exl2_weights(article, 4.0, head_bits=8).output_bytes == article.n_embedding_params


def test_exl2_monotonic_in_bpw(article, engine_plugins):
    bpws = [2.0, 2.5, 3.0, 3.29, 3.3, 3.31, 3.5, 4.0, 4.01, 4.65, 5.0, 6.0, 8.0]
    raw = [exl2_weights(article, x).total_bytes for x in bpws]
    calibrated = [weights_for(article, f"exl2:{x}").total_bytes for x in bpws]
    assert raw == sorted(raw) and len(set(raw)) == len(raw)
    assert calibrated == sorted(calibrated) and len(set(calibrated)) == len(calibrated)


def test_exl2_range_errors(article):
    with pytest.raises(ConfigError, match="bpw 2.0-8.0"):
        exl2_weights(article, 1.5)
    with pytest.raises(ConfigError, match="head_bits"):
        exl2_weights(article, 4.0, head_bits=9)


# -------------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("fmt", ["gguf:Q8_0", "gguf:Q4_K_M", "gguf:Q4_0", "gguf:Q3_K_M", "exl2:4.0", "exl2:3.3"])
def test_quoted_artifacts_come_back_exactly(article, fmt, engine_plugins):
    b = weights_for(article, fmt)
    assert b.total_bytes == article.artifact_bytes[fmt]


def test_quoted_lookup_uses_canonical_spelling(article, engine_plugins):
    assert weights_for(article, "exl2:4").total_bytes == 15_300_000_000
    assert weights_for(article, "GGUF:q4_k_m").total_bytes == 16_300_000_000


def test_scaling_keeps_proportions(article, engine_plugins):
    raw = predict_gguf_weights(article, "Q4_K_M")
    quoted = weights_for(article, "gguf:Q4_K_M")
    k = quoted.total_bytes / raw.total_bytes
    assert quoted.embedding_bytes == pytest.approx(raw.embedding_bytes * k, abs=1)
    assert quoted.per_layer_bytes[0] == pytest.approx(raw.per_layer_bytes[0] * k, abs=1)
    assert quoted.embedding_on_gpu == raw.embedding_on_gpu


def test_unquoted_exl2_between_its_quoted_neighbours(article, engine_plugins):
    size = weights_for(article, "exl2:3.5").total_bytes
    assert 12.8e9 < size < 15.3e9


def test_unquoted_gguf_consistent_with_quoted(article, engine_plugins):
    q5 = weights_for(article, "gguf:Q5_K_M").total_bytes
    q6 = weights_for(article, "gguf:Q6_K").total_bytes
    assert 16.3e9 < q5 < q6 < 27.0e9
    assert weights_for(article, "gguf:Q2_K").total_bytes < 13.9e9
    # The article puts "6-bit" at ~21 GB.
    assert q6 == pytest.approx(21e9, rel=0.05)


def test_models_without_quotes_are_not_scaled(qwen7b, engine_plugins):
    assert weights_for(qwen7b, "gguf:Q4_K_M") == predict_gguf_weights(qwen7b, "Q4_K_M")
    assert weights_for(qwen7b, "exl2:4.0") == exl2_weights(qwen7b, 4.0)


def test_one_quoted_exl2_calibrates_all_exl2_not_gguf(qwen7b, engine_plugins):
    m = dataclasses.replace(qwen7b, artifact_bytes={"exl2:4.0": 5_000_000_000})
    ratio = 5e9 / exl2_weights(qwen7b, 4.0).total_bytes
    assert weights_for(m, "exl2:5.0").total_bytes == pytest.approx(exl2_weights(qwen7b, 5.0).total_bytes * ratio, abs=1)
    assert weights_for(m, "gguf:Q4_K_M") == predict_gguf_weights(qwen7b, "Q4_K_M")


def test_scaled_to_is_exact():
    b = WeightsBreakdown(1000, 333, (777, 777, 777), 7)
    s = b.scaled_to(12_345)
    assert s.total_bytes == 12_345
    assert s.other_bytes >= 0


# ------------------------------------------------------------------------------- format names


def test_parse_format(engine_plugins):
    assert parse_format("gguf:Q4_K_M") == ("gguf", "Q4_K_M")
    assert parse_format("gguf:q8_0") == ("gguf", "Q8_0")
    assert parse_format("exl2:3.5") == ("exl2", 3.5)
    assert parse_format("exl2:8") == ("exl2", 8.0)
    assert normalize_format("exl2:4") == "exl2:4.0"
    assert normalize_format("gguf:q3_k_m") == "gguf:Q3_K_M"


@pytest.mark.parametrize("bad", ["gguf:Q4_K_X", "exl2:1.5", "exl2:9", "exl2:four", "awq:4", "Q4_K_M", ""])
def test_bad_formats_say_what_is_accepted(bad, engine_plugins):
    with pytest.raises(UnknownNameError) as err:
        parse_format(bad)
    msg = str(err.value)
    # Each family the installed backends declare says what it accepts, in the backends' order.
    assert msg.startswith(
        f"unknown weights format '{bad}' (use exl2:<bpw> with bpw 2.0-8.0 or gguf:<TYPE> with TYPE in "
    )
    assert "Q4_K_M" in msg and msg.endswith(", Q2_K)")


def test_bad_format_through_weights_for(article, engine_plugins):
    with pytest.raises(UnknownNameError, match="unknown weights format 'gguf:IQ4_XS'"):
        weights_for(article, "gguf:IQ4_XS")


def test_bits_per_weight(qwen7b, engine_plugins):
    assert bits_per_weight("exl2:3.3") == 3.3
    assert bits_per_weight("gguf:Q4_K_M") == 4.5
    assert bits_per_weight("gguf:Q8_0") == 8.5
    assert bits_per_weight("gguf:F16") == 16
    # With the model, the mix shows: Q4_K_M's Q6_K layers lift it above Q4_0.
    assert bits_per_weight("gguf:Q4_K_M", qwen7b) > bits_per_weight("gguf:Q4_0", qwen7b) == 4.5


# ---------------------------------------------------------------------------------- KV cache
# The cache types are those the installed backends declare: these tests install the real ones.


def test_article_kv_per_token_f16(article, engine_plugins):
    assert kv_bytes_per_token(article, "f16") == 131072
    assert kv_bytes_per_token(article, "fp16") == 131072  # ExLlamaV2's name
    assert kv_bytes_per_token(article, "f16") * 4096 == 512 * 2**20  # 512 MiB at 4k, as the article says


def test_q8_0_cache_is_34_32_of_half_f16(article, engine_plugins):
    f16 = kv_bytes_per_token(article, "f16")
    assert kv_bytes_per_token(article, "q8_0") == f16 / 2 * 34 / 32
    assert kv_bytes_per_token(article, "q8_0", "f16") == f16 / 2 * 34 / 32 / 2 + f16 / 2


def test_cache_element_sizes(engine_plugins):
    assert cache_bytes_per_element("f16") == 2
    assert cache_bytes_per_element("q8_0") == 34 / 32
    assert cache_bytes_per_element("q4_0") == 18 / 32
    assert cache_bytes_per_element("Q5_1") == 24 / 32
    assert cache_bytes_per_element("f32") == 4
    # ExLlamaV2: uint8 data + an FP16 scale per 32 elements for K and for V.
    assert cache_bytes_per_element("q8") == 1 + 2 / 32
    assert cache_bytes_per_element("q6") == (1 + 0.5) / 2 + 2 / 32
    assert cache_bytes_per_element("q4") == 0.5 + 2 / 32
    assert cache_bytes_per_element("auto") == 2 and cache_bytes_per_element("fp8") == 1
    assert all(isinstance(ct.bytes_per_element, Fraction) and ct.source for ct in catalog().values())


def test_unknown_cache_type_lists_known_names(engine_plugins):
    with pytest.raises(UnknownNameError) as err:
        cache_bytes_per_element("int4")
    msg = str(err.value)
    assert msg.startswith("unknown KV cache type 'int4' (known: ")
    assert "llama.cpp: f32, f16" in msg and "exllamav2: fp16, q8, q6, q4" in msg and "vllm: auto, fp8" in msg


def test_mixed_engine_cache_types_rejected(article, engine_plugins):
    with pytest.raises(ConfigError, match="different engines"):
        kv_bytes_per_token(article, "q8_0", "q8")


def test_sliding_window_layers_param(article, engine_plugins):
    full = kv_bytes_per_token(article, "f16")
    assert kv_bytes_per_token(article, "f16", n_layers=16) == full / 4


def test_exllamav2_quantized_cache_temp_buffers(article, engine_plugins):
    assert cache_fixed_bytes(article, "q8", 4096) == 2 * 2 * 4096 * 512  # one FP16 K+V layer
    assert cache_fixed_bytes(article, "fp16", 4096) == 0
    assert cache_fixed_bytes(article, "q8_0", 4096) == 0


def test_a_backend_declares_a_new_cache_type_and_format(article, tmp_path):
    """A new engine's cache type and format are known to the core from its declarations alone:
    sizes, bits and the dequantize buffer; a ``fp4x:...`` weights value is a format for estimate
    and is offered by init, full precision marked; unregistered, they are unknown again."""
    from autotune import estimate, study_writer
    from autotune.engine.backend import BaseBackend
    from autotune.engine.declarations import CacheType, WeightFormats
    from tests.conftest import plugin_registered

    class Fp4Engine(BaseBackend):
        name = "fp4-engine"
        engine = "fp4x"
        kv_cache_types = (
            CacheType("nvfp4", "fp4x", Fraction(9, 16), "fp4x docs: 4-bit + FP8 scale per 16", 4, dequant_layers=2),
        )
        weight_formats = (
            WeightFormats("fp4x", "fp4x:<scheme>", offered=("fp4x:bf16", "fp4x:nvfp4"), full_precision=("fp4x:bf16",)),
        )

        def parameters(self, space):
            return []

        def estimate_memory(self, config, ctx):
            raise NotImplementedError

        def run(self, config, ctx):
            raise NotImplementedError

        def deploy_command(self, config, ctx):
            return ""

    class Plugin:
        from autotune import hookimpl

        @staticmethod
        @hookimpl
        def register_backends(register):
            register(Fp4Engine())

    assert not estimate.is_format("fp4x:nvfp4")
    with plugin_registered(Plugin, "fp4"):
        assert cache_bytes_per_element("NVFP4") == 9 / 16
        assert kv_bytes_per_token(article, "nvfp4") == article.n_layers * article.kv_dim * 2 * 9 / 16
        assert cache_fixed_bytes(article, "nvfp4", 100) == 2 * 2 * 2 * 100 * article.kv_dim
        assert estimate.is_format("fp4x:nvfp4") and not estimate.is_format("gguf:Q4_0")
        assert study_writer.offered_formats() == (("fp4x:bf16", "fp4x:nvfp4"), frozenset({"fp4x:bf16"}))
        from autotune.engine.space import KV_BITS, dimension_of

        assert dimension_of("fp4-engine", "cache_type", ("nvfp4",)).name == KV_BITS
    assert not estimate.is_format("fp4x:nvfp4")
    with pytest.raises(UnknownNameError, match="known: none"):
        cache_bytes_per_element("nvfp4")


def test_two_backends_declaring_one_cache_type_differently_are_refused():
    from autotune.engine.backend import BaseBackend
    from autotune.engine.declarations import CacheType
    from autotune.errors import PluginError
    from tests.conftest import plugin_registered

    def engine(backend: str, size: Fraction) -> BaseBackend:
        cls = type(
            backend,
            (BaseBackend,),
            {
                "name": backend,
                "kv_cache_types": (CacheType("q8", "x", size, "test", 8),),
                "parameters": lambda self, space: [],
                "estimate_memory": lambda self, c, x: None,
                "run": lambda self, c, x: None,
                "deploy_command": lambda self, c, x: "",
            },
        )
        return cls()

    class Plugin:
        from autotune import hookimpl

        @staticmethod
        @hookimpl
        def register_backends(register):
            register(engine("one", Fraction(1)))
            register(engine("two", Fraction(17, 16)))

    with plugin_registered(Plugin, "clash"), pytest.raises(PluginError, match="'q8' is declared twice.*'one'.*'two'"):
        cache_bytes_per_element("q8")


def test_the_twins_declare_their_engines_own_tables():
    """One table per engine: each twin declares what the real backend of its engine declares."""
    from autotune_plugins.exllamav2.backend import ExLlamaV2Backend
    from autotune_plugins.llama_server.backend import LlamaServerBackend
    from autotune_plugins.twin import TwinExllamaV2, TwinLlamaCpp

    assert TwinLlamaCpp.kv_cache_types is LlamaServerBackend.kv_cache_types
    assert TwinLlamaCpp.weight_formats == LlamaServerBackend.weight_formats
    assert TwinExllamaV2.kv_cache_types is ExLlamaV2Backend.kv_cache_types
    assert TwinExllamaV2.weight_formats == ExLlamaV2Backend.weight_formats
    # The twins search a subset of what their engines store.
    for twin in (TwinLlamaCpp, TwinExllamaV2):
        assert set(twin.cache_types) <= {ct.name for ct in twin.kv_cache_types}


def test_another_engine_may_spell_a_cache_type_alike_with_the_same_figures(engine_plugins):
    """A third engine's ``f16`` of 2 bytes and 16 bits is llama.cpp's ``f16`` for sizing: no clash."""
    from autotune.engine.backend import BaseBackend
    from autotune.engine.declarations import CacheType
    from tests.conftest import plugin_registered

    class Other(BaseBackend):
        name = "other"
        kv_cache_types = (CacheType("f16", "other-engine", Fraction(2), "other/cache.h: half", 16),)
        parameters = estimate_memory = run = deploy_command = lambda self, *a: None

    class Plugin:
        from autotune import hookimpl

        @staticmethod
        @hookimpl
        def register_backends(register):
            register(Other())

    with plugin_registered(Plugin, "other"):
        assert cache_bytes_per_element("f16") == 2 and catalog()["f16"].bits == 16


def test_a_shared_name_does_not_make_one_engines_k_and_v_foreign(article, engine_plugins):
    """With another engine's f16 found first, llama.cpp's q8_0 K and f16 V still go together."""
    from autotune.engine.backend import BaseBackend
    from autotune.engine.declarations import CacheType
    from tests.conftest import plugin_registered

    class Early(BaseBackend):
        name = "aaa-early"  # sorted before llama-server: its f16 is the catalog's
        kv_cache_types = (CacheType("f16", "early-engine", Fraction(2), "early/cache.h: half", 16),)
        parameters = estimate_memory = run = deploy_command = lambda self, *a: None

    class Plugin:
        from autotune import hookimpl

        @staticmethod
        @hookimpl
        def register_backends(register):
            register(Early())

    with plugin_registered(Plugin, "early"):
        assert catalog()["f16"].family == "early-engine"
        f16 = kv_bytes_per_token(article, "f16")
        assert kv_bytes_per_token(article, "q8_0", "f16") == f16 / 2 * 34 / 32 / 2 + f16 / 2
        with pytest.raises(ConfigError, match="different engines"):
            kv_bytes_per_token(article, "q8_0", "q8")


def test_a_plugin_s_format_family_is_read_spelled_and_sized_by_its_own_callables(article):
    """The core knows a family only through its declaration: a new one (awq:<bits>-g<group>, as
    docs/plugins.md writes it) is parsed, spelled, sized and calibrated by its callables, and
    its bad variants are refused with what it accepts; unregistered, it is unknown again."""
    from autotune.engine.backend import BaseBackend
    from autotune.engine.declarations import WeightFormats
    from tests.conftest import plugin_registered

    def awq_variant(variant: str) -> tuple[int, int]:
        bits, _, group = variant.lower().partition("-g")
        if not (bits.isdigit() and group.isdigit() and int(bits) in (4, 8)):
            raise ValueError(variant)
        return int(bits), int(group)

    def awq_weights(model, value) -> WeightsBreakdown:
        layer = model.n_params // model.n_layers * value[0] // 8
        return WeightsBreakdown(2 * model.n_embedding_params, 0, (layer,) * model.n_layers, 0)

    awq = WeightFormats(
        "awq",
        "awq:<bits>-g<group>",
        offered=("awq:4-g128",),
        accepts="awq:<bits>-g<group> with bits 4 or 8",
        parse=awq_variant,
        spell=lambda v: f"{v[0]}-g{v[1]}",
        predict=awq_weights,
        bits=lambda v, model: v[0] + 16 / v[1],
    )
    bare = WeightFormats("fp4x", "fp4x:<scheme>")

    class AwqEngine(BaseBackend):
        name = "awq-engine"
        weight_formats = (awq, bare)
        parameters = lambda self, space: []  # noqa: E731
        estimate_memory = run = lambda self, config, ctx: None  # noqa: E731
        deploy_command = lambda self, config, ctx: ""  # noqa: E731

    class Plugin:
        from autotune import hookimpl

        @staticmethod
        @hookimpl
        def register_backends(register):
            register(AwqEngine())

    quoted = dataclasses.replace(article, artifact_bytes={"awq:4-g128": 10_000_000_000})
    with plugin_registered(Plugin, "awq"):
        assert parse_format(" AWQ:4-G128 ") == ("awq", (4, 128))
        assert normalize_format("awq:4-G128") == "awq:4-g128"
        assert bits_per_weight("awq:4-g128") == 4.125
        assert weights_for(article, "awq:8-g64") == awq_weights(article, (8, 64))
        assert weights_for(quoted, "AWQ:4-G128").total_bytes == 10_000_000_000  # the quote, by canonical spelling
        ratio = 10e9 / awq_weights(article, (4, 128)).total_bytes
        assert weights_for(quoted, "awq:8-g128").total_bytes == pytest.approx(
            awq_weights(article, (8, 128)).total_bytes * ratio, abs=1
        )
        with pytest.raises(UnknownNameError) as err:
            parse_format("awq:3-g128")
        assert str(err.value) == (
            "unknown weights format 'awq:3-g128' (use awq:<bits>-g<group> with bits 4 or 8 or fp4x:<scheme>)"
        )
        assert parse_format("fp4x:NVFP4") == ("fp4x", "NVFP4")  # no parse: as written
        with pytest.raises(UnknownNameError, match="'fp4x' .* declares no size prediction"):
            weights_for(article, "fp4x:nvfp4")
    with pytest.raises(UnknownNameError, match="use none: no installed backend declares a format"):
        parse_format("awq:4-g128")
    # A backend used without the registry passes its own declarations.
    assert normalize_format("awq:8-G32", AwqEngine.weight_formats) == "awq:8-g32"
