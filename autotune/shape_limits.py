"""The accepted range of each field of a model's shape, whatever the source reads it from.

The catalog, a GGUF header and a config.json all become an :class:`autotune.models.ModelSpec`;
each source checks what it read against these ranges before using it, and names its own key.
The ranges are the largest real decoder-only models with room to spare (Llama 3.1 405B: 126
layers, 16384 wide, 53248 FFN, 128 heads; Llama 4 Scout: a 10M-token context; Gemma 3: a 262k
vocabulary). A value beyond them is a damaged or crafted file, and would reach the memory and
speed models as a division by zero or a per-layer table of billions of entries.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

__all__ = ["SHAPE_LIMITS", "shape_problem"]

SHAPE_LIMITS: Mapping[str, tuple[int, int]] = types.MappingProxyType({
    "n_layers": (1, 4096), "hidden_size": (1, 1 << 20), "n_heads": (1, 1 << 16), "n_kv_heads": (1, 1 << 16),
    "head_dim": (1, 1 << 16), "ffn_size": (1, 1 << 24), "vocab_size": (1, 1 << 24), "max_context": (1, 1 << 30),
})


def shape_problem(key: str, value: Any, field_name: str) -> str | None:
    """Why ``value`` (read as ``key``) cannot be the model's ``field_name``, or None."""
    lo, hi = SHAPE_LIMITS[field_name]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        return f"{key} = {value!r}: must be an integer from {lo} to {hi:,}"
    return None
