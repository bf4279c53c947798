"""What an engine model's memory model and the twin's physics take: one configuration as the
physics sees it (:class:`Scenario`), and the constants of an engine and of the host
(:class:`EngineConstants`, :class:`HostConstants`: each engine's fitted or source-read values
live in its own plugin's ``engine_model.toml``, the host's in the twin's ``constants.toml``).
Shared by the engine plugins (their memory models) and the twin (its physics); no engine owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.api import ModelSpec
from autotune.api import WeightsBreakdown
from autotune._builtin import GpuSpec

GiB = 2**30
# llama.cpp prefills in ubatches of 512 tokens by default (-ub 512); llama-server's memory model
# reads it from here (the physics prefills every engine's prompt in such ubatches).
LLAMA_UBATCH = 512
#: flash-attn 2 (and with it ExLlamaV2's paged attention, vLLM's FlashAttention backend) needs sm_80.
FLASH_ATTN2_MIN_CC = (8, 0)
# The share of the card vLLM reserves by default (--gpu-memory-utilization 0.9).
VLLM_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class EngineConstants:
    """What differs between engines; the fitted values live in constants.toml.

    Attributes:
        weight_bw_efficiency: Share of the card's bandwidth its decode kernels stream weights at.
        layer_us_ghz: Fixed cost per layer and step (kernel launches, norms, small ops), in µs
            at a 1 GHz clock: the card's boost clock divides it.
        sample_ns_per_vocab: Host time per stream, step and vocabulary entry that a serving
            engine spends sampling (0 under an offline benchmark's harness), in ns.
        request_ms: Fixed latency of one batch of requests under autotune's protocol (HTTP,
            tokenizing, slot set-up, the first token's round trip), in ms.
        spill_step_ms: Extra cost per step when the model is split between the GPU and the
            host (synchronising the two halves of the graph, the host's thread pool), in ms.
        vector_max_batch: The most streams the engine's matrix-vector decode kernels take; rows
            beyond it run the matrix kernels (physics.matrix_rows_rate; llama.cpp: MMVQ_MAX_BATCH_SIZE = 8,
            then its MMQ kernels).
        volta_bw_factor: What the engine's decode kernels reach on Volta (sm_70) relative to
            later cards: both engines' kernels are written for sm_75+ (asynchronous copies,
            INT8 tensor cores), and the article's V100 rows run at about half the bandwidth
            share the published Ampere/Ada/Hopper figures show.
        unfused_attn_per_layer_us: Extra cost per layer and step when attention is not fused
            (separate KQ, softmax and KQV kernels): llama.cpp without --flash-attn.
        unfused_kv_copies: Passes over K and V widened to every query head that attention
            without flash-attn makes per context token and layer (ExLlamaV2's ``repeat_kv``
            writes the copy and SDPA or the matmul reads it: 2; read from its attn.py, not
            fitted); 0 for an engine that attends on the cache as stored.
        quant_cache_extra_bytes: Extra traffic per quantized cache element read, in bytes, for
            engines that dequantize the cache before attention (0 for fused dequant).
        decode_compute_efficiency: Share of the card's CUDA-core FP16 rate that the
            dequantize-and-multiply decode kernels reach.
        prefill_efficiency: Share of the tensor-core FP16 rate reached on prompts.
        context_bytes: CUDA context, allocator and library workspaces, in bytes (an engine whose
            memory model is a real backend's, as llama.cpp's is, takes that model's own: 0 here).
        keeps_embeddings_on_host: Whether the token embeddings stay in host memory.
        spill: ``layers`` (the engine moves layers that do not fit to the CPU, as llama.cpp
            does) or ``oom`` (it fails to load).
        op_offload_min_batch: Fewest tokens of a batch for which the engine multiplies host
            weights on the GPU, copying them over (llama.cpp: ``GGML_OP_OFFLOAD_MIN_BATCH``, 32);
            smaller batches are multiplied by the CPU (:mod:`offload`). 0: not modelled (prefill
            copies host weights for any ubatch, decode leaves them to the CPU). Read from the
            source, not fitted.
        trellis_ops_per_weight: Integer operations the engine's decode kernels spend decoding
            one trellis-quantized weight (EXL3's procedural codebook), run on the card's INT32
            lanes (:func:`physics.int32_tops`) once per step whatever the streams; 0 for formats
            read by a lookup or a scale. Fitted where exllamav3 says its kernel turns
            DRAM-bound (evidence.EXL3_KERNEL).
        expert_tile_columns: Widest tile of the engine's expert matmul on the GPU (llama.cpp's
            MMQ: 128 columns, chosen against the whole ubatch), whose unfilled columns cost as
            much as filled ones (:func:`offload.expert_tile_factor`); 0: no such padding.
    """

    weight_bw_efficiency: float
    layer_us_ghz: float
    sample_ns_per_vocab: float
    request_ms: float
    spill_step_ms: float
    volta_bw_factor: float
    vector_max_batch: int
    unfused_attn_per_layer_us: float
    unfused_kv_copies: float
    quant_cache_extra_bytes: float
    decode_compute_efficiency: float
    prefill_efficiency: float
    context_bytes: float
    keeps_embeddings_on_host: bool
    spill: str
    op_offload_min_batch: int = 0
    expert_tile_columns: int = 0
    trellis_ops_per_weight: float = 0.0


@dataclass(frozen=True)
class HostConstants:
    """Constants of the host side.

    Attributes:
        host_bw_efficiency: Achieved share of the catalog's host memory bandwidth when the CPU
            runs spilled layers (can exceed 1 where the catalog's figure undersells the host).
        host_thread_gb_s: Bytes of quantized weights one CPU thread dequantizes and multiplies
            per second at decode, in GB/s: with ``Scenario.host_threads`` known, the host side
            runs at the lesser of the memory's rate and the threads' (a 16-core slice of a large
            server does not reach the server's memory bandwidth).
        host_pcie_efficiency: Share of the catalog's PCIe rate at which host-resident weights
            cross to the GPU during prefill (llama.cpp copies them from mapped, pageable memory
            once per ubatch, not at the pinned-memory rate the catalog quotes).
    """

    host_bw_efficiency: float
    host_thread_gb_s: float = 0.0
    host_pcie_efficiency: float = 1.0


@dataclass(frozen=True)
class Scenario:
    """One configuration as the physics sees it (engine flags already translated)."""

    engine: str
    gpu: GpuSpec
    model: ModelSpec
    weights: WeightsBreakdown
    ctx: int
    parallel: int
    cache_type: str
    flash_attn: bool
    prompt_tokens: int
    output_tokens: int
    # "all", "auto" (fit as many as the card holds) or a count as llama.cpp's -ngl reads it, the
    # output head counted as the last of n_layers + 1: N >= 1 puts the head and the last N - 1
    # decoder layers on the GPU (llama_model::load_tensors: i_gpu_start = n_layers + 1 - N).
    gpu_layers: int | str = "all"
    # llama.cpp's --n-cpu-moe N: the expert tensors of the first N layers stay in host memory.
    n_cpu_moe: int = 0
    # llama.cpp's -ub: prompt tokens per physical batch (host weights cross PCIe once per ubatch).
    ubatch: int = LLAMA_UBATCH
    # llama.cpp's -b: the logical batch (None: the engine's default), which bounds the ubatch.
    batch: int | None = None
    # CPU threads the engine runs host layers with (None: unknown, the host's memory bandwidth alone).
    host_threads: int | None = None
    # "server": autotune's protocol, the engine's server sampling every token of every stream;
    # "bench": an offline benchmark (llama-bench tg128, ExLlamaV2's test_inference), which
    # samples nothing: what published single-stream figures measure.
    harness: str = "server"
    # vLLM's --gpu-memory-utilization; engines that allocate what they need ignore it.
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    # Sequences the engine generates together (0: all ``parallel``); fewer are served in waves,
    # as ExLlamaV2's dynamic generator without paged attention does (:mod:`service`).
    jobs_at_once: int = 0
    # Speculative decoding as the twin prices it (autotune_plugins.twin.speculation.Speculation;
    # None: none). Typed loosely: the engine plugins' memory models never read it.
    speculation: Any = None


def weights_on_gpu(s: Scenario, k: EngineConstants) -> tuple[int, int, list[str]]:
    """(bytes on the GPU, bytes left on the host, notes) of the weights in the engine's placement."""
    w = s.weights
    if k.keeps_embeddings_on_host or not w.embedding_on_gpu:
        # gpu_bytes keeps a tied head (the embedding matrix loaded on the GPU again as the output layer).
        host = w.total_bytes - w.gpu_bytes
        notes = [f"token embeddings ({host / GiB:.2f} GiB) stay in host memory"] if host else []
        return int(w.gpu_bytes), int(host), notes
    return int(w.total_bytes), 0, []
