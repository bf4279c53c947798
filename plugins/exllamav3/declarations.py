"""What exllamav3 knows, as data: its KV-cache modes and the EXL3 formats.

Declared by the exllamav3 backend and by the twin of exllamav3 (``BaseBackend.kv_cache_types``,
``BaseBackend.weight_formats``); TabbyAPI, behind openai-server, names the same modes
(``cache_mode: FP16`` or ``"8,8"``, see :func:`tabby_cache_mode`). Importing this module costs
nothing (no torch); the formats' callables are :mod:`autotune_plugins.exllamav3.formats`.

Source read: exllamav3 1.6.5 as on PyPI (``exllamav3/cache/fp16.py``, ``cache/quant.py``,
``modules/attention_fn/triton_paged.py``, ``modules/attn.py``).
"""

from __future__ import annotations

import re
from fractions import Fraction

from autotune.api import CacheType, WeightFormats
from autotune_plugins.exllamav3 import formats

__all__ = [
    "ARCHITECTURES",
    "CACHE_BITS",
    "CACHE_TYPES",
    "EXL3",
    "PYTHON_ENGINE_VARIABLES",
    "architecture_problem",
    "cache_kv_bits",
    "quant_cache_name",
    "tabby_cache_mode",
]

_FAMILY = "exllamav3"
# CacheLayer_quant (cache/quant.py) asserts 2 <= k_bits <= 8 and 2 <= v_bits <= 8.
CACHE_BITS = range(2, 9)

# cache/quant.py CacheLayer_quant: per page and token, K is packed into int32 words of shape
# token_dim // 32 * k_bits (k_bits/8 bytes per element), V likewise at v_bits, and K and V each
# have one FP16 scale per 32 elements (qshape_s = token_dim // 32, torch.half): 2/32 = 1/16 B.
# storage_size() is exactly qk + qv (int32) + 2 * scales (half). Per element, K and V averaged:
# ((K/8 + 1/16) + (V/8 + 1/16)) / 2 = (K + V + 1) / 16.
# Prefill over a quantized cache dequantizes the referenced window into a transient FP16 K/V
# scratch (triton_paged.py, EXL3_QC_STAGING=1, the default): at most _qc_staging_pages = 256
# pages (64k tokens) per sequence, shared by all layers (one layer's worth at a time). That is
# about one layer of FP16 K and V for the whole cache: dequant_layers=1, exact for a cache of
# 64k tokens. The loader's measuring pass (attn.py autosplit_extra_measure) allocates the full
# 256 pages whatever the cache, so the backend's memory model (memory.staging_bytes) counts at
# least 64k tokens: more than this declaration for a smaller cache.
_QUANT = "exllamav3/cache/quant.py CacheLayer_quant: int32-packed K/V + FP16 scale per 32 elements"


def quant_cache_name(k_bits: int, v_bits: int) -> str:
    """The cache type of K at ``k_bits`` and V at ``v_bits`` (``k8v8``)."""
    return f"k{k_bits}v{v_bits}"


def _quant(k: int, v: int) -> CacheType:
    # bits: the nominal precision a study compares engines by; K and V averaged, rounded down,
    # so that k4v6 (5) is not taken for a q6 of another engine.
    return CacheType(
        quant_cache_name(k, v),
        _FAMILY,
        Fraction(k + v + 1, 16),
        f"{_QUANT}: K {k}/8 + 1/16, V {v}/8 + 1/16 (mean)",
        (k + v) // 2,
        dequant_layers=1,
    )


# fp16: cache/fp16.py CacheLayer_fp16, K and V as torch.half, no overhead_size.
CACHE_TYPES = (
    CacheType("fp16", _FAMILY, Fraction(2), "exllamav3/cache/fp16.py CacheLayer_fp16: torch.half", 16),
    *(_quant(k, v) for k in reversed(CACHE_BITS) for v in reversed(CACHE_BITS)),
)

_QUANT_RX = re.compile(r"^k([2-8])v([2-8])$")


def cache_kv_bits(cache_type: str) -> tuple[int, int] | None:
    """A quantized cache type's (K bits, V bits) (``"k4v6"`` -> ``(4, 6)``); None for ``fp16``.

    Raises:
        ValueError: Neither ``fp16`` nor ``k<K>v<V>`` with K, V in 2..8.
    """
    name = cache_type.strip().lower()
    if name == "fp16":
        return None
    m = _QUANT_RX.match(name)
    if m is None:
        raise ValueError(cache_type)
    return int(m.group(1)), int(m.group(2))


def tabby_cache_mode(cache_type: str) -> str:
    """TabbyAPI's ``cache_mode`` for a cache type: ``FP16``, or ``"K,V"`` (config_sample.yml:
    "exllamav3 specific quant values are a pair in the form 'k_bits,v_bits' from 2 to 8",
    parsed by backends/exllamav3/model.py)."""
    bits = cache_kv_bits(cache_type)
    return "FP16" if bits is None else f"{bits[0]},{bits[1]}"


# The config.json architectures exllamav3 1.6.5 loads (exllamav3/architecture/*.py arch_string,
# gathered by architecture/architectures.py); model/config.py Config.from_directory asserts
# "Unknown architecture ..." for any other, and exactly one.
ARCHITECTURES = frozenset(
    (
        "AfmoeForCausalLM",
        "ApertusForCausalLM",
        "ArceeForCausalLM",
        "BailingMoeV3ForCausalLM",
        "Cohere2ForCausalLM",
        "CohereForCausalLM",
        "DFlash2DraftModel",
        "DFlashDraftModel",
        "DFlashLagunaForCausalLM",
        "DeciLMForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV4ForCausalLM",
        "Dots1ForCausalLM",
        "Ernie4_5_ForCausalLM",
        "Ernie4_5_MoeForCausalLM",
        "Exaone4ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Gemma4AssistantForCausalLM",
        "Gemma4ForConditionalGeneration",
        "Gemma4UnifiedForConditionalGeneration",
        "Glm4ForCausalLM",
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "Glm4vForConditionalGeneration",
        "Glm4vMoeForConditionalGeneration",
        "Glm5NextForConditionalGeneration",
        "GlmMoeDsaForCausalLM",
        "GptOssForCausalLM",
        "HCXVisionV2ForCausalLM",
        "HYV3ForCausalLM",
        "HyperCLOVAXForCausalLM",
        "IQuestCoderForCausalLM",
        "KimiLinearForCausalLM",
        "LagunaForCausalLM",
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
        "Lfm2VlForConditionalGeneration",
        "LlamaForCausalLM",
        "MiMoForCausalLM",
        "MiMoV2ForCausalLM",
        "MiniMaxM2ForCausalLM",
        "Ministral3ForCausalLM",
        "Mistral3ForConditionalGeneration",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "MuseGlimmerAssistantModel",
        "MuseGlimmerForConditionalGeneration",
        "NemotronHForCausalLM",
        "NemotronH_Omni_Reasoning_V3",
        "Olmo3ForCausalLM",
        "OlmoHybridForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen4ExpForConditionalGeneration",
        "SeedOssForCausalLM",
        "SmolLM3ForCausalLM",
        "SolarOpenForCausalLM",
        "Spark2_5ForCausalLM",
        "Step3p5ForCausalLM",
        "Step3p7ForConditionalGeneration",
    )
)


def architecture_problem(cfg: dict, where: str) -> str | None:
    """Why exllamav3 1.6.5 would not load a model of this config.json (None: it would)."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1:
        return f"{where}: architectures = {archs!r}: exllamav3 needs exactly one (model/config.py)"
    if archs[0] not in ARCHITECTURES:
        return (
            f"{where}: architecture {archs[0]!r} is not one exllamav3 1.6.5 loads (model/config.py: "
            f'"Unknown architecture"); it loads {len(ARCHITECTURES)}, e.g. LlamaForCausalLM, Qwen2ForCausalLM, '
            "Qwen3ForCausalLM, MistralForCausalLM, Gemma3ForCausalLM"
        )
    return None


# What `autotune init` offers, widest first. None is full precision: exllamav3 loads an FP16
# model directory as it is (modules/linear.py load_fp16, LinearFP16), and that source is the
# quality reference (init checks check_weights on the source).
EXL3 = WeightFormats(
    "exl3",
    "exl3:<bpw>",
    offered=("exl3:8.0", "exl3:6.0", "exl3:5.0", "exl3:4.0", "exl3:3.0", "exl3:2.0"),
    accepts=formats.ACCEPTS,
    parse=formats.bpw_of,
    spell=formats.spell,
    predict=formats.exl3_weights,
    bits=formats.bits_per_weight,
    quote=formats.quote,
)

# What a Python engine (the worker, the converter, TabbyAPI) needs of autotune's environment
# beyond the core's allow-list (``BaseBackend.engine_variables``): its interpreter's setup,
# torch's and Hugging Face's caches, the compiler torch's extension loader builds exllamav3's
# extension with at first import (exllamav3/ext.py, torch.utils.cpp_extension.load), and
# exllamav3's own switches (doc/env_vars.md: EXL3_*).
PYTHON_ENGINE_VARIABLES = (
    "PYTHON*",
    "VIRTUAL_ENV",
    "CONDA_*",
    "TORCH_*",
    "PYTORCH_*",
    "TRITON_*",
    "HF_*",
    "TRANSFORMERS_*",
    "NCCL_*",
    "CC",
    "CXX",
    "CUDAHOSTCXX",
    "CUDA_HOME",
    "MAX_JOBS",
    "EXL3_*",
)
