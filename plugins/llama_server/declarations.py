"""What llama.cpp knows, as data: its KV-cache types (``-ctk``/``-ctv``) and the GGUF formats.

Declared by the llama-server backend and by the twin of llama.cpp (``BaseBackend.kv_cache_types``,
``BaseBackend.weight_formats``); importing this module costs nothing. The formats' callables
are :mod:`autotune_plugins.llama_server.formats`.
"""

from __future__ import annotations

from fractions import Fraction

from autotune.api import CacheType, WeightFormats
from autotune_plugins.llama_server import formats

__all__ = ["CACHE_TYPES", "GGUF"]

_ARGS = "llama.cpp common/arg.cpp kv_cache_types (-ctk/-ctv)"
_FAMILY = "llama.cpp"

# ggml types; sizes are the ggml block layouts (ggml-common.h): a block of 32 elements and its scale(s).
CACHE_TYPES = (
    CacheType("f32", _FAMILY, Fraction(4), f"{_ARGS}: F32", 32),
    CacheType("f16", _FAMILY, Fraction(2), f"{_ARGS}: F16 (the default)", 16),
    CacheType("bf16", _FAMILY, Fraction(2), f"{_ARGS}: BF16", 16),
    CacheType("q8_0", _FAMILY, Fraction(34, 32), f"{_ARGS}: block_q8_0, 34 B / 32", 8),
    CacheType("q5_1", _FAMILY, Fraction(24, 32), f"{_ARGS}: block_q5_1, 24 B / 32", 5),
    CacheType("q5_0", _FAMILY, Fraction(22, 32), f"{_ARGS}: block_q5_0, 22 B / 32", 5),
    CacheType("q4_1", _FAMILY, Fraction(20, 32), f"{_ARGS}: block_q4_1, 20 B / 32", 4),
    CacheType("q4_0", _FAMILY, Fraction(18, 32), f"{_ARGS}: block_q4_0, 18 B / 32", 4),
    CacheType("iq4_nl", _FAMILY, Fraction(18, 32), f"{_ARGS}: block_iq4_nl, 18 B / 32", 4),
)

# What `autotune init` offers a llama.cpp backend, widest first; F16 is the source's precision.
GGUF = WeightFormats(
    "gguf",
    "gguf:<TYPE>",
    offered=("gguf:F16", "gguf:Q8_0", "gguf:Q6_K", "gguf:Q5_K_M", "gguf:Q4_K_M", "gguf:Q4_0"),
    full_precision=("gguf:F16", "gguf:BF16", "gguf:F32"),
    accepts=formats.ACCEPTS,
    parse=formats.file_type,
    predict=formats.predict_gguf_weights,
    bits=formats.bits_per_weight,
    quote=formats.quote,
)

# The numeric options' ranges, as llama.cpp's own parser takes them: -ngl, -ub, -b and
# --n-cpu-moe are read with std::stoi into a C int, so a larger value (gpu_layers = 10**12,
# ubatch = 2**40) is refused by llama-server at start. Declared here, beside the cache types, so
# that every backend of the engine (llama-server, its twin) refuses the same values up front.
INT32_MAX = 2**31 - 1
OPTION_RANGES: dict[str, tuple[int, int]] = {
    "gpu_layers": (0, INT32_MAX),
    "n_cpu_moe": (0, INT32_MAX),
    "ubatch": (1, INT32_MAX),
    "batch": (1, INT32_MAX),
}
