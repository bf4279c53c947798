"""The EXL2 formats (``exl2:<bpw>``): the bits per weight ExLlamaV2's converter accepts, and the
weight bytes of a model at one of them, predicted from the architecture.

The callables of the ``EXL2`` declaration (:mod:`autotune_plugins.exllamav2.declarations`),
through which :mod:`autotune.engine.formats` reads, spells and sizes an ``exl2:`` format; the
exllamav2 backend and the twin of ExLlamaV2 use them directly too. Importing it costs nothing
(no torch).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.api import ModelSpec
from autotune.api import WeightsBreakdown
from autotune._builtin import ConfigError
from autotune_plugins.shared.quant_config import bpw_within, quantization_config, quote_directory, spell

__all__ = [
    "ACCEPTS",
    "EXL2_BPW_MAX",
    "EXL2_MAX_BITS",
    "EXL2_BPW_MIN",
    "Exl2Quantization",
    "bpw_of",
    "exl2_quantization",
    "exl2_weights",
    "bpw_within",
    "quantization_config",
    "quote",
    "quote_directory",
    "spell",
]

# ExLlamaV2 quantizes to 2-8 bits per weight; 16 leaves room for an unquantized head's share.
EXL2_MAX_BITS = 16.0
# The converter's range (exllamav2/conversion/convert.py accepts -b from 2 to 8).
EXL2_BPW_MIN = 2.0
EXL2_BPW_MAX = 8.0
ACCEPTS = f"exl2:<bpw> with bpw {EXL2_BPW_MIN}-{EXL2_BPW_MAX}"


@dataclass(frozen=True)
class Exl2Quantization:
    """An EXL2 directory's ``quantization_config``.

    Attributes:
        bits: Average bits per weight of the decoder's linear layers (``bits``).
        head_bits: Bits per weight of the output head (``head_bits``; None when absent).
    """

    bits: float
    head_bits: int | None


def exl2_quantization(cfg: Mapping[str, Any], where: str | os.PathLike[str] = "config.json") -> Exl2Quantization | None:
    """The EXL2 quantization a config.json states (``quantization_config.quant_method = "exl2"``
    with numeric ``bits``), or None; bits outside (0, EXL2_MAX_BITS] are a ConfigError naming
    ``where`` (the file)."""
    q = quantization_config(cfg, "exl2")
    if q is not None:
        if isinstance(q["bits"], bool) or not 0 < q["bits"] <= EXL2_MAX_BITS:
            # nan, inf, 0 or 1e9 bits per weight would price the weights at nothing or at exabytes.
            raise ConfigError(
                f"{where}: quantization_config.bits = {q['bits']!r}: an EXL2 model has "
                f"more than 0 and at most {EXL2_MAX_BITS} bits per weight"
            )
        head = q.get("head_bits")
        head_bits = head if isinstance(head, int) and not isinstance(head, bool) else None
        return Exl2Quantization(float(q["bits"]), head_bits)
    return None


def quote(source: Path) -> tuple[str, int] | None:
    """An EXL2 model directory (or its config.json) as the format it is in and its bytes on disk
    (``("exl2:4.0", 15_300_000_000)``), for the model's quoted artifact sizes; None for any other."""
    return quote_directory(source, "exl2", exl2_quantization)


def bpw_of(variant: str) -> float:
    """A written bits per weight -> the number (``"4"`` -> ``4.0``).

    Raises:
        ValueError: Not a number, or outside 2.0-8.0.
    """
    return bpw_within(variant, EXL2_BPW_MIN, EXL2_BPW_MAX)


def bits_per_weight(bpw: float, model: ModelSpec | None = None) -> float:
    """EXL2's bits per weight is the bpw itself (the converter's average, scales included)."""
    return float(bpw)


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
        raise ConfigError(f"unknown weights format 'exl2:{bpw}' (use {ACCEPTS})")
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
