"""What a backend declares as data: the KV-cache types and the weight formats its engine knows.

A backend class lists them as class attributes (``BaseBackend.kv_cache_types`` and
``BaseBackend.weight_formats``); the core reads the declarations of the installed backends
(:mod:`autotune.cache_types` for cache sizes and bits, ``autotune estimate`` for what a format
is, ``autotune init`` for the formats it offers). A new engine, format or cache type is
declared by the plugin that understands it; the core names none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from autotune import plugins

__all__ = ["CacheType", "WeightFormats", "installed_weight_formats"]


@dataclass(frozen=True)
class CacheType:
    """A KV-cache element type as an engine stores it.

    Attributes:
        name: The engine's own spelling, as a study file's ``cache_type`` gives it (``q8_0``);
            looked up case-insensitively, so it is declared lower-case.
        family: The engine whose cache this is. K and V of one configuration must share it
            (``kv_bytes_per_token`` refuses a mix).
        bytes_per_element: Bytes of one cached K or V element, scales included, exact.
        source: Where that size comes from (the engine's source file and struct), for readers.
        bits: Nominal precision, the number in the name (``q8_0`` and ``q8`` are both 8, scales
            left out): a study compares one engine's cache types with another's by it
            (``space.KV_BITS``).
        dequant_layers: Layers of FP16 K and V, for the whole context, that the engine keeps
            once per device to dequantize into (ExLlamaV2's quantized caches keep one);
            ``cache_types.cache_fixed_bytes`` adds them to the memory.
    """

    name: str
    family: str
    bytes_per_element: Fraction
    source: str
    bits: int
    dequant_layers: int = 0


@dataclass(frozen=True)
class WeightFormats:
    """A family of weight formats, ``NAME:VARIANT`` (``gguf:Q4_K_M``), that a backend can make
    from a model's source and load.

    Attributes:
        name: The family, the part before the colon (lower-case): a ``--weights`` or
            ``[[candidates]] weights`` value ``NAME:...`` is a format rather than a path.
        syntax: How a user writes one (``gguf:<TYPE>``), for messages.
        offered: The formats ``autotune init`` offers, widest first; each backend keeps those
            its ``artifact_recipe`` can make from the source.
        full_precision: Those of ``offered`` at the source's own precision: with a quality
            metric, one of them (or the source itself) is the reference.
    """

    name: str
    syntax: str
    offered: tuple[str, ...] = ()
    full_precision: tuple[str, ...] = ()


def installed_weight_formats() -> dict[str, WeightFormats]:
    """The weight-format families the installed backends declare, by name, in the backends'
    order; a family two backends declare (a real engine and its twin) comes once, as the first
    declares it."""
    found: dict[str, WeightFormats] = {}
    for backend in plugins.get_backends().values():
        for family in getattr(backend, "weight_formats", ()):
            found.setdefault(family.name.lower(), family)
    return found
