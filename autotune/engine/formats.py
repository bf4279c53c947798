"""Weight formats: a registry of the families the installed backends declare, and their bytes.

A format is ``NAME:VARIANT``; the family ``NAME`` is declared by a backend that understands it
(:class:`~autotune.engine.declarations.WeightFormats` in ``BaseBackend.weight_formats``), with the
callables that read a variant, spell it and predict its bytes. This module knows no family:
:func:`parse_format`, :func:`normalize_format`, :func:`bits_per_weight` and :func:`weights_for`
find the family's declaration and call it, and :func:`weights_for` calibrates the prediction
against artifact sizes the model spec quotes. :func:`safetensors_dir_weights` gives the
breakdown of a model directory from its safetensors headers.

KV-cache element types are in :mod:`autotune.engine.cache_types`.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from autotune import plugins
from autotune.engine.declarations import WeightFormats, WeightsBreakdown, installed_weight_formats
from autotune.errors import UnknownNameError
from autotune.modelfiles.safetensors_dir import read_safetensors_dir

if TYPE_CHECKING:
    from autotune.modelfiles.models import ModelSpec

__all__ = [
    "WeightsBreakdown",
    "bits_per_weight",
    "families",
    "family_of",
    "normalize_format",
    "parse_format",
    "safetensors_dir_weights",
    "weights_for",
]

# =============================================================================================
# Breakdown of weight bytes
# =============================================================================================


# WeightsBreakdown is declared in autotune/engine/declarations.py (what a format's predictor returns):
# kept there so that the declarations need nothing of this module, which reads them.


def safetensors_dir_weights(path: str | os.PathLike[str], tied: bool | None = None) -> WeightsBreakdown:
    """The exact weight bytes of a model directory (EXL2 or Hugging Face), from its safetensors headers.

    A directory says nothing of where an engine puts the embedding, so ``embedding_on_gpu`` is
    True; an engine that keeps it in host memory (ExLlamaV2, llama.cpp) replaces that.

    Args:
        path: The directory (:func:`autotune.modelfiles.safetensors_dir.read_safetensors_dir`).
        tied: Whether the head is tied to the embedding (default: config.json's
            ``tie_word_embeddings``). Tied without ``lm_head`` tensors: ``head_is_embedding``.

    Raises:
        ConfigError: Not a directory, no safetensors file, or a malformed one.
    """
    d = read_safetensors_dir(path)
    per_layer: dict[int, int] = {}
    emb = head = other = 0
    for t in d.tensors:
        if t.layer is not None:
            per_layer[t.layer] = per_layer.get(t.layer, 0) + t.n_bytes
        elif t.is_embedding:
            emb += t.n_bytes
        elif t.is_head:
            head += t.n_bytes
        else:
            other += t.n_bytes
    layers = tuple(per_layer.get(i, 0) for i in range(max(per_layer, default=-1) + 1))
    tied = d.tied if tied is None else tied
    return WeightsBreakdown(emb, head, layers, other, embedding_on_gpu=True, head_is_embedding=tied and head == 0)


# =============================================================================================
# Format names
# =============================================================================================


_families: tuple[int, dict[str, WeightFormats]] | None = None


def families() -> dict[str, WeightFormats]:
    """The weight-format families the installed backends declare, by (lower-case) name.

    Computed once per change of the installed plugins: a study parses formats thousands of
    times. A family two backends declare (a real engine and its twin) comes once, as the first
    declares it.
    """
    global _families
    plugins.load_plugins()
    version = plugins.version()
    if _families is None or _families[0] != version:
        _families = (version, installed_weight_formats())
    return _families[1]


def _known(declared: Iterable[WeightFormats]) -> dict[str, WeightFormats]:
    own = {f.name.lower(): f for f in declared}
    return own | {k: f for k, f in families().items() if k not in own} if own else families()


def _find(name: str, declared: Iterable[WeightFormats]) -> WeightFormats | None:
    # _known without building it: asked at every proposal, with a backend's one or two families.
    for f in declared:
        if f.name.lower() == name:
            return f
    return families().get(name)


def _format_error(fmt: str, declared: Iterable[WeightFormats]) -> str:
    accepted = " or ".join(f.accepts or f.syntax for f in _known(declared).values())
    return f"unknown weights format '{fmt}' (use {accepted or 'none: no installed backend declares a format'})"


def family_of(fmt: str, declared: Iterable[WeightFormats] = ()) -> WeightFormats | None:
    """The declaration of the family ``fmt`` names (``gguf:Q4_K_M`` -> the one named ``gguf``),
    whether or not its variant is one: the first of ``declared`` of that name (a backend's own,
    so that a backend used without the registry knows its formats), else the installed
    backends' (:func:`families`); None when neither has it."""
    name, sep, _ = str(fmt).strip().partition(":")
    return _find(name.lower(), declared) if sep else None


def _parsed(fmt: str, declared: Iterable[WeightFormats] = ()) -> tuple[WeightFormats, object]:
    declared = tuple(declared)
    name, sep, variant = str(fmt).strip().partition(":")
    family = _find(name.lower(), declared) if sep else None
    if family is not None:
        variant = variant.strip()
        if family.parse is None:
            return family, variant
        try:
            return family, family.parse(variant)
        except ValueError:
            pass
    raise UnknownNameError(_format_error(fmt, declared))


def parse_format(fmt: str, declared: Iterable[WeightFormats] = ()) -> tuple[str, object]:
    """Splits a weights format into its family and its variant's value.

    Args:
        fmt: ``NAME:VARIANT`` of a family an installed backend declares (the name is
            case-insensitive; the variant is read by the family's ``parse``): ``gguf:q4_k_m``,
            ``exl2:4``.
        declared: Families to look in first (see :func:`family_of`).

    Returns:
        The family's name and the value (``("gguf", "Q4_K_M")``, ``("exl2", 4.0)``).

    Raises:
        UnknownNameError: No installed family has it; the message lists what is accepted.
    """
    family, value = _parsed(fmt, declared)
    return family.name, value


def normalize_format(fmt: str, declared: Iterable[WeightFormats] = ()) -> str:
    """Returns the canonical spelling of a format (``gguf:Q4_K_M``, ``exl2:4.0``): the family's
    name and its ``spell`` of the value, so that two spellings of one format are one key.

    Raises:
        UnknownNameError: As :func:`parse_format`.
    """
    family, value = _parsed(fmt, declared)
    return f"{family.name}:{family.spell(value)}"


def _unsized(family: WeightFormats, what: str) -> UnknownNameError:
    return UnknownNameError(f"weights format family '{family.name}' ({family.syntax}) declares no {what}")


def bits_per_weight(fmt: str, model: ModelSpec | None = None, declared: Iterable[WeightFormats] = ()) -> float:
    """Nominal bits per weight of a format's linear layers, as its family declares (``bits``).

    Args:
        fmt: A weights format.
        model: When given, a figure averaged over this model's decoder matrices where the
            family's mix depends on the tensor (GGUF's Q4_K_M is ~4.8 on Qwen2.5-7B, 4.5
            without a model).
        declared: Families to look in first (see :func:`family_of`).

    Returns:
        Bits per weight, scales included.

    Raises:
        UnknownNameError: ``fmt`` is not a known format, or its family declares no bits.
    """
    family, value = _parsed(fmt, declared)
    if family.bits is None:
        raise _unsized(family, "bits per weight")
    return family.bits(value, model)


def _interpolate(points: Iterable[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation through (x, y) points, constant beyond the ends."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]  # pragma: no cover - unreachable with sorted points


def weights_for(model: ModelSpec, fmt: str, declared: Iterable[WeightFormats] = ()) -> WeightsBreakdown:
    """Weight bytes of ``model`` in ``fmt``, calibrated against the sizes the model quotes.

    The family's prediction (its declared ``predict``, from the architecture) is then corrected:

    * If ``model.artifact_bytes`` quotes this exact format, the breakdown is scaled so its
      total is exactly the quoted size: a real file's size beats any prediction.
    * Else, if it quotes other formats of the same family, the breakdown is scaled by the
      ratio quoted/computed of those formats, interpolated linearly in the computed size
      between the quoted formats on either side (and held constant beyond the smallest and
      largest). One quoted format gives its ratio everywhere.

    Why interpolate rather than take one mean ratio: a single mean keeps an unquoted format
    consistent with quoted ones only far from them. Next to a quoted format it can invert the
    order (with the article's figures, a mean ratio makes exl2:3.29 larger than the quoted
    exl2:3.3), while an interpolated ratio agrees with each quoted size at that size and
    changes slowly in between, so sizes stay ordered as the formats are (exl2:3.5 lands between
    the quoted 3.3 and 4.0).

    Args:
        model: The model, with any quoted ``artifact_bytes``.
        fmt: A format of an installed family (``gguf:<TYPE>``, ``exl2:<bpw>``...).
        declared: Families to look in first (see :func:`family_of`).

    Returns:
        The calibrated breakdown.

    Raises:
        UnknownNameError: ``fmt`` is not a known format, or its family predicts no sizes.
    """
    plugins.load_plugins()
    return _weights_for(model, fmt, tuple(declared), plugins.version())


# A study judges hundreds of configurations over a dozen (model, format) pairs, and a GGUF
# prediction walks every tensor (12 ms on 2 cores): 14% of the default study. The answer is a
# function of the frozen ModelSpec (its quoted sizes included: they take part in its equality),
# the family's declaration and the canonical variant alone. The outer cache spares a repeated
# question its parse (4x a cached answer); the installed plugins' version is in its key, since
# they say what a family name means.
@functools.lru_cache(maxsize=256)
def _weights_for(model: ModelSpec, fmt: str, declared: tuple[WeightFormats, ...], version: int) -> WeightsBreakdown:
    family, value = _parsed(fmt, declared)
    if family.predict is None:
        raise _unsized(family, "size prediction (predict)")
    return _calibrated(model, family, family.spell(value))


@functools.lru_cache(maxsize=256)
def _calibrated(model: ModelSpec, family: WeightFormats, variant: str) -> WeightsBreakdown:
    assert family.predict is not None
    parse = family.parse or str
    computed = family.predict(model, parse(variant))
    points: list[tuple[float, float]] = []
    for quoted_fmt, quoted_bytes in model.artifact_bytes.items():
        q_name, sep, q_variant = str(quoted_fmt).strip().partition(":")
        if not sep or q_name.lower() != family.name:
            continue
        try:
            q_value = parse(q_variant.strip())
        except ValueError:
            continue  # a quoted artifact of a variant we cannot predict (e.g. an IQ quant)
        if family.spell(q_value) == variant:
            return computed.scaled_to(int(quoted_bytes))
        q_total = family.predict(model, q_value).total_bytes
        points.append((q_total, quoted_bytes / q_total))
    if not points:
        return computed
    ratio = _interpolate(points, computed.total_bytes)
    return computed.scaled_to(round(computed.total_bytes * ratio))
