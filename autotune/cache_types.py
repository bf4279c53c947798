"""KV-cache element types, as data: bytes per cached value of each engine's cache types.

:data:`CACHE_TYPES` lists the cache element types of llama.cpp, ExLlamaV2 and vLLM with their
bytes per element, scales included; :func:`kv_bytes_per_token` turns a model and a cache type
into bytes per token of context; :func:`cache_fixed_bytes` adds what a cache type allocates
once per device.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

from autotune.errors import ConfigError, UnknownNameError
from autotune.models import ModelSpec

__all__ = [
    "CACHE_TYPES",
    "CacheType",
    "cache_bits",
    "cache_bytes_per_element",
    "cache_fixed_bytes",
    "kv_bytes_per_token",
]


class CacheType(NamedTuple):
    """A KV-cache element type: the engine family, bytes per element, where that comes from, and
    its nominal precision in bits (the number in its name: q8_0 and q8 are both 8, scales left
    out), by which a study compares one engine's cache types with another's (``space.KV_BITS``)."""

    family: str
    bytes_per_element: Fraction
    source: str
    bits: int


_LLAMA_ARGS = "llama.cpp common/arg.cpp kv_cache_types (-ctk/-ctv)"
# ExLlamaV2's quantized caches (exllamav2/cache.py): ExLlamaV2Cache_Q4/Q6/Q8 store K and V as
# uint8 tensors of head_dim // weights_per_byte per head and token (Q4: 2 and 2 per byte; Q6:
# K 1 per byte, V 2 per byte, i.e. 8-bit keys and 4-bit values; Q8: 1 and 1), plus FP16 scales
# of shape head_dim // 32 for K and for V: 2 bytes per 32 elements = 1/16 B per element each.
# Per element, K and V averaged: Q4 1/2 + 1/16 = 9/16; Q6 (1 + 1/2)/2 + 1/16 = 13/16;
# Q8 1 + 1/16 = 17/16. They also keep one FP16 K/V buffer per device, the size of one layer's
# full cache, to dequantize into (touch_device): see cache_fixed_bytes.
_EXL2_CACHE = "exllamav2/cache.py ExLlamaV2Cache_Q4/Q6/Q8: uint8 data + FP16 scale per 32 elements"

CACHE_TYPES: dict[str, CacheType] = {
    # llama.cpp: ggml types; sizes are the ggml block layouts above (ggml-common.h).
    "f32": CacheType("llama.cpp", Fraction(4), f"{_LLAMA_ARGS}: F32", 32),
    "f16": CacheType("llama.cpp", Fraction(2), f"{_LLAMA_ARGS}: F16 (the default)", 16),
    "bf16": CacheType("llama.cpp", Fraction(2), f"{_LLAMA_ARGS}: BF16", 16),
    "q8_0": CacheType("llama.cpp", Fraction(34, 32), f"{_LLAMA_ARGS}: block_q8_0, 34 B / 32", 8),
    "q5_1": CacheType("llama.cpp", Fraction(24, 32), f"{_LLAMA_ARGS}: block_q5_1, 24 B / 32", 5),
    "q5_0": CacheType("llama.cpp", Fraction(22, 32), f"{_LLAMA_ARGS}: block_q5_0, 22 B / 32", 5),
    "q4_1": CacheType("llama.cpp", Fraction(20, 32), f"{_LLAMA_ARGS}: block_q4_1, 20 B / 32", 4),
    "q4_0": CacheType("llama.cpp", Fraction(18, 32), f"{_LLAMA_ARGS}: block_q4_0, 18 B / 32", 4),
    "iq4_nl": CacheType("llama.cpp", Fraction(18, 32), f"{_LLAMA_ARGS}: block_iq4_nl, 18 B / 32", 4),
    # ExLlamaV2 (cache_mode FP16 / Q8 / Q6 / Q4 in TabbyAPI and the examples).
    "fp16": CacheType("exllamav2", Fraction(2), "exllamav2/cache.py ExLlamaV2Cache: torch.half", 16),
    "q8": CacheType("exllamav2", Fraction(17, 16), f"{_EXL2_CACHE}: K 1 + 1/16, V 1 + 1/16", 8),
    "q6": CacheType("exllamav2", Fraction(13, 16), f"{_EXL2_CACHE}: K 1 + 1/16, V 1/2 + 1/16 (mean)", 6),
    "q4": CacheType("exllamav2", Fraction(9, 16), f"{_EXL2_CACHE}: K 1/2 + 1/16, V 1/2 + 1/16", 4),
    # vLLM --kv-cache-dtype: "auto" is the model dtype (FP16/BF16, 2 bytes); the fp8 variants
    # store 1 byte per element (per-tensor scales, negligible).
    "auto": CacheType("vllm", Fraction(2), "vLLM --kv-cache-dtype auto: the model dtype (FP16/BF16)", 16),
    "fp8": CacheType("vllm", Fraction(1), "vLLM --kv-cache-dtype fp8 (= fp8_e4m3)", 8),
    "fp8_e4m3": CacheType("vllm", Fraction(1), "vLLM --kv-cache-dtype fp8_e4m3", 8),
    "fp8_e5m2": CacheType("vllm", Fraction(1), "vLLM --kv-cache-dtype fp8_e5m2", 8),
}


def cache_bits(cache_type: str) -> int | None:
    """Nominal bits of a cache type (``q8_0`` -> 8); None for a name the catalog lacks."""
    ct = CACHE_TYPES.get(str(cache_type).lower())
    return None if ct is None else ct.bits


def _known_cache_types() -> str:
    families: dict[str, list[str]] = {}
    for name, ct in CACHE_TYPES.items():
        families.setdefault(ct.family, []).append(name)
    return "; ".join(f"{family}: {', '.join(names)}" for family, names in families.items())


def _cache_type(name: str) -> CacheType:
    try:
        return CACHE_TYPES[name.lower()]
    except (KeyError, AttributeError):
        raise UnknownNameError(f"unknown KV cache type '{name}' (known: {_known_cache_types()})") from None


def cache_bytes_per_element(cache_type: str) -> float:
    """Bytes one cached K or V element takes in ``cache_type``, scales included.

    Args:
        cache_type: A key of :data:`CACHE_TYPES` (case-insensitive): ``f16``, ``q8_0``, ``q8``...

    Returns:
        Bytes per element (``q8_0`` -> 1.0625).

    Raises:
        UnknownNameError: Unknown name; the message lists the known ones by engine.
    """
    return float(_cache_type(cache_type).bytes_per_element)


def kv_bytes_per_token(
    model: ModelSpec, k_type: str, v_type: str | None = None, *, n_layers: int | None = None
) -> float:
    """KV-cache bytes per token of context: ``layers * n_kv_heads * head_dim * (bytes_k + bytes_v)``.

    Args:
        model: The model.
        k_type: Cache type of K.
        v_type: Cache type of V; defaults to ``k_type`` (ExLlamaV2 and vLLM have one setting
            for both; llama.cpp has ``-ctk`` and ``-ctv``).
        n_layers: Layers whose cache grows with every token; defaults to all of them. For
            models with sliding-window layers, pass ``model.n_layers - model.n_swa_layers`` and
            add the windowed layers' fixed ``sliding_window`` tokens yourself.

    Returns:
        Bytes per token (131072.0 for the article's model in f16).

    Raises:
        UnknownNameError: An unknown cache type.
        ConfigError: K and V types of different engines.
    """
    k = _cache_type(k_type)
    v = _cache_type(v_type) if v_type is not None else k
    if k.family != v.family:
        raise ConfigError(
            f"cache types '{k_type}' ({k.family}) and '{v_type}' ({v.family}) belong to different engines"
        )
    layers = model.n_layers if n_layers is None else n_layers
    return float(layers * model.kv_dim * (k.bytes_per_element + v.bytes_per_element))


def cache_fixed_bytes(model: ModelSpec, cache_type: str, n_tokens: int) -> int:
    """Bytes a cache type allocates once per device, on top of the per-token cache.

    ExLlamaV2's quantized caches (q8/q6/q4) keep an FP16 K and V buffer of shape
    (batch, max_seq_len, n_kv_heads, head_dim) per device to dequantize into
    (exllamav2/cache.py, ``touch_device``): the size of one layer's FP16 cache for the whole
    context. Other cache types have none.

    Args:
        model: The model.
        cache_type: A cache type.
        n_tokens: Cache capacity in tokens (max_seq_len x batch).

    Returns:
        Bytes, 0 for types without such buffers.

    Raises:
        UnknownNameError: An unknown cache type.
    """
    ct = _cache_type(cache_type)
    if ct.family == "exllamav2" and cache_type.lower() != "fp16":
        return 2 * 2 * n_tokens * model.kv_dim
    return 0
