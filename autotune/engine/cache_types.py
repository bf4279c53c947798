"""KV-cache element types: the catalog of those the installed backends declare, and their sizes.

Each backend declares its engine's cache types as data (``BaseBackend.kv_cache_types``, a tuple
of :class:`~autotune.engine.declarations.CacheType`); :func:`catalog` gathers those of the installed
backends by name; :func:`kv_bytes_per_token` turns a model and a cache type into bytes per
token of context; :func:`cache_fixed_bytes` adds what a cache type allocates once per device.
"""

from __future__ import annotations

from collections.abc import Iterable

from autotune import plugins
from autotune.engine.declarations import CacheType
from autotune.errors import ConfigError, PluginError, UnknownNameError
from autotune.modelfiles.models import ModelSpec

__all__ = [
    "CacheType",
    "cache_bits",
    "cache_bytes_per_element",
    "cache_fixed_bytes",
    "catalog",
    "kv_bytes_per_token",
    "resolve",
]

_catalog: tuple[int, dict[str, CacheType], dict[str, frozenset[str]]] | None = None


def _figures(ct: CacheType) -> tuple:
    return ct.bytes_per_element, ct.bits, ct.dequant_layers


def catalog() -> dict[str, CacheType]:
    """Every cache type the installed backends declare, by (lower-case) name.

    Computed once per change of the installed plugins. Two backends may declare one name with
    the same figures (a real engine and its twin share one table; another engine spells its
    FP16 cache ``f16`` too): the first is kept. The same name with other figures (bytes per
    element, bits, dequantize layers) is refused, since a study's value would mean two sizes.

    Raises:
        PluginError: Two backends declare one name differently; the message names both.
    """
    return _gathered()[1]


def _gathered() -> tuple[int, dict[str, CacheType], dict[str, frozenset[str]]]:
    """(plugins' version, the catalog, the engines that declare each name)."""
    global _catalog
    plugins.load_plugins()
    version = plugins.version()
    if _catalog is not None and _catalog[0] == version:
        return _catalog
    found: dict[str, CacheType] = {}
    owner: dict[str, str] = {}
    families: dict[str, set[str]] = {}
    for name, backend in plugins.get_backends().items():
        for ct in getattr(backend, "kv_cache_types", ()):
            key = ct.name.lower()
            if key in found and _figures(found[key]) != _figures(ct):
                raise PluginError(
                    f"cache type '{key}' is declared twice, differently: by backend '{owner[key]}' "
                    f"({found[key]}) and by backend '{name}' ({ct})"
                )
            found.setdefault(key, ct)
            owner.setdefault(key, name)
            families.setdefault(key, set()).add(ct.family)
    _catalog = (version, found, {k: frozenset(v) for k, v in families.items()})
    return _catalog


def _engines_of(ct: CacheType) -> frozenset[str]:
    """The engines that store ``ct``: its own, and any other that declares its name alike."""
    return frozenset({ct.family}) | _gathered()[2].get(ct.name.lower(), frozenset())


def resolve(cache_type: str | CacheType, declared: Iterable[CacheType] = ()) -> CacheType | None:
    """The declaration of ``cache_type``: itself when it is one; else, by name (any case), the
    first of ``declared`` (a backend's own, so that a backend used without the registry knows
    its types) or the installed backends' :func:`catalog`; None when neither has it."""
    if isinstance(cache_type, CacheType):
        return cache_type
    key = str(cache_type).lower()
    for ct in declared:
        if ct.name.lower() == key:
            return ct
    return catalog().get(key)


def cache_bits(cache_type: str | CacheType, declared: Iterable[CacheType] = ()) -> int | None:
    """Nominal bits of a cache type (``q8_0`` -> 8); None for a name neither ``declared`` nor
    the catalog has (see :func:`resolve`)."""
    ct = resolve(cache_type, declared)
    return None if ct is None else ct.bits


def _known_cache_types() -> str:
    families: dict[str, list[str]] = {}
    for name, ct in catalog().items():
        families.setdefault(ct.family, []).append(name)
    return "; ".join(f"{family}: {', '.join(names)}" for family, names in families.items())


def _cache_type(name: str | CacheType) -> CacheType:
    ct = resolve(name)
    if ct is None:
        known = _known_cache_types() or "none: no installed backend declares one"
        raise UnknownNameError(f"unknown KV cache type '{name}' (known: {known})")
    return ct


def cache_bytes_per_element(cache_type: str | CacheType) -> float:
    """Bytes one cached K or V element takes in ``cache_type``, scales included.

    Args:
        cache_type: A declaration, or a name of :func:`catalog` (case-insensitive): ``f16``,
            ``q8_0``, ``q8``...

    Returns:
        Bytes per element (``q8_0`` -> 1.0625).

    Raises:
        UnknownNameError: Unknown name; the message lists the known ones by engine.
    """
    return float(_cache_type(cache_type).bytes_per_element)


def kv_bytes_per_token(
    model: ModelSpec, k_type: str | CacheType, v_type: str | CacheType | None = None, *, n_layers: int | None = None
) -> float:
    """KV-cache bytes per token of context: ``layers * n_kv_heads * head_dim * (bytes_k + bytes_v)``.

    Args:
        model: The model.
        k_type: Cache type of K.
        v_type: Cache type of V; defaults to ``k_type`` (most engines have one setting for
            both; llama.cpp has ``-ctk`` and ``-ctv``).
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
    if not _engines_of(k) & _engines_of(v):
        raise ConfigError(
            f"cache types '{k_type}' ({k.family}) and '{v_type}' ({v.family}) belong to different engines"
        )
    layers = model.n_layers if n_layers is None else n_layers
    return float(layers * model.kv_dim * (k.bytes_per_element + v.bytes_per_element))


def cache_fixed_bytes(model: ModelSpec, cache_type: str | CacheType, n_tokens: int) -> int:
    """Bytes a cache type allocates once per device, on top of the per-token cache.

    A type that declares ``dequant_layers`` keeps that many layers of FP16 K and V, of shape
    (batch, max_seq_len, n_kv_heads, head_dim), per device to dequantize into (ExLlamaV2's
    quantized caches keep one: exllamav2/cache.py, ``touch_device``). Other types have none.

    Args:
        model: The model.
        cache_type: A cache type.
        n_tokens: Cache capacity in tokens (max_seq_len x batch).

    Returns:
        Bytes, 0 for types without such buffers.

    Raises:
        UnknownNameError: An unknown cache type.
    """
    return _cache_type(cache_type).dequant_layers * 2 * 2 * n_tokens * model.kv_dim
