"""llama-server's memory, in the terms of :mod:`autotune.engine.vram`: its slot layout and constants.

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

from autotune.api import MemoryEstimate, ModelSpec
from autotune.api import WeightsBreakdown
from autotune._builtin import GraphBuffers, SlotLayout, kv_cache_bytes, resolve_cache_type as resolve
from autotune_plugins.llama_server.declarations import CACHE_TYPES
from autotune_plugins.shared.scenario import LLAMA_UBATCH

__all__ = [
    "CPU_BUFFERS",
    "CUDA_BUFFERS",
    "CUDA_CONTEXT_BYTES",
    "LAYOUT",
    "DEFAULT_BATCH",
    "DEFAULT_UBATCH",
    "estimate",
    "placement",
]

MiB = 2**20
GiB = 2**30

LAYOUT = SlotLayout(pad=256, unified=False)
DEFAULT_UBATCH = LLAMA_UBATCH  # llama-server's -ub (512), one number for the memory model and the physics

CPU_BUFFERS = GraphBuffers(
    ffn_coef=3,
    hidden_coef=4,
    attn_hidden_coef=5,
    mask_bytes=4,
    mask_bytes_fused=2,
    source="llama.cpp CPU start-up logs, 21 configurations",
)
CUDA_BUFFERS = GraphBuffers(
    ffn_coef=3,
    hidden_coef=3,
    attn_hidden_coef=5,
    mask_bytes=4,
    mask_bytes_fused=2,
    moe_ffn_coef=6,
    source="llama.cpp CUDA start-up log on an H200 (7B Qwen2 shape; MoE: a "
    "Qwen3-30B-A3B shape, bench/results/offload_probe_h200)",
)
CUDA_CONTEXT_BYTES = 611 * MiB
# A mixture of experts on CUDA holds more than its logged buffers: NVML's figure for the process
# minus the buffers and the context was 87-107 MiB in all 10 MoE launches of the H200 probe
# (n_cpu_moe 0-12, -ngl 6 and all, ubatch 512 and 2048), against 0-60 MiB for the dense model.
# ggml-cuda's memory pool, where its expert kernel (mul_mat_id) gathers each expert's rows, is
# allocated outside the graph's buffers and never logged; its middle value is taken.
CUDA_MOE_POOL_BYTES = 97 * MiB


DEFAULT_BATCH = 2048  # llama-server's -b
# Below this many tokens in a batch, ggml runs a host-resident weight's matrix product on the
# host; from it on, the GPU build copies the weight to the card and runs it there (ggml-cuda's
# offload_op, op_offload on by default): the staging that the CUDA compute buffer must hold.
OP_OFFLOAD_MIN_BATCH = 32
# Activations alive, per token, next to a staged matrix: 5 MLP-wide F32 values (gate, up, their
# product, the down product's input and output). Two ubatch values of the H200 probe
# (bench/results/offload_probe_h200: 221.51 and 413.54 MiB at 512 and 2048, both with a 157.5
# MiB Q6_K ffn_down_exps staged) fix it; the other configurations check it.
STAGED_MLP_COEF = 5


def placement(n_layers: int, gpu_layers: int | None) -> tuple[range, bool]:
    """Which decoder layers ``-ngl gpu_layers`` puts on the GPU, and whether the output head goes.

    llama.cpp counts the output layer as one of the ``-ngl`` layers and offloads from the end:
    ``i_gpu_start = max(n_layer + 1 - ngl, 0)`` (src/llama-model.cpp, load_tensors), so ``-ngl N``
    holds the head from N = 1 and the last N - 1 layers; N >= n_layers + 1 (or None) is all of them.
    The H200 probe's KV split shows it: ``-ngl 7`` of 28 layers, 6 layers' cache on CUDA0.
    """
    n = n_layers + 1 if gpu_layers is None else max(0, int(gpu_layers))
    start = max(n_layers + 1 - n, 0)
    return range(min(start, n_layers), n_layers), n >= 1


def estimate(
    model: ModelSpec,
    weights: WeightsBreakdown,
    ctx: int,
    parallel: int,
    cache_type: str,
    flash_attn: bool,
    *,
    ubatch: int | None = None,
    gpu: bool = True,
    gpu_layers: int | None = None,
    n_cpu_moe: int = 0,
    batch: int | None = None,
) -> MemoryEstimate:
    """Memory of ``llama-server -c ctx*parallel -np parallel -ub ubatch -ngl gpu_layers --n-cpu-moe n_cpu_moe``.

    On a GPU, ``weights_bytes``, ``kv_bytes``, ``buffers_bytes`` and ``overhead_bytes`` are what
    the card holds; ``host_bytes`` is what stays in host memory (the token embeddings, the
    layers not offloaded and their KV cache, the first ``n_cpu_moe`` layers' experts) and
    ``host_buffers_bytes`` the pinned CUDA_Host compute buffer.

    Args:
        model: The model's shape (from the GGUF file's metadata).
        weights: The file's tensor bytes (:func:`autotune.engine.formats.gguf_file_weights`).
        ctx: Context of one sequence.
        parallel: Slots (``-np``).
        cache_type: K and V cache type (``-ctk``/``-ctv``).
        flash_attn: ``-fa on``.
        ubatch: ``-ub``; llama-server's default when None.
        gpu: Whether the server runs on a GPU (a CUDA context, CUDA's buffers) or the CPU.
        gpu_layers: ``-ngl``; None (or more than the layers + 1) is every layer.
        n_cpu_moe: ``--n-cpu-moe``: the first N layers keep their routed experts on the host.
        batch: ``-b``; llama-server's default when None (the micro-batch never exceeds it).
    """
    # llama_context: n_batch = min(n_ctx, -b), n_ubatch = min(n_batch, -ub).
    ub = min(ubatch or DEFAULT_UBATCH, batch or DEFAULT_BATCH, ctx * parallel)
    # llama.cpp's own table: the memory model needs no registry (the twin uses it too).
    kv, cells, how = kv_cache_bytes(model, resolve(cache_type, CACHE_TYPES) or cache_type, ctx, parallel, LAYOUT)
    cells_seq = LAYOUT.cells_per_sequence(ctx)
    buffers = (CUDA_BUFFERS if gpu else CPU_BUFFERS).bytes(model, cells_seq, ub, flash_attn)
    notes = [
        f"KV: {how} x {model.n_layers} layers x {model.kv_dim} x (K+V {cache_type})",
        f"compute buffer: ubatch {ub}, {'fused' if flash_attn else 'unfused'} attention over "
        f"{cells_seq} cells per slot",
    ]
    if not gpu:
        notes.append("CPU build: every buffer is in host memory")
        return MemoryEstimate(
            weights_bytes=int(weights.total_bytes),
            kv_bytes=kv,
            buffers_bytes=buffers,
            overhead_bytes=0,
            host_bytes=0,
            notes=tuple(notes),
        )

    n_layers = len(weights.per_layer_bytes) or model.n_layers
    on_gpu, head_on_gpu = placement(n_layers, gpu_layers)
    moe_host = range(min(max(0, int(n_cpu_moe)), n_layers))
    gpu_weights = sum(weights.per_layer_bytes[i] - (weights.expert_bytes(i) if i in moe_host else 0) for i in on_gpu)
    if head_on_gpu:
        gpu_weights += weights.output_bytes + weights.other_bytes
        if weights.head_is_embedding:
            gpu_weights += weights.embedding_bytes
            notes.append("tied embeddings: the head is loaded again on the GPU")
    host_weights = (
        weights.total_bytes
        - gpu_weights
        + (weights.embedding_bytes if weights.head_is_embedding and head_on_gpu else 0)
    )
    # Each layer's cache lives beside its layer (offload_kqv, on by default).
    kv_gpu = kv * len(on_gpu) // n_layers if n_layers else kv
    kv_host = kv - kv_gpu
    # The CPU backend's graph (the embedding lookup, its inputs, the mask) in pinned memory:
    # the probe's CUDA_Host compute, 12.01-72.05 MiB, is 2 residual-wide F32 values per token
    # plus the mask, at every -ngl.
    mask_bytes = CUDA_BUFFERS.mask_bytes_fused if flash_attn else CUDA_BUFFERS.mask_bytes
    host_compute = ub * (2 * model.hidden_size * 4 + cells_seq * mask_bytes)
    staged = _staged_bytes(model, weights, on_gpu, moe_host, n_layers, ub, cells_seq, mask_bytes, flash_attn)
    if staged > buffers:
        notes.append(
            f"compute buffer: {staged / MiB:.0f} MiB, a host-resident matrix staged on the GPU "
            f"for batches of {OP_OFFLOAD_MIN_BATCH}+ tokens"
        )
        buffers = staged
    if len(on_gpu) < n_layers or not head_on_gpu:
        notes.append(
            f"-ngl {gpu_layers}: {len(on_gpu)} of {n_layers} layers on the GPU"
            f"{', the output head too' if head_on_gpu else ', the output head on the host'}"
        )
    if len(moe_host) and weights.per_layer_expert_bytes:
        notes.append(
            f"--n-cpu-moe {len(moe_host)}: layers 0-{len(moe_host) - 1} keep their experts "
            f"({sum(weights.expert_bytes(i) for i in moe_host) / GiB:.2f} GiB) in host memory"
        )
    notes.append(
        f"host memory: {host_weights / GiB:.2f} GiB of weights (token embeddings included), "
        f"{kv_host / MiB:.0f} MiB of KV, {host_compute / MiB:.0f} MiB pinned compute buffer"
    )
    overhead = CUDA_CONTEXT_BYTES
    if model.is_moe:
        overhead += CUDA_MOE_POOL_BYTES
        notes.append(f"+{CUDA_MOE_POOL_BYTES // MiB} MiB: ggml-cuda's pool for the expert kernel (not logged)")
    return MemoryEstimate(
        weights_bytes=int(gpu_weights),
        kv_bytes=int(kv_gpu),
        buffers_bytes=int(buffers),
        overhead_bytes=overhead,
        host_bytes=int(host_weights + kv_host),
        host_buffers_bytes=int(host_compute),
        notes=tuple(notes),
    )


def _staged_bytes(
    model: ModelSpec,
    weights: WeightsBreakdown,
    on_gpu: range,
    moe_host: range,
    n_layers: int,
    ub: int,
    cells_seq: int,
    mask_bytes: int,
    flash_attn: bool,
) -> int:
    """The CUDA compute buffer's peak while a host-resident matrix is staged on the card: the
    largest such matrix (a whole host layer's, or a host expert tensor), plus the MLP
    activations of the micro-batch around it and the mask. 0 when nothing is staged (every
    matrix on the GPU, or micro-batches too small for ggml to move the work to the card). An
    output head left on the host is never staged: llama-server asks for the logits of a
    prompt's last token only, a product of one row (the probe's -ngl 0 buffer is its -ngl 7's)."""
    if ub < OP_OFFLOAD_MIN_BATCH:
        return 0
    largest = max(
        [weights.largest_bytes(i) for i in range(n_layers) if i not in on_gpu]
        + [weights.largest_bytes(i, experts_only=True) for i in moe_host if i in on_gpu],
        default=0,
    )
    if not largest:
        return 0
    # Two bounds on the peak, the smaller wins: the staged matrix beside the activations of its
    # own product (a MoE's: exact on the probe); and the whole-GPU peak plus the matrix, where
    # the product's activations fit inside what the graph already reserves (a dense model's: 3
    # MLP-wide activations per token dwarf the matrix; within 3-7% on the probe, never under).
    whole = CUDA_BUFFERS.bytes(model, cells_seq, ub, flash_attn)
    own = largest + ub * STAGED_MLP_COEF * model.mlp_width * 4 + ub * cells_seq * mask_bytes
    return int(min(whole + largest, max(whole, own)))
