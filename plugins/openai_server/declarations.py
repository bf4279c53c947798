"""What vLLM (and SGLang, which spells them alike) knows, as data: its ``--kv-cache-dtype`` values.

Declared by the openai-server backend, which serves vLLM, and by the twin of vLLM
(``BaseBackend.kv_cache_types``). Importing this module costs nothing.
"""

from __future__ import annotations

from fractions import Fraction

from autotune.api import CacheType

__all__ = ["CACHE_TYPES"]

_FAMILY = "vllm"

# "auto" is the model dtype (FP16/BF16, 2 bytes); the fp8 variants store 1 byte per element
# (per-tensor scales, negligible).
CACHE_TYPES = (
    CacheType("auto", _FAMILY, Fraction(2), "vLLM --kv-cache-dtype auto: the model dtype (FP16/BF16)", 16),
    CacheType("fp8", _FAMILY, Fraction(1), "vLLM --kv-cache-dtype fp8 (= fp8_e4m3)", 8),
    CacheType("fp8_e4m3", _FAMILY, Fraction(1), "vLLM --kv-cache-dtype fp8_e4m3", 8),
    CacheType("fp8_e5m2", _FAMILY, Fraction(1), "vLLM --kv-cache-dtype fp8_e5m2", 8),
)
