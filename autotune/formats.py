"""Weight formats, as data.

Weights. A format is ``gguf:<TYPE>`` (a llama.cpp file type such as ``gguf:Q4_K_M``) or
``exl2:<bpw>`` (an ExLlamaV2 quantization at an average bits per weight, 2.0-8.0). For either,
:func:`weights_for` predicts the bytes of every part of the model (embeddings, each decoder
layer, the output head) from the architecture, tensor by tensor, and calibrates the prediction
against artifact sizes the model spec quotes. For a GGUF file that exists,
:func:`gguf_file_weights` gives the same breakdown from the file's own tensor table instead, and
:func:`safetensors_dir_weights` from a model directory's safetensors headers.

KV-cache element types are in :mod:`autotune.cache_types`.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from autotune.errors import ConfigError, UnknownNameError
from autotune.gguf_file import GgufTensor, read_gguf
from autotune.gguf_quant import (GGML_TYPES, GGUF_FILE_TYPES, GgmlType, GgufFileType, TensorPlan,  # noqa: F401 - API
                                 ggml_tensor_bytes, gguf_tensor_plan)
from autotune.models import ModelSpec
from autotune.safetensors_dir import read_safetensors_dir

__all__ = [
    "EXL2_BPW_MAX",
    "EXL2_BPW_MIN",
    "GGML_TYPES",
    "GGUF_FILE_TYPES",
    "GgmlType",
    "GgufFileType",
    "TensorPlan",
    "WeightsBreakdown",
    "bits_per_weight",
    "exl2_weights",
    "ggml_tensor_bytes",
    "gguf_file_weights",
    "gguf_tensor_plan",
    "normalize_format",
    "parse_format",
    "predict_gguf_weights",
    "safetensors_dir_weights",
    "weights_for",
]

# =============================================================================================
# Breakdown of weight bytes
# =============================================================================================


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
    """

    embedding_bytes: int
    output_bytes: int
    per_layer_bytes: tuple[int, ...]
    other_bytes: int
    embedding_on_gpu: bool = True
    head_is_embedding: bool = False

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
        return WeightsBreakdown(emb, out, layers, other, self.embedding_on_gpu, self.head_is_embedding)


def _gguf_breakdown(tensors: Iterable[TensorPlan | GgufTensor], n_layers: int | None,
                    head_is_embedding: bool) -> WeightsBreakdown:
    """GGUF tensors summed by where llama.cpp puts them: layers, embedding, head, the rest.

    ``embedding_on_gpu`` is False: llama.cpp keeps token_embd in host memory whatever ``-ngl``
    says (src/llama-model.cpp, load_tensors: "there is very little benefit to offloading the
    input layer, so always keep it on the CPU"). A file without ``output.weight`` ties the head
    to the embedding, which the engine then loads a second time on the GPU as the head.
    """
    per_layer: dict[int, int] = {}
    emb = out = other = 0
    for t in tensors:
        if t.layer is not None:
            per_layer[t.layer] = per_layer.get(t.layer, 0) + t.n_bytes
        elif t.name == "token_embd.weight":
            emb += t.n_bytes
        elif t.name == "output.weight":
            out += t.n_bytes
        else:
            other += t.n_bytes
    count = n_layers if n_layers is not None else max(per_layer, default=-1) + 1
    layers = tuple(per_layer.get(i, 0) for i in range(count))
    return WeightsBreakdown(emb, out, layers, other, embedding_on_gpu=False, head_is_embedding=head_is_embedding)


def predict_gguf_weights(model: ModelSpec, file_type: str) -> WeightsBreakdown:
    """Predicts the weight bytes of a GGUF file of ``file_type`` from the architecture alone.

    Sums :func:`gguf_tensor_plan`, tensor by tensor; metadata (the tokenizer vocabulary, a
    few MB) is not counted. For the bytes of a file that exists, see :func:`gguf_file_weights`.

    Args:
        model: The model.
        file_type: A GGUF file type such as ``Q4_K_M``.

    Returns:
        The breakdown, with ``embedding_on_gpu=False`` and, for tied embeddings,
        ``head_is_embedding`` (see :class:`WeightsBreakdown`).

    Raises:
        UnknownNameError: ``file_type`` is not known.
    """
    return _gguf_breakdown(gguf_tensor_plan(model, file_type), model.n_layers, model.tie_embeddings)


def gguf_file_weights(path: str | os.PathLike[str]) -> WeightsBreakdown:
    """The exact weight bytes of an existing GGUF file, from its tensor table.

    Args:
        path: A ``.gguf`` file.

    Returns:
        The breakdown by embedding / head / layer / other; ``total_bytes`` is the sum of the
        tensors (the file minus its header and alignment padding).

    Raises:
        ConfigError: The file is missing, unreadable or not a GGUF file.
    """
    header = read_gguf(path)
    return _gguf_breakdown(header.tensors, None, head_is_embedding=header.tensor("output.weight") is None)


def safetensors_dir_weights(path: str | os.PathLike[str], tied: bool | None = None) -> WeightsBreakdown:
    """The exact weight bytes of a model directory (EXL2 or Hugging Face), from its safetensors headers.

    A directory says nothing of where an engine puts the embedding, so ``embedding_on_gpu`` is
    True; an engine that keeps it in host memory (ExLlamaV2, llama.cpp) replaces that.

    Args:
        path: The directory (:func:`autotune.safetensors_dir.read_safetensors_dir`).
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


EXL2_BPW_MIN = 2.0
EXL2_BPW_MAX = 8.0


def exl2_weights(model: ModelSpec, bpw: float, head_bits: int = 6) -> WeightsBreakdown:
    """Predicts an EXL2 model's weight bytes from the architecture.

    ExLlamaV2's converter quantizes every linear layer of the decoder (q/k/v/o, gate/up/down)
    and spreads bits over them so the average is the target ``bpw``, a figure that already
    includes the per-group scales (``QParams.total_bits`` in exllamav2/conversion/qparams.py
    adds q_scale, q_groups and q_scale_max to the weight bits). We spread the average evenly
    over the layers. The output head is quantized
    separately at ``head_bits`` (``-hb``, default 6, in convert.py / doc/convert.md); a tied
    head is quantized as its own copy. The embedding table is not quantized: the quantizer's
    loop starts after module 0 (exllamav2/conversion/quantize.py, ``quant``), so it stays FP16;
    and at load time ``ExLlamaV2.set_device_map(..., embed_cpu=True)`` puts it on the CPU
    (exllamav2/model.py: "Special case for token embeddings on CPU"), so it costs system RAM,
    not VRAM. Norms and Qwen2's q/k/v biases stay FP16.

    Args:
        model: The model.
        bpw: Average bits per weight of the decoder's linear layers, 2.0-8.0.
        head_bits: Bits per weight of the output head (ExLlamaV2 accepts 2-8; 6 by default,
            8 is common above 6 bpw).

    Returns:
        The breakdown, with ``embedding_on_gpu=False``.

    Raises:
        ConfigError: ``bpw`` or ``head_bits`` out of range.
    """
    if not EXL2_BPW_MIN <= bpw <= EXL2_BPW_MAX:
        raise ConfigError(_format_error(f"exl2:{bpw}"))
    if not 2 <= head_bits <= 8:
        raise ConfigError(f"head_bits = {head_bits}: must be an integer from 2 to 8")
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_size
    linear_params = h * q + 2 * h * kv + q * h + 3 * h * f
    fp16_params = 2 * h + ((q + 2 * kv) if model.has_qkv_bias else 0)
    layer = round(linear_params * bpw / 8) + 2 * fp16_params
    head = round(model.vocab_size * h * head_bits / 8)
    return WeightsBreakdown(
        embedding_bytes=2 * model.n_embedding_params,
        output_bytes=head,
        per_layer_bytes=(layer,) * model.n_layers,
        other_bytes=2 * h,  # final norm, FP16
        embedding_on_gpu=False,
    )


# =============================================================================================
# Format names
# =============================================================================================


def _format_error(fmt: str) -> str:
    return (
        f"unknown weights format '{fmt}' (use gguf:<TYPE> with TYPE in {', '.join(GGUF_FILE_TYPES)} "
        f"or exl2:<bpw> with bpw {EXL2_BPW_MIN}-{EXL2_BPW_MAX})"
    )


def parse_format(fmt: str) -> tuple[str, str | float]:
    """Splits a weights format into its family and detail.

    Args:
        fmt: ``gguf:<TYPE>`` (TYPE case-insensitive, e.g. ``gguf:Q4_K_M``) or ``exl2:<bpw>``
            (e.g. ``exl2:4.0``, bpw 2.0-8.0).

    Returns:
        ``("gguf", "Q4_K_M")`` or ``("exl2", 4.0)``.

    Raises:
        UnknownNameError: Anything else; the message lists what is accepted.
    """
    family, sep, detail = str(fmt).strip().partition(":")
    family = family.lower()
    if sep and family == "gguf" and detail.upper() in GGUF_FILE_TYPES:
        return "gguf", detail.upper()
    if sep and family == "exl2":
        try:
            bpw = float(detail)
        except ValueError:
            bpw = math.nan
        if EXL2_BPW_MIN <= bpw <= EXL2_BPW_MAX:
            return "exl2", bpw
    raise UnknownNameError(_format_error(fmt))


def normalize_format(fmt: str) -> str:
    """Returns the canonical spelling of a format: ``gguf:Q4_K_M``, ``exl2:4.0``, ``exl2:3.25``.

    Raises:
        UnknownNameError: As :func:`parse_format`.
    """
    family, detail = parse_format(fmt)
    if family == "exl2":
        return f"exl2:{round(float(detail), 2)}"
    return f"gguf:{detail}"


def bits_per_weight(fmt: str, model: ModelSpec | None = None) -> float:
    """Nominal bits per weight of a format's linear layers.

    Args:
        fmt: A weights format.
        model: When given, a GGUF format's figure is the average over this model's decoder
            matrices under the file type's mix (Q4_K_M is ~4.8 on Qwen2.5-7B); without a
            model it is the base type's storage rate (Q4_K_M -> Q4_K -> 4.5; Q4_0 -> 4.5 too).

    Returns:
        Bits per weight, scales included. EXL2: the bpw itself.

    Raises:
        UnknownNameError: ``fmt`` is not a known format.
    """
    family, detail = parse_format(fmt)
    if family == "exl2":
        return float(detail)
    if model is None:
        return GGML_TYPES[GGUF_FILE_TYPES[str(detail)].base].bits_per_weight
    tensors = [t for t in gguf_tensor_plan(model, str(detail)) if t.layer is not None and len(t.shape) == 2]
    return sum(t.n_bytes for t in tensors) * 8 / sum(t.n_elements for t in tensors)


def _computed(model: ModelSpec, family: str, detail: str | float) -> WeightsBreakdown:
    if family == "gguf":
        return predict_gguf_weights(model, str(detail))
    return exl2_weights(model, float(detail))


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


# A study judges hundreds of configurations over a dozen (model, format) pairs, and a GGUF
# prediction walks every tensor (12 ms on 2 cores): 14% of the default study. The answer is a
# function of the frozen ModelSpec (its quoted sizes included: they take part in its equality)
# and the format alone.
@functools.lru_cache(maxsize=256)
def weights_for(model: ModelSpec, fmt: str) -> WeightsBreakdown:
    """Weight bytes of ``model`` in ``fmt``, calibrated against the sizes the model quotes.

    The per-tensor prediction (:func:`predict_gguf_weights`, :func:`exl2_weights`) is then corrected:

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
        fmt: ``gguf:<TYPE>`` or ``exl2:<bpw>``.

    Returns:
        The calibrated breakdown.

    Raises:
        UnknownNameError: ``fmt`` is not a known format.
    """
    family, detail = parse_format(fmt)
    computed = _computed(model, family, detail)
    canonical = normalize_format(fmt)
    points: list[tuple[float, float]] = []
    for quoted_fmt, quoted_bytes in model.artifact_bytes.items():
        try:
            q_family, q_detail = parse_format(quoted_fmt)
        except UnknownNameError:
            continue  # a quoted artifact of a type we cannot predict (e.g. an IQ quant)
        if normalize_format(quoted_fmt) == canonical:
            return computed.scaled_to(int(quoted_bytes))
        if q_family == family:
            q_total = _computed(model, q_family, q_detail).total_bytes
            points.append((q_total, quoted_bytes / q_total))
    if not points:
        return computed
    ratio = _interpolate(points, computed.total_bytes)
    return computed.scaled_to(round(computed.total_bytes * ratio))

