"""The accepted range of each field of a model's shape, whatever the source reads it from.

The catalog, a GGUF header and a config.json all become an :class:`autotune.modelfiles.models.ModelSpec`;
each source checks what it read against these ranges before using it, and names its own key.
The ranges are the largest real decoder-only models with room to spare (Llama 3.1 405B: 126
layers, 16384 wide, 53248 FFN, 128 heads; Llama 4 Scout: a 10M-token context; Gemma 3: a 262k
vocabulary). A value beyond them is a damaged or crafted file, and would reach the memory and
speed models as a division by zero or a per-layer table of billions of entries.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["EXPERT_LIMITS", "SHAPE_LIMITS", "expert_fields", "shape_problem"]

SHAPE_LIMITS: Mapping[str, tuple[int, int]] = types.MappingProxyType(
    {
        "n_layers": (1, 4096),
        "hidden_size": (1, 1 << 20),
        "n_heads": (1, 1 << 16),
        "n_kv_heads": (1, 1 << 16),
        "head_dim": (1, 1 << 16),
        "ffn_size": (1, 1 << 24),
        "vocab_size": (1, 1 << 24),
        "max_context": (1, 1 << 30),
    }
)
# A mixture of experts' routing, checked only where a file says it has experts (a dense model's
# are 0). DeepSeek-V3 and Kimi K2 route among 256 and 384 experts; 16k is room to spare.
EXPERT_LIMITS: Mapping[str, tuple[int, int]] = types.MappingProxyType(
    {
        "n_experts": (1, 1 << 14),
        "n_experts_used": (1, 1 << 14),
        "expert_ffn_size": (1, 1 << 24),
    }
)


def shape_problem(key: str, value: Any, field_name: str) -> str | None:
    """Why ``value`` (read as ``key``) cannot be the model's ``field_name``, or None."""
    lo, hi = SHAPE_LIMITS[field_name] if field_name in SHAPE_LIMITS else EXPERT_LIMITS[field_name]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        return f"{key} = {value!r}: must be an integer from {lo} to {hi:,}"
    return None


def expert_fields(get: Callable[[str], Any], arch: str, ffn: int, problems: list[str]) -> tuple[int, int, int]:
    """A GGUF header's mixture-of-experts keys (``get("expert_count")``...) as (experts, used,
    expert width), (0, 0, 0) for a dense model; each value out of range is added to ``problems``."""
    n = get("expert_count") or 0
    if n == 0:
        return 0, 0, 0
    used, width = get("expert_used_count"), get("expert_feed_forward_length")
    if width is None and isinstance(used, int) and not isinstance(used, bool) and used > 0:
        width = ffn // used  # llama.cpp's own fallback when the key is absent
    found = [
        (f"{arch}.expert_count", n, "n_experts"),
        (f"{arch}.expert_used_count", used, "n_experts_used"),
        (f"{arch}.expert_feed_forward_length", width, "expert_ffn_size"),
    ]
    bad = [why for key, value, name in found if (why := shape_problem(key, value, name))]
    if not bad and used > n:
        bad.append(f"{arch}.expert_used_count = {used}: more than the {n} experts")
    problems += bad
    return (0, 0, 0) if bad else (n, used, width)
