"""ExLlamaV2's device memory, read from an EXL2 directory and ExLlamaV2 0.3.2's allocation code.

Every term below names the line of exllamav2 0.3.2 it follows; the estimate is meant to be
checked against NVML (the ``peak_vram_bytes`` of a real trial) and corrected here, never
fitted away.

* **Weights**: the exact bytes of every tensor in the directory's ``*.safetensors`` files,
  read from their headers by :mod:`autotune.modelfiles.safetensors_dir`, no torch needed. The token
  embedding (``model.embed_tokens.weight``) stays in host memory: ``ExLlamaV2.load`` puts
  module 0 on the CPU (exllamav2/model.py, "Embedding layer on CPU"). A tied model whose file
  has no ``lm_head.*`` tensors loads the embedding again on the GPU as its head.
* **KV cache** (exllamav2/cache.py): per layer, K and V tensors of shape
  ``(batch, max_seq_len, n_kv_heads, head_dim // weights_per_byte)``: FP16 2 bytes a value;
  Q8 ``uint8`` 1 value a byte for K and V; Q6 K 1 a byte, V 2 a byte; Q4 2 a byte for both.
  The Q modes add FP16 scales of shape ``(..., head_dim // 32)`` for K and for V, and one FP16
  K and V buffer of shape ``(batch, max_seq_len, n_kv_heads, head_dim)`` per device to
  dequantize into (``touch_device``): one layer's full FP16 cache.
* **Buffers**: the per-device scratch ``max(module.scratch_space_fixed())`` (model.py
  ``load``; attn.py / mlp.py / linear.py ``temp_*_size`` with ``max_input_len`` 2048,
  ``max_batch_size`` 1, ``max_dq_size`` 512 Mi values), the paged generator's defrag pages
  (generator/dynamic.py: one ``(1, 256, heads, width)`` tensor per cache tensor shape), the
  decode logits and the attention scores of the prompt.
* **Overhead**: the CUDA context with PyTorch's kernels and cuBLAS workspace, a setting
  (``cuda_context_mib``) until the H200 run measures it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

from autotune.api import MemoryEstimate, ModelSpec
from autotune._builtin import ConfigError, model_from_hf_config, safetensors_dir_weights
from autotune._builtin import read_safetensors_dir

from autotune_plugins.exllamav2.generator_settings import GeneratorSettings

__all__ = [
    "CACHE_LAYOUTS",
    "CacheLayout",
    "Exl2Weights",
    "cache_bytes",
    "estimate",
    "exl2_weights",
    "scratch_bytes",
]

MiB = 2**20
# exllamav2/config.py defaults: max_input_len 2048, max_batch_size 1, max_dq_size 512 Mi values.
MAX_INPUT_LEN = 2048
MAX_DQ_VALUES = 512 * 2**20
# Measured on an H200 (torch 2.11+cu130, exllamav2 0.3.2, SDPA): NVML's process total minus the
# modelled weights, cache and buffers was 1189 MiB in the first trial of
# bench/results/h200_exllamav2_study.md (CUDA context, cuBLAS workspaces, the caching
# allocator's slack). Other cards and drivers differ: a study learns its own from its first
# measured trial.
DEFAULT_CUDA_CONTEXT_MIB = 1190


@dataclass(frozen=True)
class Exl2Weights:
    """Where an EXL2 directory's bytes go when ExLlamaV2 loads it.

    Attributes:
        gpu_bytes: Every tensor but the token embedding, plus the embedding again when a tied
            model has no head of its own.
        host_bytes: The token embedding (ExLlamaV2 keeps it in host memory).
        head_bytes: The output head's tensors (``lm_head.*``).
        n_tensors: Tensors read.
        files: The safetensors files read, sorted.
        head_from_embedding: True when the head is the embedding loaded again (tied, no lm_head).
    """

    gpu_bytes: int
    host_bytes: int
    head_bytes: int
    n_tensors: int
    files: tuple[str, ...]
    head_from_embedding: bool = False


def exl2_weights(model_dir: str | os.PathLike[str], tied: bool) -> Exl2Weights:
    """The exact weight bytes of an EXL2 directory, by where ExLlamaV2 puts them.

    The bytes are the directory's own (:func:`autotune.engine.formats.safetensors_dir_weights`,
    read from the safetensors headers); where they go is ExLlamaV2's: the embedding in host
    memory, and again on the GPU as the head of a tied model without ``lm_head`` tensors
    (exllamav2/model.py).

    Args:
        model_dir: The directory with ``config.json`` and ``*.safetensors``.
        tied: The model's ``tie_word_embeddings``.

    Raises:
        ConfigError: No safetensors file, or one is malformed.
    """
    d = read_safetensors_dir(model_dir)
    w = safetensors_dir_weights(model_dir, tied=tied)
    from_emb = w.head_is_embedding
    return Exl2Weights(
        gpu_bytes=replace(w, embedding_on_gpu=False).gpu_bytes,
        host_bytes=w.embedding_bytes,
        head_bytes=w.embedding_bytes if from_emb else w.output_bytes,
        n_tensors=len(d.tensors),
        files=d.files,
        head_from_embedding=from_emb,
    )


@dataclass(frozen=True)
class CacheLayout:
    """One ExLlamaV2 cache class: values per byte of K and V, and whether it has scales."""

    class_name: str
    values_per_byte_k: int
    values_per_byte_v: int
    bytes_per_value: int  # 2 for the FP16 cache, 1 (uint8 storage) for the Q caches
    quantized: bool


#: exllamav2/cache.py: ExLlamaV2Cache (torch.half, 1, 1), ExLlamaV2Cache_Q8 (uint8, 1, 1),
#: ExLlamaV2Cache_Q6 (uint8, K 1, V 2), ExLlamaV2Cache_Q4 (uint8, 2, 2).
CACHE_LAYOUTS: Mapping[str, CacheLayout] = {
    "fp16": CacheLayout("ExLlamaV2Cache", 1, 1, 2, False),
    "q8": CacheLayout("ExLlamaV2Cache_Q8", 1, 1, 1, True),
    "q6": CacheLayout("ExLlamaV2Cache_Q6", 1, 2, 1, True),
    "q4": CacheLayout("ExLlamaV2Cache_Q4", 2, 2, 1, True),
}


def cache_layout(cache_type: str) -> CacheLayout:
    try:
        return CACHE_LAYOUTS[str(cache_type).lower()]
    except KeyError:
        raise ConfigError(
            f"cache_type {cache_type!r}: ExLlamaV2 has {', '.join(c.upper() for c in CACHE_LAYOUTS)}"
        ) from None


@dataclass(frozen=True)
class CacheBytes:
    """An ExLlamaV2 cache's allocation: data, scales and the FP16 dequantization buffer."""

    data_bytes: int
    scale_bytes: int
    temp_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes + self.temp_bytes


def cache_bytes(model: ModelSpec, cache_type: str, batch_size: int, max_seq_len: int) -> CacheBytes:
    """What ``ExLlamaV2Cache*(model, batch_size, max_seq_len)`` allocates on one device.

    Args:
        model: The architecture (layers, KV heads, head size).
        cache_type: fp16, q8, q6 or q4 (any case).
        batch_size: The cache's batch (1 for the dynamic generator).
        max_seq_len: Tokens per batch row.
    """
    lay = cache_layout(cache_type)
    tokens_heads = batch_size * max_seq_len * model.n_kv_heads * model.n_layers
    k = tokens_heads * (model.head_dim // lay.values_per_byte_k) * lay.bytes_per_value
    v = tokens_heads * (model.head_dim // lay.values_per_byte_v) * lay.bytes_per_value
    if not lay.quantized:
        return CacheBytes(k + v, 0, 0)
    scales = 2 * tokens_heads * (model.head_dim // 32) * 2
    temp = 2 * batch_size * max_seq_len * model.kv_dim * 2
    return CacheBytes(k + v, scales, temp)


def scratch_bytes(model: ModelSpec, head_quantized: bool = True) -> int:
    """The per-device scratch: ``max(module.scratch_space_fixed() for module in model.modules)``.

    exllamav2 0.3.2, with max_input_len L = 2048 and max_batch_size 1:
    attention ``L*max(q_dim, hidden)*2 + 128`` + dequant ``2*min(in*out, 512Mi)`` of its widest
    projection; MLP ``L*hidden*2 + 128`` + 2 x ``L*max(hidden, ffn)*2 + 128`` + dequant of
    ``hidden*ffn``; the (quantized) head its dequant ``2*min(vocab*hidden, 512Mi)``.
    """
    h, q, kv, f, L = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_size, MAX_INPUT_LEN

    def dq(n_in: int, n_out: int) -> int:
        return 2 * min(n_in * n_out, MAX_DQ_VALUES)

    attn = L * max(q, h) * 2 + 128 + max(dq(h, q), dq(h, kv), dq(q, h))
    mlp = L * h * 2 + 128 + 2 * (L * max(h, f) * 2 + 128) + dq(h, f)
    head = dq(h, model.vocab_size) if head_quantized else 0
    return max(attn, mlp, head)


def estimate(
    model_dir: Path,
    settings: GeneratorSettings,
    prompt_tokens: int,
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_MIB * MiB,
) -> MemoryEstimate:
    """The predicted device memory of one trial.

    Args:
        model_dir: The EXL2 directory.
        settings: What the worker will allocate (cache shape and class, paged or not).
        prompt_tokens: The workload's prompt length (attention scores of the prefill).
        cuda_context_bytes: CUDA context + PyTorch kernels + cuBLAS workspace.
    """
    model = model_from_hf_config(model_dir)
    return estimate_for(
        model, exl2_weights(model_dir, model.tie_embeddings), settings, prompt_tokens, cuda_context_bytes
    )


def predicted_exl2_weights(model: ModelSpec, bpw: float) -> Exl2Weights:
    """Where an EXL2 conversion of ``model`` at ``bpw`` will put its bytes, before it exists
    (:func:`autotune.engine.formats.exl2_weights`; the converter quantizes a tied head as its own copy)."""
    from autotune_plugins.exllamav2.formats import exl2_weights as predicted

    w = predicted(model, bpw)
    return Exl2Weights(
        gpu_bytes=w.gpu_bytes,
        host_bytes=w.host_bytes,
        head_bytes=w.output_bytes,
        n_tensors=0,
        files=("(not converted yet: predicted from the source's shape)",),
    )


def estimate_for(
    model: ModelSpec,
    w: Exl2Weights,
    settings: GeneratorSettings,
    prompt_tokens: int,
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_MIB * MiB,
) -> MemoryEstimate:
    """:func:`estimate` for a model and its weights' bytes given (a conversion not made yet)."""
    cache = cache_bytes(model, settings.cache_type, settings.cache_batch_size, settings.cache_max_seq_len)
    scratch = scratch_bytes(model, head_quantized=not w.head_from_embedding)
    lay = cache_layout(settings.cache_type)
    defrag = 0
    if settings.paged:
        # One (1, 256, n_kv_heads, width) page per distinct cache tensor shape and dtype.
        widths = {
            (lay.bytes_per_value, model.head_dim // lay.values_per_byte_k),
            (lay.bytes_per_value, model.head_dim // lay.values_per_byte_v),
        }
        if lay.quantized:
            widths.add((2, model.head_dim // 32))
        defrag = sum(256 * model.n_kv_heads * width * size for size, width in widths)
    # Decode logits: float32 (batch, max_q_size 8, padded vocab); prefill attention scores of
    # the prompt (SDPA materialises them; flash-attn does not, so this is an upper bound).
    padded_vocab = (model.vocab_size + 31) // 32 * 32
    logits = settings.max_batch_size * 8 * padded_vocab * 4
    prompt = min(prompt_tokens, MAX_INPUT_LEN)
    scores = settings.prefill_batch * model.n_heads * prompt * prompt * 2
    notes = [
        f"weights: {w.gpu_bytes / MiB:.1f} MiB from {w.n_tensors} tensors in {', '.join(w.files)}; "
        f"token embedding {w.host_bytes / MiB:.1f} MiB in host memory"
        + ("; tied head loaded again from the embedding" if w.head_from_embedding else ""),
        f"cache {lay.class_name}(batch_size={settings.cache_batch_size}, max_seq_len="
        f"{settings.cache_max_seq_len}): data {cache.data_bytes / MiB:.1f} MiB, scales "
        f"{cache.scale_bytes / MiB:.1f} MiB, FP16 dequant buffer {cache.temp_bytes / MiB:.1f} MiB",
        f"buffers: scratch {scratch / MiB:.1f} MiB, defrag pages {defrag / MiB:.2f} MiB, logits "
        f"{logits / MiB:.1f} MiB, prefill scores {scores / MiB:.1f} MiB",
        f"overhead: CUDA context {cuda_context_bytes / MiB:.0f} MiB (setting cuda_context_mib)",
    ]
    return MemoryEstimate(
        weights_bytes=w.gpu_bytes,
        kv_bytes=cache.total_bytes,
        buffers_bytes=scratch + defrag + logits + scores,
        overhead_bytes=int(cuda_context_bytes),
        host_bytes=w.host_bytes,
        notes=tuple(notes),
    )
