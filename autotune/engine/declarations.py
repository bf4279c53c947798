"""What a backend declares as data: the KV-cache types and the weight formats its engine knows.

A backend class lists them as class attributes (``BaseBackend.kv_cache_types`` and
``BaseBackend.weight_formats``); the core reads the declarations of the installed backends
(:mod:`autotune.engine.cache_types` for cache sizes and bits, ``autotune estimate`` for what a format
is, ``autotune init`` for the formats it offers). A new engine, format or cache type is
declared by the plugin that understands it; the core names none of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from autotune import plugins

if TYPE_CHECKING:
    from pathlib import Path

    from autotune.modelfiles.model_spec import ModelSpec

__all__ = ["CacheType", "WeightFormats", "WeightsBreakdown", "installed_weight_formats"]


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


# eq=False: a declaration is itself (hashed by identity), as the cache of predicted sizes keys
# it at every proposal; hashing its fields each time was most of a cached weights_for.
@dataclass(frozen=True, eq=False)
class WeightFormats:
    """A family of weight formats, ``NAME:VARIANT`` (``gguf:Q4_K_M``), that a backend can make
    from a model's source and load, with what the core needs to read, spell and size one.

    :mod:`autotune.engine.formats` dispatches on the family's name to these callables; it knows no
    format of its own. A family that declares only ``name`` and ``syntax`` is a format for
    ``estimate`` and ``init`` (its variants taken as written) but has no predicted size.

    Attributes:
        name: The family, the part before the colon (lower-case): a ``--weights`` or
            ``[[candidates]] weights`` value ``NAME:...`` is a format rather than a path.
        syntax: How a user writes one (``gguf:<TYPE>``), for messages.
        offered: The formats ``autotune init`` offers, widest first; each backend keeps those
            its ``artifact_recipe`` can make from the source.
        full_precision: Those of ``offered`` at the source's own precision: with a quality
            metric, one of them (or the source itself) is the reference.
        accepts: What a bad format's message says is accepted (``exl2:<bpw> with bpw
            2.0-8.0``); ``syntax`` when empty.
        parse: The variant as written (after the colon, stripped) -> its value, in the form
            the other callables take (``"q4_k_m"`` -> ``"Q4_K_M"``, ``"4"`` -> ``4.0``); raises
            ``ValueError`` for one the family does not have. None: the variant as written.
        spell: A value -> its canonical variant text (``4.0`` -> ``"4.0"``), so that two
            spellings of one format are one key.
        predict: ``(model, value) -> WeightsBreakdown``: the weight bytes from the
            architecture, before :func:`autotune.engine.formats.weights_for` calibrates them against
            the sizes the model quotes. None: the family's sizes are not predicted.
        bits: ``(value, model or None) -> float``: nominal bits per weight of the decoder's
            linear layers, scales included (with a model, averaged over its matrices).
        quote: ``(path) -> (format, bytes) or None``: a model source on disk that is an
            artifact of this family (a GGUF file, an EXL2 directory), as its format and size;
            :mod:`autotune.modelfiles.models` quotes them, and :func:`autotune.engine.formats.weights_for`
            calibrates against the quotes.
    """

    name: str
    syntax: str
    offered: tuple[str, ...] = ()
    full_precision: tuple[str, ...] = ()
    accepts: str = ""
    parse: Callable[[str], Any] | None = None
    spell: Callable[[Any], str] = str
    predict: Callable[[ModelSpec, Any], WeightsBreakdown] | None = None
    bits: Callable[[Any, ModelSpec | None], float] | None = None
    quote: Callable[[Path], tuple[str, int] | None] | None = None


def installed_weight_formats() -> dict[str, WeightFormats]:
    """The weight-format families the installed backends declare, by name, in the backends'
    order; a family two backends declare (a real engine and its twin) comes once, as the first
    declares it."""
    found: dict[str, WeightFormats] = {}
    for backend in plugins.get_backends().values():
        for family in getattr(backend, "weight_formats", ()):
            found.setdefault(family.name.lower(), family)
    return found


@dataclass(frozen=True)
class WeightsBreakdown:
    """Bytes of a model's weights, by where they live and when they are read.

    Attributes:
        embedding_bytes: The token-embedding matrix. Only one row per token is read when
            decoding, so it costs memory but almost no bandwidth.
        output_bytes: The output head (lm_head); 0 when a GGUF file ties embeddings, where
            the embedding matrix serves as the head (see ``head_is_embedding``).
        per_layer_bytes: Each decoder layer's weights, norms and biases included.
        other_bytes: Everything else (the final norm; calibration rounding).
        embedding_on_gpu: False when the engine keeps the embedding matrix in system RAM:
            ExLlamaV2 (``embed_cpu``) and llama.cpp (input layer always on the CPU) both do.
        head_is_embedding: True when the output head is the embedding matrix itself (tied
            embeddings in GGUF). An engine that keeps embeddings on the host still needs the
            matrix on the GPU as the head: llama.cpp loads it a second time there
            (``TENSOR_DUPLICATED`` in src/llama-model.cpp), so :attr:`gpu_bytes` counts it.
        per_layer_expert_bytes: Of each layer's bytes, its routed experts' matrices (a mixture
            of experts' ``ffn_{gate,up,down}_exps``): what an engine can keep in host memory
            apart from the rest of the layer. Empty for a dense model (or an unknown split).
        per_layer_largest_bytes: Each layer's largest single matrix: what an engine that runs a
            host-resident layer's big batches on the GPU must stage there at once.
        per_layer_largest_expert_bytes: Each layer's largest expert matrix, likewise.
    """

    embedding_bytes: int
    output_bytes: int
    per_layer_bytes: tuple[int, ...]
    other_bytes: int
    embedding_on_gpu: bool = True
    head_is_embedding: bool = False
    per_layer_expert_bytes: tuple[int, ...] = ()
    per_layer_largest_bytes: tuple[int, ...] = ()
    per_layer_largest_expert_bytes: tuple[int, ...] = ()

    def expert_bytes(self, layer: int) -> int:
        """Bytes of layer ``layer``'s routed-expert matrices (0 for a dense model)."""
        return self.per_layer_expert_bytes[layer] if layer < len(self.per_layer_expert_bytes) else 0

    def largest_bytes(self, layer: int, experts_only: bool = False) -> int:
        """Layer ``layer``'s largest matrix (of its experts only, with ``experts_only``); 0 unknown."""
        found = self.per_layer_largest_expert_bytes if experts_only else self.per_layer_largest_bytes
        return found[layer] if layer < len(found) else 0

    @property
    def layers_bytes(self) -> int:
        """Sum of the decoder layers."""
        return sum(self.per_layer_bytes)

    @property
    def total_bytes(self) -> int:
        """All weights: the size of the artifact on disk."""
        return self.embedding_bytes + self.output_bytes + self.layers_bytes + self.other_bytes

    @property
    def gpu_bytes(self) -> int:
        """The weights in VRAM when every layer is offloaded (the embedding matrix only when the
        engine puts it there, or when it doubles as the head)."""
        on_gpu = self.embedding_on_gpu or self.head_is_embedding
        return self.output_bytes + self.layers_bytes + self.other_bytes + (self.embedding_bytes if on_gpu else 0)

    @property
    def host_bytes(self) -> int:
        """The weights that stay in system RAM when every layer is offloaded."""
        return 0 if self.embedding_on_gpu else self.embedding_bytes

    def scaled_to(self, total_bytes: int) -> WeightsBreakdown:
        """Returns the same breakdown scaled so that its total is exactly ``total_bytes``.

        Every part keeps its share; the few bytes lost to rounding go to ``other_bytes``.
        """
        if self.total_bytes <= 0:
            return self
        k = Fraction(total_bytes, self.total_bytes)
        emb = math.floor(self.embedding_bytes * k)
        out = math.floor(self.output_bytes * k)
        layers = tuple(math.floor(b * k) for b in self.per_layer_bytes)
        other = total_bytes - emb - out - sum(layers)

        def scaled(values: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(math.floor(b * k) for b in values)

        return WeightsBreakdown(
            emb,
            out,
            layers,
            other,
            self.embedding_on_gpu,
            self.head_is_embedding,
            scaled(self.per_layer_expert_bytes),
            scaled(self.per_layer_largest_bytes),
            scaled(self.per_layer_largest_expert_bytes),
        )
