"""The EXL3 formats (``exl3:<bpw>``): the bits per weight exllamav3's converter accepts, and the
weight bytes of a model at one of them, predicted from the architecture.

The callables of the ``EXL3`` declaration (:mod:`autotune_plugins.exllamav3.declarations`),
through which :mod:`autotune.engine.formats` reads, spells and sizes an ``exl3:`` format; the
exllamav3 backend and the twin of exllamav3 use them directly too. Importing it costs nothing
(no torch).

Source read: exllamav3 1.6.5 as on PyPI (``exllamav3/conversion/convert_model.py``,
``conversion/allocation.py``, ``conversion/compile.py``, ``modules/linear.py``,
``modules/quant/exl3.py``, ``modules/embedding.py``).
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

# The EXL2 plugin owns what the EXL families share: the config.json's quantization_config, a
# directory's quote, the bpw spelling (two decimals, as both converters record it).
from autotune_plugins.shared.quant_config import bpw_within, quantization_config, quote_directory, spell

__all__ = [
    "ACCEPTS",
    "EXL3_BPW_MAX",
    "EXL3_BPW_MIN",
    "EXL3_HEAD_BITS",
    "Exl3Quantization",
    "bits_per_weight",
    "bpw_of",
    "exl3_quantization",
    "exl3_weights",
    "head_bits_ok",
    "quote",
    "spell",
]

# convert_model.py prepare(): "--bits must be between 1 and 8".
EXL3_BPW_MIN = 1.0
EXL3_BPW_MAX = 8.0
# convert_model.py: -hb "1-8, 1.5/2.5/3.5 (mul1 codebook), or 16 to store unquantized, default: 6".
EXL3_HEAD_BITS = 6.0
# Linear layers are padded to multiples of 128 in and out (modules/linear.py, pad_to = 128).
_PAD = 128
ACCEPTS = f"exl3:<bpw> with bpw {EXL3_BPW_MIN}-{EXL3_BPW_MAX}"


@dataclass(frozen=True)
class Exl3Quantization:
    """An EXL3 directory's ``quantization_config`` (written by conversion/compile.py).

    Attributes:
        bits: Average trellis bits per weight of the decoder's linear layers, head excluded
            (``bits``, the converter's ``final_bits``, rounded to two decimals).
        head_bits: Bits per weight of the output head (``head_bits``; None when absent).
    """

    bits: float
    head_bits: float | None


def exl3_quantization(cfg: Mapping[str, Any], where: str | os.PathLike[str] = "config.json") -> Exl3Quantization | None:
    """The EXL3 quantization a config.json states (``quantization_config.quant_method = "exl3"``
    with numeric ``bits``), or None; bits outside [1, 8] are a ConfigError naming ``where``."""
    q = quantization_config(cfg, "exl3")
    if q is not None:
        if isinstance(q["bits"], bool) or not EXL3_BPW_MIN <= q["bits"] <= EXL3_BPW_MAX:
            raise ConfigError(
                f"{where}: quantization_config.bits = {q['bits']!r}: an EXL3 model has "
                f"{EXL3_BPW_MIN} to {EXL3_BPW_MAX} bits per weight"
            )
        head = q.get("head_bits")
        head_bits = float(head) if isinstance(head, (int, float)) and not isinstance(head, bool) else None
        return Exl3Quantization(float(q["bits"]), head_bits)
    return None


def quote(source: Path) -> tuple[str, int] | None:
    """An EXL3 model directory (or its config.json) as the format it is in and its bytes on disk
    (``("exl3:4.0", 4_400_000_000)``), for the model's quoted artifact sizes; None for any other."""
    return quote_directory(source, "exl3", exl3_quantization)


def bpw_of(variant: str) -> float:
    """A written bits per weight -> the number (``"4"`` -> ``4.0``).

    Raises:
        ValueError: Not a number, or outside 1.0-8.0.
    """
    return bpw_within(variant, EXL3_BPW_MIN, EXL3_BPW_MAX)


def bits_per_weight(bpw: float, model: ModelSpec | None = None) -> float:
    """EXL3's bits per weight is the bpw itself: the trellis average the converter aims at
    (``final_bits``); the per-channel FP16 sign/scale vectors add under 0.5% at 4096 wide."""
    return float(bpw)


def head_bits_ok(head_bits: float) -> bool:
    """What the converter accepts for ``-hb``: 1-8 (halves only as 1.5/2.5/3.5, the mul1
    codebook's half rates, conversion/allocation.py HALF_RATES; whole numbers otherwise), or 16."""
    return head_bits == 16 or (1 <= head_bits <= 8 and (float(head_bits).is_integer() or head_bits in (1.5, 2.5, 3.5)))


def _linear_bytes(n_in: int, n_out: int, bits: float) -> int:
    """One EXL3 linear layer on disk and in VRAM: the trellis, int16 of shape (in/16, out/16,
    16*K) = in*out*K/8 bytes (modules/quant/exl3.py asserts trellis.dtype == int16, K =
    trellis.shape[-1] / 16), plus the FP16 input and output sign/scale vectors ``suh`` (in) and
    ``svh`` (out) (quantize.py stores suh, svh, trellis); in and out padded to 128."""
    n_in = -(-n_in // _PAD) * _PAD
    n_out = -(-n_out // _PAD) * _PAD
    return round(n_in * n_out * bits / 8) + 2 * (n_in + n_out)


def exl3_weights(model: ModelSpec, bpw: float, head_bits: float = EXL3_HEAD_BITS) -> WeightsBreakdown:
    """Predicts an EXL3 model's weight bytes from the architecture.

    exllamav3's converter quantizes every linear layer of the decoder (q/k/v/o, gate/up/down;
    a mixture of experts' experts too) at a whole number of bits per tensor (half bits below 4
    with the default mul1 codebook), spending the budget ``bits * weights`` by priority
    (conversion/allocation.py ``create_q_strategy``); we spread the target evenly. The output
    head is quantized apart at ``head_bits`` (``-hb``, default 6; 16 keeps it FP16). The token
    embedding stays FP16 (``-eb`` default 16) and an unquantized table is loaded on the CPU
    (modules/embedding.py: ``"prefer_cpu": not quantized``), so it costs system RAM, not VRAM.
    Norms and Qwen2's q/k/v biases stay FP16.

    Args:
        model: The model.
        bpw: Average bits per weight of the decoder's linear layers, 1.0-8.0.
        head_bits: Bits per weight of the output head (see :func:`head_bits_ok`).

    Returns:
        The breakdown, with ``embedding_on_gpu=False``.

    Raises:
        ConfigError: ``bpw`` or ``head_bits`` out of range.
    """
    if not EXL3_BPW_MIN <= bpw <= EXL3_BPW_MAX:
        raise ConfigError(f"unknown weights format 'exl3:{bpw}' (use {ACCEPTS})")
    if not head_bits_ok(head_bits):
        raise ConfigError(f"head_bits = {head_bits}: exllamav3's converter accepts 1-8 (1.5, 2.5, 3.5 as halves) or 16")
    h, q, kv = model.hidden_size, model.q_dim, model.kv_dim
    attn = _linear_bytes(h, q, bpw) + 2 * _linear_bytes(h, kv, bpw) + _linear_bytes(q, h, bpw)
    experts = 0
    if model.n_experts:
        f = model.expert_ffn_size
        experts = model.n_experts * (2 * _linear_bytes(h, f, bpw) + _linear_bytes(f, h, bpw))
        mlp = experts + 2 * h * model.n_experts  # the router, FP16
    else:
        f = model.ffn_size
        mlp = 2 * _linear_bytes(h, f, bpw) + _linear_bytes(f, h, bpw)
    fp16_params = 2 * h + ((q + 2 * kv) if model.has_qkv_bias else 0)
    layer = attn + mlp + 2 * fp16_params
    head = 2 * model.vocab_size * h if head_bits == 16 else _linear_bytes(h, model.vocab_size, head_bits)
    return WeightsBreakdown(
        embedding_bytes=2 * model.n_embedding_params,
        output_bytes=head,
        per_layer_bytes=(layer,) * model.n_layers,
        other_bytes=2 * h,  # final norm, FP16
        embedding_on_gpu=False,
        per_layer_expert_bytes=(experts,) * model.n_layers if experts else (),
    )
