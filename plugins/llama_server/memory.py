"""llama-server's memory, in the terms of :mod:`autotune.vram`: its slot layout and constants.

Calibration (each figure is llama.cpp's own start-up log, ``-lv 4``, or nvidia-smi):

* **KV layout**: each of the ``-np`` slots gets its own stream of ``pad256(ctx)`` cells
  (``kv_unified`` is off in llama-server by default): ``-c 600 -np 2`` logs 2 x 512 cells.
* **Compute buffer, CPU**: 21 start-ups of stories260K, a 13M-parameter Llama and a 0.5B
  Qwen2 shape (vocabulary 151,936) at ubatch 128-512, ctx 512-4096, 1-4 slots, flash
  attention on and off (``tests/plugins/test_llama_memory.py`` repeats them in CI). The MLP
  phase holds 3 MLP-wide and 4 residual-wide F32 activations per token; unfused attention
  holds the F32 score matrix and about 5 residual-wide activations; the mask is F16 with
  flash attention, F32 without. All 21 within 4.2% (most within 1.5%).
* **Compute buffer, CUDA**: one H200 point (a 7B Qwen2 shape, ubatch 512, flash attention:
  136 MiB logged, ``bench/results/h200_llama_server_probe.md``) gives 3 residual-wide
  activations instead of the CPU's 4 (CUDA fuses one more op); ``bench/results/h200_vram.md``
  checks it at other ubatch, ctx and slot values.
* **CPU repacking**: a CPU build rearranges Q4_0 and Q4_K matrices into an interleaved copy
  for its SIMD kernels (``CPU_REPACK`` in the log), a host-RAM layout of CPU-only runs that no
  GPU build has; it is not modelled, and the CPU checks use types that are not repacked.
* **CUDA context**: nvidia-smi's per-process total minus the logged buffers was 610-611 MiB in
  all 12 configurations of the H200 probe (driver 580, CUDA 13, an sm_90 build). It depends on
  the card, driver and build; a study corrects it from its own measured peaks.
"""

from __future__ import annotations

from autotune.backend import MemoryEstimate
from autotune.formats import WeightsBreakdown
from autotune.models import ModelSpec
from autotune.cache_types import resolve
from autotune.vram import GraphBuffers, SlotLayout, kv_cache_bytes
from autotune_plugins.llama_server.declarations import CACHE_TYPES

__all__ = ["CPU_BUFFERS", "CUDA_BUFFERS", "CUDA_CONTEXT_BYTES", "LAYOUT", "DEFAULT_UBATCH", "estimate"]

MiB = 2**20
GiB = 2**30

LAYOUT = SlotLayout(pad=256, unified=False)
DEFAULT_UBATCH = 512  # llama-server's -ub

CPU_BUFFERS = GraphBuffers(ffn_coef=3, hidden_coef=4, attn_hidden_coef=5, mask_bytes=4, mask_bytes_fused=2,
                           source="llama.cpp CPU start-up logs, 21 configurations")
CUDA_BUFFERS = GraphBuffers(ffn_coef=3, hidden_coef=3, attn_hidden_coef=5, mask_bytes=4, mask_bytes_fused=2,
                            source="llama.cpp CUDA start-up log on an H200 (7B Qwen2 shape)")
CUDA_CONTEXT_BYTES = 611 * MiB


def estimate(model: ModelSpec, weights: WeightsBreakdown, ctx: int, parallel: int, cache_type: str,
             flash_attn: bool, *, ubatch: int | None = None, gpu: bool = True) -> MemoryEstimate:
    """Memory of ``llama-server -c ctx*parallel -np parallel -ub ubatch`` with every layer offloaded.

    Args:
        model: The model's shape (from the GGUF file's metadata).
        weights: The file's tensor bytes (:func:`autotune.formats.gguf_file_weights`).
        ctx: Context of one sequence.
        parallel: Slots (``-np``).
        cache_type: K and V cache type (``-ctk``/``-ctv``).
        flash_attn: ``-fa on``.
        ubatch: ``-ub``; llama-server's default when None.
        gpu: Whether the server runs on a GPU (a CUDA context, CUDA's buffers) or the CPU.
    """
    ub = min(ubatch or DEFAULT_UBATCH, ctx * parallel)
    # llama.cpp's own table: the memory model needs no registry (the twin uses it too).
    kv, cells, how = kv_cache_bytes(model, resolve(cache_type, CACHE_TYPES) or cache_type, ctx, parallel, LAYOUT)
    buffers = (CUDA_BUFFERS if gpu else CPU_BUFFERS).bytes(model, LAYOUT.cells_per_sequence(ctx), ub, flash_attn)
    notes = [f"KV: {how} x {model.n_layers} layers x {model.kv_dim} x (K+V {cache_type})",
             f"compute buffer: ubatch {ub}, {'fused' if flash_attn else 'unfused'} attention over "
             f"{LAYOUT.cells_per_sequence(ctx)} cells per slot"]
    if gpu:
        host = weights.total_bytes - weights.gpu_bytes
        if host:
            notes.append(f"token embeddings ({host / GiB:.2f} GiB) stay in host memory")
        if weights.head_is_embedding:
            notes.append("tied embeddings: the head is loaded again on the GPU")
        return MemoryEstimate(weights_bytes=int(weights.gpu_bytes), kv_bytes=kv, buffers_bytes=buffers,
                              overhead_bytes=CUDA_CONTEXT_BYTES, host_bytes=int(host), notes=tuple(notes))
    notes.append("CPU build: every buffer is in host memory")
    return MemoryEstimate(weights_bytes=int(weights.total_bytes), kv_bytes=kv, buffers_bytes=buffers,
                          overhead_bytes=0, host_bytes=0, notes=tuple(notes))
