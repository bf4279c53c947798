"""The twin's model of quality: accuracy points lost to weight and KV-cache quantization.

Damage is measured the way llama.cpp's perplexity tool reports it, as the mean KL divergence
of next-token distributions against the FP16 model, and turned into MMLU points:

    drop_points = points_per_kld(model) * (kld_weights(format) + arch_kv * kld_cache(type))

Sources (docs/twin.md has the full table):
* GGUF KLD per file type: llama.cpp tools/perplexity/README.md, LLaMA 3 8B, wikitext-2, no
  imatrix (q8_0 0.001355 ... q2_K 0.445132), with bits per weight from
  tools/quantize/README.md (Llama-3.1-8B).
* EXL2: no published KLD table; EXL2's PPL gaps (exllamav2 doc/qcache_eval.md, Mistral 7B:
  3.0/3.5/4.0/5.0 bpw) shrink ~4x per added bit, as the k-quants' KLD does (3.6x per bit by
  the regression below), so an EXL2 file is priced like a k-quant of the same bits per weight.
* EXL3: priced the same way, at its bits (an upper bound on its damage: exllamav3's doc/exl3.md
  plots EXL3's perplexity below EXL2's at equal bitrate, but publishes no figures as text).
* KV cache: llama.cpp PR #7412 (LLaMA 3 8B KLD: K+V q8_0 0.000980; q4_0 K+V 0.0365, V only
  0.0050). ExLlamaV2's Q8/Q6/Q4 are 8/8, 8/4 and 4/4 bits for K/V with grouped scales;
  exllamav3's k<K>v<V> from K's and V's share of those figures, log-linear in bits.
* Qwen2 models are more sensitive to cache quantization (QKV biases give keys large
  outliers: exllamav2 issue #493 "issues with the Q4 cache" on Qwen2; localbench's Qwen
  q4_0-cache KLD 0.087-0.117 against LLaMA 3 8B's 0.0365): ``ARCH_KV_SENSITIVITY``.
* Points per unit KLD fall with model size (LLaMA 2 70B loses ~0.43x LLaMA 3 8B's perplexity
  share at Q4_K_M: examples/perplexity/README.md), hence the size exponent.
"""

from __future__ import annotations

import math
from typing import Mapping

from autotune.api import ModelSpec, parse_format
from autotune._builtin import ConfigError, engine_models
from autotune_plugins.twin.formats import twin_formats

# (bits per weight, mean KLD vs F16) of llama.cpp file types, LLaMA 3 8B (see module doc).
GGUF_KLD = {
    "F32": (32.0, 0.0),  # holds every F16 value exactly: nothing lost against the F16 reference
    "F16": (16.0, 0.0),
    "Q8_0": (8.5008, 0.001355),
    "Q6_K": (6.5633, 0.005452),
    "Q5_K_M": (5.7036, 0.010762),
    "Q5_0": (5.5, 0.022239),
    "Q4_K_M": (4.8944, 0.031273),
    "Q4_K_S": (4.6672, 0.043136),
    "Q4_0": (4.5, 0.071940),
    "Q3_K_M": (3.996, 0.101913),
    "Q3_K_S": (3.6429, 0.228217),
    "Q2_K": (3.1593, 0.445132),
}

# KLD of the cache types on LLaMA 3 8B (llama.cpp PR #7412); ExLlamaV2's by their K/V bits.
CACHE_KLD = {
    "f16": 0.0,
    "bf16": 0.0,
    "f32": 0.0,
    "fp16": 0.0,
    "auto": 0.0,
    "q8_0": 0.000980,
    "q8": 0.000980,
    "fp8": 0.000980,
    "fp8_e4m3": 0.000980,
    "fp8_e5m2": 0.0015,
    "q6": 0.000944 + 0.004988,  # 8-bit K (PR #7412 K q8_0) + 4-bit V (V q4_0)
    "q5_1": 0.012,
    "q5_0": 0.014,  # between q8_0 and q4_0 at their bits (1 bit ~ 4x less damage)
    "q4_1": 0.032,
    "q4_0": 0.036509,
    "q4": 0.036509,
    "iq4_nl": 0.030,
}

# Cache-quantization damage relative to LLaMA 3 8B, by architecture (module doc).
ARCH_KV_SENSITIVITY = {"qwen2": 2.7, "qwen3": 2.7}

# MMLU points per unit of KLD fall as models grow: ~x0.43 from 8B to 70B at Q4_K_M.
SIZE_EXPONENT = math.log(0.43) / math.log(70 / 8)

# The model sizes this model covers, in parameters: its figures are LLaMA 3 8B's and LLaMA 2
# 70B's, and the size power law is taken about 16x beyond either end. Further out it is no
# prediction: at 6,000 parameters (a hand-made file) it prices a unit of KLD at ~1,700 points,
# a Q2_K file at a 770-point drop of a 100-point scale.
COVERED_PARAMS = (5e8, 1e12)


def _kquant_regression() -> tuple[float, float]:
    """Least-squares line of ln(KLD) against bits per weight over the quantized k-quant types."""
    pts = [(bpw, math.log(kld)) for name, (bpw, kld) in GGUF_KLD.items() if kld > 0 and "_K" in name]
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - slope * mx, slope


_INTERCEPT, _SLOPE = _kquant_regression()


def weights_kld(fmt: str) -> float:
    """Mean KLD a weights format causes (LLaMA-3-8B scale)."""
    family, detail = parse_format(fmt, twin_formats())
    if family == "gguf":
        name = str(detail).upper()
        if name in GGUF_KLD:
            return GGUF_KLD[name][1]
        raise ConfigError(f"no published KLD for gguf:{name}: the twin cannot predict its quality")
    bpw = float(detail)
    return math.exp(_INTERCEPT + _SLOPE * bpw)


# PR #7412's split of the cache's damage between K and V at 8 and 4 bits (LLaMA 3 8B): K q8_0
# with V q4_0 is 0.000944 + 0.004988, both q8_0 0.00098, both q4_0 0.0365.
K_KLD = {8: 0.000944, 4: 0.0365 - 0.004988}
V_KLD = {8: 0.00098 - 0.000944, 4: 0.004988}


def _split_kld(table: Mapping[int, float], bits: int) -> float:
    """One of K or V at ``bits``: log-linear in bits through the 8- and 4-bit figures (outside
    them, the same line carried on: an extrapolation to 2-3 and 5-7 bits, stated as such)."""
    return table[8] * (table[4] / table[8]) ** ((8 - bits) / 4)


def cache_kld(cache_type: str, model: ModelSpec) -> float:
    """KLD a cache type adds; exllamav3's ``k<K>v<V>`` from K's and V's bits apart."""
    name = cache_type.lower()
    bits = (
        None
        if name in CACHE_KLD
        else next((b for m in engine_models().values() if (b := m.cache_kv_bits(name)) is not None), None)
    )
    kld = CACHE_KLD[name] if bits is None else _split_kld(K_KLD, bits[0]) + _split_kld(V_KLD, bits[1])
    return kld * ARCH_KV_SENSITIVITY.get(model.architecture, 1.0)


def uncovered(model: ModelSpec) -> str | None:
    """Why this quality model cannot price ``model`` (its size is beyond the evidence), or None."""
    lo, hi = COVERED_PARAMS
    if lo <= model.n_params <= hi:
        return None
    return (
        f"model '{model.key}' has {model.n_params:,} parameters; the twin's quality model covers "
        f"{lo / 1e9:g}B to {hi / 1e12:g}T (its figures are LLaMA 3 8B's and LLaMA 2 70B's) and cannot "
        "predict this one's quality: measure it (quality = 'mmlu' or 'kld') or leave [objective] quality out"
    )


def points_per_kld(model: ModelSpec, points_per_kld_8b: float) -> float:
    if why := uncovered(model):
        raise ConfigError(why)
    return points_per_kld_8b * (model.n_params / 8e9) ** SIZE_EXPONENT


def drop_points(model: ModelSpec, fmt: str, cache_type: str, points_per_kld_8b: float) -> float:
    """Predicted MMLU points lost against the FP16 model with an FP16 cache."""
    kld = weights_kld(fmt) + cache_kld(cache_type, model)
    # Full precision loses nothing at any size; only a loss is priced by the size law.
    return points_per_kld(model, points_per_kld_8b) * kld if kld else 0.0


def per_bit_factor() -> float:
    """How much less damage one more bit per weight does (from the k-quant regression)."""
    return math.exp(-_SLOPE)
