"""Tests for autotune.modelfiles.models: the catalog, GGUF headers, HF configs and resolve_model."""

from __future__ import annotations

import json
from pathlib import Path

import tomllib

import pytest

from tests.conftest import REPO, shared_file

from autotune.errors import ConfigError, UnknownNameError
from autotune.modelfiles.models import (
    ModelSpec,
    count_params,
    get_model,
    load_model_catalog,
    model_from_gguf,
    model_from_hf_config,
    resolve_model,
)


@pytest.fixture
def stories() -> Path:
    """llama2.c's stories260K as a GGUF file (shared/models/)."""
    return shared_file("models/stories260K.gguf")


@pytest.fixture
def reference() -> dict:
    """The article's measured rows and figures (shared/reference/)."""
    return tomllib.loads((REPO / "reference" / "article_v100_qwen27b.toml").read_text())


REQUIRED_KEYS = [
    "qwen2.5-27b-article",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "qwen2.5-32b",
    "qwen2.5-72b",
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "llama-3.1-8b",
    "llama-3.1-70b",
]

# Qwen2.5-7B-Instruct's config.json (the fields we read, as published).
QWEN25_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}


# ------------------------------------------------------------------------------------- catalog


def test_catalog_has_every_required_model():
    catalog = load_model_catalog()
    assert [k for k in REQUIRED_KEYS if k not in catalog] == []


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_catalog_entries_are_complete_and_consistent(key):
    m = get_model(key)
    assert m.key == key
    assert m.source.strip()
    assert m.architecture in ("qwen2", "llama")
    assert m.n_heads % m.n_kv_heads == 0
    # n_params in the TOML is the architecture's count: the two must not drift apart.
    assert m.n_params == count_params(
        architecture=m.architecture,
        n_layers=m.n_layers,
        hidden_size=m.hidden_size,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        head_dim=m.head_dim,
        ffn_size=m.ffn_size,
        vocab_size=m.vocab_size,
        tie_embeddings=m.tie_embeddings,
    )


def test_published_parameter_counts():
    # Counts as the model cards / safetensors indexes publish them.
    assert get_model("qwen2.5-7b").n_params == 7_615_616_512
    assert get_model("llama-2-7b").n_params == 6_738_415_616
    assert get_model("llama-3.1-8b").n_params == 8_030_261_248
    assert get_model("llama-2-70b").n_params == 68_976_648_192


def test_article_model_is_27b_with_the_quoted_sizes():
    m = get_model("qwen2.5-27b-article")
    assert (m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim) == (64, 28, 4, 128)
    assert abs(m.n_params - 27e9) / 27e9 < 0.01
    assert dict(m.artifact_bytes) == {
        "gguf:Q8_0": 27_000_000_000,
        "gguf:Q4_K_M": 16_300_000_000,
        "gguf:Q4_0": 15_500_000_000,
        "gguf:Q3_K_M": 13_900_000_000,
        "exl2:4.0": 15_300_000_000,
        "exl2:3.3": 12_800_000_000,
    }


def test_article_model_matches_the_reference_file(reference):
    ref = reference
    m = get_model("qwen2.5-27b-article")
    assert m.n_layers == ref["model"]["layers"] == 64
    assert m.n_kv_heads == ref["model"]["kv_heads"] == 4
    assert m.head_dim == ref["model"]["head_dim"] == 128
    assert m.n_heads == ref["model"]["q_heads"] == 28
    assert m.kv_dim == 512
    assert abs(m.n_params - 27e9) / 27e9 < 0.01
    # Quoted sizes: the reference's GB figures as integers of bytes.
    assert dict(m.artifact_bytes) == {k: int(v * 1e9) for k, v in ref["weights"].items()}


def test_derived_properties():
    m = get_model("qwen2.5-7b")
    assert m.kv_dim == 4 * 128
    assert m.q_dim == 3584
    assert m.n_embedding_params == 152064 * 3584
    assert m.has_qkv_bias and not get_model("llama-3.1-8b").has_qkv_bias


def test_get_model_unknown_lists_known_keys():
    with pytest.raises(UnknownNameError) as err:
        get_model("qwen-7b")
    assert str(err.value).startswith(
        "unknown model 'qwen-7b' (known: qwen2.5-27b-article, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, "
    )


def test_specs_are_frozen_and_hashable():
    m = get_model("qwen2.5-27b-article")
    with pytest.raises(AttributeError):
        m.n_layers = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.artifact_bytes["gguf:Q8_0"] = 1  # type: ignore[index]
    assert hash(m) == hash(get_model("qwen2.5-27b-article"))


def test_spec_rejects_nonsense():
    with pytest.raises(ConfigError, match="n_layers = 0: must be an integer from 1 to 4,096"):
        ModelSpec("x", "x", "llama", 0, 64, 8, 4, 8, 172, 512, 1, False, 2048, "test")


# --------------------------------------------------------------------------------------- GGUF


def test_stories260k_gguf(stories):
    m = model_from_gguf(stories)
    assert m.architecture == "llama"
    assert m.hidden_size == 64
    assert m.n_layers == 5
    assert m.n_heads == 8
    assert m.n_kv_heads == 4
    assert m.head_dim == 8  # no key_length key: 64 / 8
    assert m.ffn_size == 172
    assert m.vocab_size == 512
    assert m.max_context == 2048
    assert m.tie_embeddings is False  # the file has output.weight
    # 2 x 512 x 64 (embeddings, output) + 64 (final norm) + 5 layers of
    # (64x64 + 2 x 64x32 + 64x64 + 3 x 64x172 + 2 x 64).
    assert m.n_params == 2 * 512 * 64 + 64 + 5 * (2 * 4096 + 2 * 2048 + 3 * 64 * 172 + 128)
    assert m.key == "stories260K"
    assert m.source == str(stories)


def test_gguf_errors_name_the_file(tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match=r"not\.gguf: not a GGUF file \(starts with b'this', expected b'GGUF'\)"):
        model_from_gguf(bad)
    with pytest.raises(ConfigError, match="no such file"):
        model_from_gguf(tmp_path / "missing.gguf")


def test_gguf_missing_field_names_it(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "partial.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_head_count(8)
    w.add_context_length(512)  # feed_forward_length left out
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError) as err:
        model_from_gguf(path)
    assert str(err.value) == f"{path}: field 'llama.feed_forward_length' missing"


def _crafted_gguf(path: Path, *, layer_tensors: bool = True, **over) -> Path:
    """A small llama GGUF with the header values given (a hostile file in a few KB)."""
    import gguf
    import numpy as np

    kv = dict(
        block_count=2, embedding_length=64, head_count=8, head_count_kv=4, feed_forward_length=172, context_length=512
    )
    kv.update(over)
    w = gguf.GGUFWriter(path, "llama")
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float16))
    if layer_tensors:
        w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "over, expected",
    [
        # Each was a traceback (ZeroDivisionError, MemoryError) or a silent nonsense on main.
        ({"head_count": 0}, "llama.attention.head_count = 0: must be an integer from 1 to 65,536"),
        ({"block_count": 2**32 - 1}, "llama.block_count = 4294967295: must be an integer from 1 to 4,096"),
        ({"embedding_length": 0}, "llama.embedding_length = 0: must be an integer from 1 to 1,048,576"),
        (
            {"feed_forward_length": 2**31},
            "llama.feed_forward_length = 2147483648: must be an integer from 1 to 16,777,216",
        ),
        (
            {"context_length": 2**32 - 1},
            "llama.context_length = 4294967295: must be an integer from 1 to 1,073,741,824",
        ),
        ({"head_count_kv": 0}, "llama.attention.head_count_kv = 0: must be an integer from 1 to 65,536"),
        ({"head_count_kv": 16}, "16 key/value heads but 8 query heads: a layer has no more of them"),
        (
            {"head_count": 128},
            "llama.attention.head_count = 128 exceeds llama.embedding_length = 64 and there is "
            "no llama.attention.key_length",
        ),
        (
            {"layer_tensors": False},
            "2,048 parameters, no more than the embeddings alone (32 tokens x 64 wide): the 2 decoder layers hold none",
        ),
        # A mixture of experts: the routing keys get the same checks.
        (
            {"expert_count": 2**31, "expert_used_count": 2},
            "llama.expert_count = 2147483648: must be an integer from 1 to 16,384",
        ),
        ({"expert_count": 8, "expert_used_count": 0}, "llama.expert_used_count = 0: must be an integer from 1"),
        ({"expert_count": 8, "expert_used_count": 9}, "llama.expert_used_count = 9: more than the 8 experts"),
    ],
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, dict) else None,
)
def test_gguf_header_values_out_of_range_name_the_file_key_value_and_range(tmp_path, over, expected):
    path = _crafted_gguf(tmp_path / "crafted.gguf", **over)
    with pytest.raises(ConfigError) as err:
        model_from_gguf(path)
    assert str(err.value).startswith(f"{path}: ") and expected in str(err.value), str(err.value)


def test_a_sane_crafted_gguf_is_read(tmp_path):
    m = model_from_gguf(_crafted_gguf(tmp_path / "ok.gguf"))
    assert (m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.vocab_size) == (2, 8, 4, 8, 32)


def test_expert_width_falls_back_as_llama_cpp_does(tmp_path):
    m = model_from_gguf(_crafted_gguf(tmp_path / "moe.gguf", expert_count=8, expert_used_count=2))
    assert (m.n_experts, m.n_experts_used, m.expert_ffn_size, m.mlp_width) == (8, 2, 86, 172)  # ffn 172 / 2 used


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("num_hidden_layers", 2**32 - 1, "field 'num_hidden_layers' = 4294967295: must be an integer from 1 to 4,096"),
        ("num_attention_heads", 0, "field 'num_attention_heads' = 0: must be an integer from 1 to 65,536"),
        ("num_key_value_heads", 64, "field 'num_key_value_heads' = 64 exceeds field 'num_attention_heads' = 28"),
    ],
)
def test_hf_config_values_out_of_range(tmp_path, field, value, expected):
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN25_7B_CONFIG, **{field: value})))
    with pytest.raises(ConfigError) as err:
        model_from_hf_config(tmp_path)
    assert str(err.value).startswith(str(tmp_path / "config.json")) and expected in str(err.value)


# ----------------------------------------------------------------------------------- HF config


def test_hf_config_qwen25_7b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    m = model_from_hf_config(tmp_path)
    catalog = get_model("qwen2.5-7b")
    for name in (
        "architecture",
        "n_layers",
        "hidden_size",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "ffn_size",
        "vocab_size",
        "n_params",
        "tie_embeddings",
        "max_context",
    ):
        assert getattr(m, name) == getattr(catalog, name), name
    assert m.sliding_window is None and m.n_swa_layers == 0  # use_sliding_window is false


def test_hf_config_file_path_tied_and_explicit_head_dim(tmp_path):
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 96,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    m = model_from_hf_config(path)
    assert m.head_dim == 96 and m.q_dim == 384 and m.kv_dim == 192
    assert m.tie_embeddings
    per_layer = 256 * 384 + 2 * 256 * 192 + 384 * 256 + 3 * 256 * 512 + 2 * 256
    assert m.n_params == 1000 * 256 + 4 * per_layer + 256  # no separate head


def test_hf_config_sliding_window_layers(tmp_path):
    cfg = dict(QWEN25_7B_CONFIG, use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = model_from_hf_config(tmp_path)
    assert m.sliding_window == 4096
    assert m.n_swa_layers == 8  # layers 20..27


def test_hf_config_missing_field_names_file_and_field(tmp_path):
    cfg = dict(QWEN25_7B_CONFIG)
    del cfg["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        model_from_hf_config(tmp_path)
    assert str(err.value) == f"{path}: field 'num_hidden_layers' missing"


def test_hf_config_lists_every_bad_field(tmp_path):
    cfg = dict(QWEN25_7B_CONFIG, hidden_size="big")
    del cfg["vocab_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        model_from_hf_config(path)
    msg = str(err.value)
    assert "field 'hidden_size' = 'big': must be an integer from 1 to 1,048,576" in msg
    assert "field 'vocab_size' missing" in msg


def test_hf_config_invalid_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        model_from_hf_config(path)


def test_exl2_directory_records_its_size(tmp_path):
    """The size is quoted by the family that knows the directory (the exllamav2 plugin's EXL2
    declaration, ``WeightFormats.quote``); with no plugin that declares it, nothing is quoted."""
    from autotune_plugins import exllamav2
    from tests.conftest import plugin_registered

    cfg = dict(QWEN25_7B_CONFIG, quantization_config={"quant_method": "exl2", "bits": 4.0, "head_bits": 6})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "output-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "output-00002-of-00002.safetensors").write_bytes(b"\0" * 500)
    with plugin_registered(exllamav2, "exllamav2"):
        assert dict(model_from_hf_config(tmp_path).artifact_bytes) == {"exl2:4.0": 1500}
    assert dict(model_from_hf_config(tmp_path).artifact_bytes) == {}


# ------------------------------------------------------------------------------- resolve_model


def test_resolve_model_accepts_each_kind(tmp_path, stories):
    assert resolve_model("qwen2.5-7b") is get_model("qwen2.5-7b")
    assert resolve_model(str(stories)).vocab_size == 512
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    assert resolve_model(str(tmp_path)).n_layers == 28
    assert resolve_model(str(tmp_path / "config.json")).n_layers == 28


def test_resolve_model_errors(tmp_path):
    with pytest.raises(UnknownNameError, match="^'nope': not a catalog model .known: qwen2.5-27b-article"):
        resolve_model("nope")
    # A path that does not exist is news about the file, not about the catalog.
    with pytest.raises(
        UnknownNameError, match=r"^path/to/model\.gguf: no such file or directory \(nor a catalog model"
    ):
        resolve_model("path/to/model.gguf")
    with pytest.raises(ConfigError, match="directory has no config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("bits", [0, -3.0, 1e9, float("inf"), float("nan")])
def test_exl2_bits_outside_what_exllamav2_writes_are_refused(tmp_path, bits, engine_plugins):  # EXL2's reader
    cfg = dict(QWEN25_7B_CONFIG, quantization_config={"quant_method": "exl2", "bits": bits})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        model_from_hf_config(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: quantization_config.bits = {bits!r}: ")


def test_safetensors_negative_dimensions_are_refused(tmp_path):
    from autotune.modelfiles.safetensors_dir import read_safetensors_header

    # -2 x -2 x F16 = 8 bytes: the offsets agree with the product, so only the sign shows it.
    header = json.dumps({"w": {"dtype": "F16", "shape": [-2, -2], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(ConfigError, match=r"model\.safetensors: tensor 'w': shape \[-2, -2\] has a negative dimension"):
        read_safetensors_header(path)
