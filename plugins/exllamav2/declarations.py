"""What ExLlamaV2 knows, as data: its KV-cache modes and the EXL2 formats.

Declared by the exllamav2 backend and by the twin of ExLlamaV2 (``BaseBackend.kv_cache_types``,
``BaseBackend.weight_formats``); TabbyAPI, behind openai-server, names the same modes. Importing
this module costs nothing (no torch); the formats' callables are
:mod:`autotune_plugins.exllamav2.formats`.
"""

from __future__ import annotations

from fractions import Fraction

from autotune.api import CacheType, WeightFormats
from autotune_plugins.exllamav2 import formats

__all__ = ["CACHE_TYPES", "EXL2", "PYTHON_ENGINE_VARIABLES"]

_FAMILY = "exllamav2"
# ExLlamaV2's quantized caches (exllamav2/cache.py): ExLlamaV2Cache_Q4/Q6/Q8 store K and V as
# uint8 tensors of head_dim // weights_per_byte per head and token (Q4: 2 and 2 per byte; Q6:
# K 1 per byte, V 2 per byte, i.e. 8-bit keys and 4-bit values; Q8: 1 and 1), plus FP16 scales
# of shape head_dim // 32 for K and for V: 2 bytes per 32 elements = 1/16 B per element each.
# Per element, K and V averaged: Q4 1/2 + 1/16 = 9/16; Q6 (1 + 1/2)/2 + 1/16 = 13/16;
# Q8 1 + 1/16 = 17/16. They also keep one FP16 K/V buffer per device, the size of one layer's
# full cache, to dequantize into (touch_device): dequant_layers=1.
_QUANT = "exllamav2/cache.py ExLlamaV2Cache_Q4/Q6/Q8: uint8 data + FP16 scale per 32 elements"

# cache_mode FP16 / Q8 / Q6 / Q4, as TabbyAPI and the examples name them.
CACHE_TYPES = (
    CacheType("fp16", _FAMILY, Fraction(2), "exllamav2/cache.py ExLlamaV2Cache: torch.half", 16),
    CacheType("q8", _FAMILY, Fraction(17, 16), f"{_QUANT}: K 1 + 1/16, V 1 + 1/16", 8, dequant_layers=1),
    CacheType("q6", _FAMILY, Fraction(13, 16), f"{_QUANT}: K 1 + 1/16, V 1/2 + 1/16 (mean)", 6, dequant_layers=1),
    CacheType("q4", _FAMILY, Fraction(9, 16), f"{_QUANT}: K 1/2 + 1/16, V 1/2 + 1/16", 4, dequant_layers=1),
)

# What `autotune init` offers, widest first. None is full precision: an FP16 model directory,
# loaded as it is, is the quality reference (init checks check_weights on the source).
EXL2 = WeightFormats(
    "exl2",
    "exl2:<bpw>",
    offered=("exl2:8.0", "exl2:6.0", "exl2:5.0", "exl2:4.0", "exl2:3.0"),
    accepts=formats.ACCEPTS,
    parse=formats.bpw_of,
    spell=formats.spell,
    predict=formats.exl2_weights,
    bits=formats.bits_per_weight,
    quote=formats.quote,
)

# What a Python engine (the worker, the converter, TabbyAPI) needs of autotune's environment
# beyond the core's allow-list (``BaseBackend.engine_variables``): its interpreter's setup,
# torch's and Hugging Face's caches, and the compiler torch's extension loader builds with.
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
    "MAX_JOBS",
    "EXLLAMA_*",
)
