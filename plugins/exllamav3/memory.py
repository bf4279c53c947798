"""exllamav3's device memory, read from an EXL3 directory and exllamav3 1.6.5's allocation code.

Every term names the exllamav3 source it follows; the estimate is meant to be checked against
NVML (a real trial's ``peak_vram_bytes``; bench/exllamav3_h200 prints both) and corrected here,
never fitted away.

* **Weights**: the exact bytes of every tensor in the directory's ``*.safetensors`` files, from
  their headers (:mod:`autotune.modelfiles.safetensors_dir`). An unquantized token embedding stays in host
  memory (modules/embedding.py: ``"prefer_cpu": not quantized``; the loader puts a
  ``prefer_cpu`` module on the CPU, model/model_ls.py ``_load_autosplit``). A tied model whose
  directory has no ``lm_head`` tensors loads the embedding again on the GPU as its head
  (architecture/llama.py: ``if config.tie_word_embeddings and not stc.has_tensor("lm_head"):
  head_alt_key = "model.embed_tokens"``).
* **KV cache** (cache/fp16.py, cache/quant.py): per attention layer, ``storage_size()``:
  FP16 ``2 * pages * 256 * n_kv_heads * head_dim * 2``; quantized, int32 words of
  ``token_dim // 32 * bits`` for K and for V plus FP16 scales of ``token_dim // 32`` each.
* **Staging** (quantized caches only; modules/attention_fn/triton_paged.py with the default
  ``EXL3_QC_STAGING=1``): prefill dequantizes the referenced window into FP16 K and V of
  ``_qc_staging_pages = 256`` pages (64k tokens) per sequence at most, shared by the layers,
  and the loader's measuring pass allocates that full size once (modules/attn.py
  ``autosplit_extra_measure``); freed tensors stay in PyTorch's caching allocator, which NVML
  sees. Its fp32 accumulator, ``pad128(chunk) x n_q_heads x pow2(head_dim) x 4``, comes with it.
* **Transients**: the largest per-module working set of a prefill chunk, by exllamav3's own
  per-token accounting for tensor-parallel planning (``make_tp_allocation``: modules/attn.py
  ``overhead_d = hidden * 2``, ``overhead_s = cache overhead_size + 2*q_dim*2 + 2*kv_dim*2``;
  modules/mlp.py ``overhead_d = hidden * 2``, ``overhead_s = 2 * ffn * 2``), times the chunk,
  plus ``recons_temp``: a chunk of more than ``AUTO_RECONSTRUCT_THRESHOLD = 144`` rows
  reconstructs the layer's widest matrix in FP16 (modules/quant/exl3.py
  ``reconstruct_hgemm``, ``recons_size = 2 * in * out``, at most 32768 columns at a time).
  The loader's measuring forward runs ``(1, max_chunk_size)`` (model_ls.py), so the chunk
  setting, not the prompt, sizes it. Then the logits: the head's output, ``max_batch_size``
  rows (decode) or ``max_output_size = 32`` (the measuring pass), FP32.
* **Overhead**: the CUDA context with PyTorch's, Triton's and exllamav3's kernels, cuBLAS
  workspaces and the decode graphs (``EXL3_BC_ATTN`` captures one CUDA graph per batch
  shape): a setting (``cuda_context_mib``), its default measured on an H200.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from autotune.api import MemoryEstimate, ModelSpec
from autotune.api import WeightsBreakdown
from autotune._builtin import model_from_hf_config, safetensors_dir_weights
from autotune._builtin import read_safetensors_dir

from autotune_plugins.exllamav3.generator_settings import PAGE_SIZE, GeneratorSettings, pages_per_job
from autotune_plugins.exllamav3.split import kv_units

__all__ = [
    "DEFAULT_CUDA_CONTEXT_MIB",
    "Exl3Weights",
    "MiB",
    "cache_bytes",
    "estimate",
    "estimate_for",
    "autosplit_capacity",
    "exl3_dir_weights",
    "per_card",
    "predicted_exl3_weights",
    "staging_bytes",
    "transient_bytes",
]

MiB = 2**20
# exllamav3 1.6.5's own on an H200 (torch 2.11+cu130, driver 580): NVML's process total minus
# the modelled parts, median of the 15 trials that loaded in bench/results/exl3_h200/ (842-967
# MiB; the spread follows the bits, see the table's notes). A study learns its own from its
# first measured trial.
DEFAULT_CUDA_CONTEXT_MIB = 905
# modules/attention_fn/triton_paged.py: _qc_staging_pages = 256 (EXL3_QC_STAGING_PAGES).
STAGING_PAGES = 256
# modules/quant/exl3.py: AUTO_RECONSTRUCT_THRESHOLD = 144 rows; MAX_RECONSTRUCT_SLICE_N = 32768.
RECONSTRUCT_ROWS = 144
RECONSTRUCT_SLICE_N = 32768
# model/model.py load(): max_output_size = 32, the measuring pass's logit rows.
MAX_OUTPUT_SIZE = 32


@dataclass(frozen=True)
class Exl3Weights:
    """Where an EXL3 directory's bytes go when exllamav3 loads it.

    Attributes:
        gpu_bytes: Every tensor but the unquantized token embedding, plus the embedding again
            when a tied model has no head of its own.
        host_bytes: The token embedding (exllamav3 keeps an unquantized one in host memory).
        n_tensors: Tensors read (0: predicted).
        files: The safetensors files read, sorted (or why there are none).
        head_from_embedding: True when the head is the embedding loaded again.
        per_layer_bytes: Each decoder layer's bytes (the rest of ``gpu_bytes`` is the head and
            norms, on the last card of a layer split); empty: not known.
    """

    gpu_bytes: int
    host_bytes: int
    n_tensors: int
    files: tuple[str, ...]
    head_from_embedding: bool = False
    per_layer_bytes: tuple[int, ...] = ()


def _placed(w: WeightsBreakdown, n_tensors: int, files: tuple[str, ...]) -> Exl3Weights:
    return Exl3Weights(
        gpu_bytes=replace(w, embedding_on_gpu=False).gpu_bytes,
        host_bytes=w.embedding_bytes,
        n_tensors=n_tensors,
        files=files,
        head_from_embedding=w.head_is_embedding,
        per_layer_bytes=tuple(w.per_layer_bytes),
    )


def exl3_dir_weights(model_dir: str | os.PathLike[str], tied: bool) -> Exl3Weights:
    """The exact weight bytes of an EXL3 (or FP16) directory, by where exllamav3 puts them.

    Raises:
        ConfigError: No safetensors file, or a malformed one.
    """
    d = read_safetensors_dir(model_dir)
    return _placed(safetensors_dir_weights(model_dir, tied=tied), len(d.tensors), d.files)


def predicted_exl3_weights(model: ModelSpec, bpw: float) -> Exl3Weights:
    """Where an EXL3 conversion of ``model`` at ``bpw`` will put its bytes, before it exists
    (:func:`autotune_plugins.exllamav3.formats.exl3_weights`)."""
    from autotune_plugins.exllamav3.formats import exl3_weights

    return _placed(exl3_weights(model, bpw), 0, ("(not converted yet: predicted from the source's shape)",))


def cache_bytes(model: ModelSpec, k_bits: int | None, v_bits: int | None, tokens: int) -> int:
    """``sum(layer.storage_size())`` of ``Cache(model, max_num_tokens=tokens, ...)``.

    Args:
        model: The architecture.
        k_bits: K bits of a quantized cache (None: FP16).
        v_bits: V bits likewise.
        tokens: ``max_num_tokens``, a multiple of 256.
    """
    per_token = model.kv_dim
    if k_bits is None or v_bits is None:
        layer = 2 * tokens * per_token * 2
    else:
        words = per_token // 32
        layer = tokens * words * (k_bits + v_bits) * 4 + 2 * tokens * words * 2
    return layer * model.n_layers


def staging_bytes(model: ModelSpec, s: GeneratorSettings, prompt_tokens: int) -> int:
    """The FP16 K/V staging of a quantized cache's prefill and its fp32 accumulator (0 for FP16).

    The loader's measuring pass stages 256 pages (64k tokens); a prefill of the trial's jobs
    stages each job's window, at most 256 pages, when its chunk is at least 256 tokens long
    (``qc_prefill_two_pass_min_q``): the larger of the two stays in the allocator's pool.
    """
    if s.k_bits is None:
        return 0
    window = min(pages_per_job(s.max_seq_len), STAGING_PAGES) * PAGE_SIZE
    prefill = s.max_batch_size * window if prompt_tokens >= PAGE_SIZE else 0
    tokens = max(STAGING_PAGES * PAGE_SIZE, prefill)
    hd_pad = 1 << (model.head_dim - 1).bit_length()
    acc = -(-s.chunk_size // 128) * 128 * model.n_heads * hd_pad * 4
    return 2 * tokens * model.kv_dim * 2 + acc


def transient_bytes(model: ModelSpec, s: GeneratorSettings) -> tuple[int, int, int]:
    """(attention, MLP, logits) working sets of one prefill chunk and one decode step, per
    exllamav3's ``make_tp_allocation`` (see the module's docstring)."""
    h, q, kv, chunk = model.hidden_size, model.q_dim, model.kv_dim, s.chunk_size
    f = model.expert_ffn_size * model.n_experts_used if model.n_experts else model.ffn_size

    def recons(n_in: int, n_out: int) -> int:
        return 2 * n_in * min(n_out, RECONSTRUCT_SLICE_N) if chunk > RECONSTRUCT_ROWS else 0

    cache_overhead = 2 * kv * 2 if s.k_bits is not None else 0  # CacheLayer_quant.overhead_size
    attn = chunk * (h * 2 + cache_overhead + 2 * q * 2 + 2 * kv * 2) + max(recons(h, q), recons(h, kv), recons(q, h))
    ffn = model.expert_ffn_size if model.n_experts else model.ffn_size
    mlp = chunk * (h * 2 + 2 * f * 2) + max(recons(h, ffn), recons(ffn, h))
    rows = max(MAX_OUTPUT_SIZE, s.max_batch_size)
    logits = rows * model.vocab_size * 4
    return attn, mlp, logits


def estimate(
    model_dir: Path,
    settings: GeneratorSettings,
    prompt_tokens: int,
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_MIB * MiB,
) -> MemoryEstimate:
    """The predicted device memory of one trial on an EXL3 directory."""
    model = model_from_hf_config(model_dir)
    return estimate_for(
        model, exl3_dir_weights(model_dir, model.tie_embeddings), settings, prompt_tokens, cuda_context_bytes
    )


def estimate_for(
    model: ModelSpec,
    w: Exl3Weights,
    settings: GeneratorSettings,
    prompt_tokens: int,
    cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_MIB * MiB,
) -> MemoryEstimate:
    """:func:`estimate` for a model and its weights' bytes given (a conversion not made yet).

    Args:
        model: The architecture.
        w: The weights' bytes and where they go.
        settings: The cache and generator the worker builds.
        prompt_tokens: The workload's prompt (whether a prefill stages a quantized cache).
        cuda_context_bytes: CUDA context, kernels, workspaces, decode graphs.
    """
    cache = cache_bytes(model, settings.k_bits, settings.v_bits, settings.cache_tokens)
    staging = staging_bytes(model, settings, prompt_tokens)
    attn, mlp, logits = transient_bytes(model, settings)
    kind = "FP16" if settings.k_bits is None else f"quantized K {settings.k_bits} bits, V {settings.v_bits} bits"
    notes = (
        f"weights: {w.gpu_bytes / MiB:.1f} MiB from {w.n_tensors} tensors in {', '.join(w.files)}; token "
        f"embedding {w.host_bytes / MiB:.1f} MiB in host memory"
        + ("; tied head loaded again from the embedding" if w.head_from_embedding else ""),
        f"cache {kind}, {settings.cache_tokens} tokens ({settings.pages} pages of {PAGE_SIZE}): "
        f"{cache / MiB:.1f} MiB; prefill staging {staging / MiB:.1f} MiB",
        f"transients (chunk {settings.chunk_size}): attention {attn / MiB:.1f} MiB, MLP {mlp / MiB:.1f} MiB "
        f"(the larger counts), logits {logits / MiB:.1f} MiB",
        f"overhead: CUDA context {cuda_context_bytes / MiB:.0f} MiB (setting cuda_context_mib)",
    )
    return MemoryEstimate(
        weights_bytes=w.gpu_bytes,
        kv_bytes=cache + staging,
        buffers_bytes=max(attn, mlp) + logits,
        overhead_bytes=int(cuda_context_bytes),
        host_bytes=w.host_bytes,
        notes=notes,
    )


# ---------------------------------------------------------------------- several cards

# model/model_ls.py _load_autosplit: a card is closed when its headroom no longer covers the
# largest transient seen there plus EXL3_AUTOSPLIT_MARGIN_MB (256 by default).
AUTOSPLIT_MARGIN = 256 * MiB
# model/model.py load_gen: reserve_per_device is padded with 0.5 GiB for each card past the
# list TabbyAPI passes ([96 MB], on card 0).
AUTOSPLIT_RESERVE = (96 * MiB, 512 * MiB)


def autosplit_capacity(budgets: Sequence[int]) -> tuple[int, ...]:
    """What ``gpu_split_auto`` lets exllamav3 fill on each card: its budget less the reserve."""
    return tuple(max(0, b - AUTOSPLIT_RESERVE[0 if d == 0 else 1]) for d, b in enumerate(budgets))


def _ratio_split(units: int, weights: Sequence[float]) -> list[int]:
    """util/misc.py ratio_split (chunk 1): ``units`` dealt in proportion, largest remainders first."""
    total = sum(weights)
    if total <= 0:
        return [0] * len(weights)
    ideal = [units * w / total for w in weights]
    base = [int(x) for x in ideal]
    for i in sorted(range(len(ideal)), key=lambda i: -(ideal[i] - int(ideal[i])))[: units - sum(base)]:
        base[i] += 1
    return base


def per_card(
    mem: MemoryEstimate,
    model: ModelSpec,
    w: Exl3Weights,
    settings: GeneratorSettings,
    capacities: Sequence[int],
    tensor_parallel: bool,
) -> MemoryEstimate:
    """``mem`` (:func:`estimate_for`, one card) with each card's share (``per_device_bytes``).

    Args:
        capacities: What exllamav3 may fill on each card: ``gpu_split`` GiB, or
            :func:`autosplit_capacity` of the budgets for ``auto``.
        tensor_parallel: Heads and channels split (``_load_tp``) rather than whole layers.

    A layer split (``_load_autosplit``) loads the modules in order onto the first card until the
    next would leave less than the largest transient plus :data:`AUTOSPLIT_MARGIN` free, then the
    next card; each layer's KV cache is on its layer's card, the head on the last card used; a
    card that gets no layer is not touched (no CUDA context). What the last card cannot hold
    stays on it, so the judge sees it overflow. A tensor split (``TPAllocator.initial_split``)
    deals each layer's K/V head units and MLP channel units, and the head's 128-column units, in
    proportion to what each card has left; storage goes with its units, every card pays the
    replicated part of a transient and its own CUDA context.
    """
    n = len(capacities)
    cache = cache_bytes(model, settings.k_bits, settings.v_bits, settings.cache_tokens)
    staging = mem.kv_bytes - cache
    layers = list(w.per_layer_bytes) or [w.gpu_bytes // max(1, model.n_layers)] * model.n_layers
    head = max(0, w.gpu_bytes - sum(layers))
    cache_layer = cache // max(1, len(layers))
    attn, mlp, logits = transient_bytes(model, settings)
    transient = max(attn, mlp)
    weights, kv, buffers = [0] * n, [0] * n, [0] * n
    if not tensor_parallel:
        d = 0
        for need, kv_need in [(b, cache_layer) for b in layers] + [(head, 0)]:
            while d < n - 1 and (
                weights[d] + kv[d] + need + kv_need + transient + staging + AUTOSPLIT_MARGIN + mem.overhead_bytes
                > capacities[d]
            ):
                d += 1
            weights[d] += need
            kv[d] += kv_need
        for d in range(n):
            if weights[d] or kv[d]:
                kv[d] += staging
                buffers[d] = transient
        last = max(d for d in range(n) if weights[d])
        buffers[last] += logits
    else:
        q, kvd, h = model.q_dim, model.kv_dim, model.hidden_size
        ffn = model.expert_ffn_size * model.n_experts if model.n_experts else model.ffn_size
        attn_params, mlp_params = 2 * h * q + 2 * h * kvd, 3 * h * ffn
        units_attn = max(1, (kv_units(model.head_dim, model.n_kv_heads) or 1))
        units_mlp = max(1, (model.n_experts or ffn // 128))
        units_head = max(1, model.vocab_size // 128)
        share_attn = attn_params / max(1, attn_params + mlp_params)
        components = []
        for b in layers:
            components.append((int(b * share_attn) + cache_layer, units_attn, attn, True))
            components.append((b - int(b * share_attn), units_mlp, mlp, False))
        components.append((head, units_head, logits, False))
        overhead = [0] * n
        for storage, units, work, is_attn in components:
            free = [max(0, c - weights[d] - kv[d] - overhead[d]) for d, c in enumerate(capacities)]
            split = _ratio_split(units, free if sum(free) else capacities)
            for d in range(n):
                part = storage * split[d] // units
                if is_attn:
                    kv[d] += cache_layer * split[d] // units
                    part -= cache_layer * split[d] // units
                weights[d] += part
                if split[d] or free[d]:
                    replicated = settings.chunk_size * h * 2
                    overhead[d] = max(overhead[d], replicated + max(0, work - replicated) * split[d] // units)
        for d in range(n):
            if weights[d] or kv[d]:
                buffers[d] = overhead[d]
        total_kv_units = sum(kv) or 1
        for d in range(n):
            kv[d] += staging * kv[d] // total_kv_units
    used = [d for d in range(n) if weights[d] or kv[d]]
    shares = tuple(weights[d] + kv[d] + buffers[d] + (mem.overhead_bytes if d in used else 0) for d in range(n))
    how = "tensor parallel" if tensor_parallel else "layer split"
    note = (
        f"{how} over {len(used)} of {n} cards (exllamav3 may fill "
        + ", ".join(f"{c / 2**30:.2f}" for c in capacities)
        + " GiB): per card "
        + ", ".join(f"{d}: {b / 2**30:.2f} GiB" for d, b in enumerate(shares))
    )
    return replace(
        mem,
        weights_bytes=sum(weights),
        kv_bytes=sum(kv),
        buffers_bytes=sum(buffers),
        overhead_bytes=mem.overhead_bytes * len(used),
        per_device_bytes=shares,
        notes=(*mem.notes, note),
    )
