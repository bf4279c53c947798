"""The digital twin's physics: memory and speed of one serving configuration, from first principles.

Nothing here looks anything up by configuration: every figure is computed from the card
(bandwidth, FLOP rates, memory, PCIe, host memory), the model's shape, the weights format's
real byte layout and the engine's few fitted constants (``constants.toml``, written by
``python -m autotune_plugins.twin.fit``). docs/twin.md derives the equations; the names of
the terms below follow it.

Decode, one step of ``P`` parallel streams, each holding ``c`` tokens of context:

    t_mem    = (W_gpu + P * c * kv_read_bytes) / (B * eta_w)        weights streamed once per step
    t_comp   = P * 2 * N_lin / (F_core * eta_c)                      dequantize-and-multiply work
             + N_lin * ops_trellis / I32                             EXL3's trellis decode, once a step
    t_fixed  = n_layers * k_layer / f_clock                          small kernels and launches
    t_serve  = P * n_vocab * k_sample                                the server samples each stream
    t_step   = t_fixed + soft_max(t_mem, t_comp) + t_serve + t_unfused + t_spill

The fixed cost is what a fast card spends most of its step on: a 7B token takes 3-5 ms on an
H200, of which about 2 ms are the ~10 small kernels of each layer (norms, rope, launches), whose
duration scales with the GPU's clock rather than its bandwidth. The serving term is the host's
per-stream work that an offline benchmark (llama-bench) never pays: sampling over the whole
vocabulary for every stream at every step (H200, llama-server: ~0.85 ms per stream with a 152K
vocabulary, the same for a 1.5B and a 7B model).

A mixture of experts reads the experts the step's tokens route to (:func:`distinct_experts`);
host weights (layers past ``-ngl``, the first ``n_cpu_moe`` layers' experts) are read by the CPU
at :func:`host_rate` or copied to the GPU per ubatch (:mod:`offload`). ``soft_max`` is the
roofline's corner, rounded (a p-norm): memory and arithmetic do not overlap perfectly. Prefill
is compute-bound on the tensor cores, plus the host weights' crossings. The aggregate is what
autotune's protocol measures, ``P`` requests sent together (:mod:`service`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from autotune.api import CacheType, MemoryEstimate, ModelSpec
from autotune._builtin import GpuSpec, cache_bytes_per_element, engine_model, engine_models, resolve_cache_type
from autotune_plugins.shared.scenario import (  # noqa: F401  (physics' names for them, as before)
    LLAMA_UBATCH,
    VLLM_GPU_MEMORY_UTILIZATION,
    EngineConstants,
    HostConstants,
    Scenario,
)
from autotune_plugins.twin import offload, service
from autotune_plugins.twin.offload import distinct_experts  # noqa: F401  (physics' name for it, as before)

GiB = 2**30

# Rounding of the roofline corner: (a^k + b^k)^(1/k). k = 4 keeps a term that is a third of
# the other within 1% of the max, and blends them near the ridge point, where dequantizing
# kernels are neither purely bandwidth- nor purely ALU-bound.
ROOFLINE_SHARPNESS = 4.0


def twinned_cache_types() -> tuple[CacheType, ...]:
    """The cache types of the engines the twin models: their engine models' own tables."""
    models = engine_models()  # the same mapping until the plugins change
    if _TWINNED[0] is not models:
        _TWINNED[:] = [models, tuple(ct for m in models.values() for ct in m.kv_cache_types)]
    return _TWINNED[1]


_TWINNED: list = [None, ()]


def fp16_core_tflops(gpu: GpuSpec) -> float:
    """FP16 rate of the CUDA cores (not the tensor cores), which dequantizing kernels use.

    From sm_60 on, except sm_61, FP16 runs at twice the FP32 rate (packed half2); sm_61
    (P40, GTX 10xx) runs FP16 at 1/64 rate, so engines compute in FP32 there.
    """
    if gpu.compute_capability == "6.1":
        return gpu.fp32_tflops
    return 2.0 * gpu.fp32_tflops


def int8_dot_tops(gpu: GpuSpec) -> float:
    """INT8 dot-product rate of the CUDA cores (dp4a, sm_61 on: four per FP32 lane), which
    quantized kernels fall back to where tensor cores are missing or FP16 is slow."""
    return 4.0 * gpu.fp32_tflops


def int32_tops(gpu: GpuSpec) -> float:
    """INT32 rate of the CUDA cores, in tera-operations per second. GA10x (sm_86), Ada (sm_89)
    and Hopper (sm_90) SMs run INT32 on 64 of their 128 FP32 lanes; GA100 (sm_80), Volta and
    Pascal on as many lanes as FP32 (GA100 and Volta in a separate 64-wide INT32 path), and
    Blackwell's lanes all take INT32. An FMA counts two FLOPs in ``fp32_tflops``."""
    cc = gpu.compute_capability_tuple
    return gpu.fp32_tflops / (4.0 if (8, 6) <= cc < (10, 0) else 2.0)


def prefill_tflops(gpu: GpuSpec) -> float:
    """The rate prompt processing runs at: the tensor cores, or on cards without them (Pascal)
    the INT8 dot products llama.cpp's quantized matrix kernels use there (47 TOPS on a P40,
    against its 0.18 TFLOPS of FP16)."""
    return max(gpu.fp16_tensor_tflops, int8_dot_tops(gpu) if gpu.compute_capability_tuple < (7, 0) else 0.0)


#: llama.cpp's ``MMQ_DP4A_MAX_BATCH_SIZE`` (ggml-cuda/mmq.cuh): on a card without INT8 tensor cores
#: (before Turing, sm_75) its quantized matrix kernel (MMQ) multiplies with dp4a on the CUDA cores
#: for batches below it, and hands larger ones to cuBLAS on the FP16 tensor cores
#: (``ggml_cuda_should_use_mmq``).
DP4A_MAX_BATCH = 64


def matrix_rows_rate(gpu: GpuSpec, k: EngineConstants, rows: float) -> float:
    """FLOP/s of a decode step's rows past the matrix-vector kernels' batch: the tensor cores
    like a prompt where the card has INT8 ones (Turing on); before Turing, below
    :data:`DP4A_MAX_BATCH` rows, the same dp4a on the same CUDA cores as the matrix-vector
    kernels, so such a row costs what a matrix-vector row does (a Volta's FP16 tensor cores
    take only cuBLAS's larger batches)."""
    if gpu.compute_capability_tuple < (7, 5) and rows < DP4A_MAX_BATCH:
        return fp16_core_tflops(gpu) * 1e12 * k.decode_compute_efficiency
    return prefill_tflops(gpu) * 1e12 * k.prefill_efficiency


def linear_params(model: ModelSpec) -> int:
    """Parameters in the matrices a token could multiply with: all of them but the embeddings
    (for a mixture of experts, every expert: what memory holds, not what one token reads)."""
    return model.n_params - model.n_embedding_params


def expert_params_per_layer(model: ModelSpec) -> int:
    """Parameters of one layer's routed experts (gate, up and down of each); 0 for a dense model."""
    return model.n_experts * 3 * model.hidden_size * model.expert_ffn_size if model.is_moe else 0


def expert_share(model: ModelSpec) -> float:
    """The experts' share of a MoE layer's parameters, from the shape: attention, router and
    experts (norms are noise). It splits a layer's bytes, which the file or the format gives
    whole, into what every token reads and what only the routed tokens read."""
    experts = expert_params_per_layer(model)
    if not experts:
        return 0.0
    attention = 2 * model.hidden_size * model.q_dim + 2 * model.hidden_size * model.kv_dim
    router = model.hidden_size * model.n_experts
    return experts / (attention + router + experts)


def active_linear_params(model: ModelSpec) -> float:
    """Parameters one token multiplies with: the non-expert ones and its k experts per layer."""
    if not model.is_moe:
        return float(linear_params(model))
    unused = model.n_layers * expert_params_per_layer(model) * (1.0 - model.n_experts_used / model.n_experts)
    return float(linear_params(model)) - unused


@dataclass(frozen=True)
class Placement:
    """Which weights sit where, in bytes (experts counted whole: all E of each layer).

    Attributes:
        gpu_layers: Decoder layers on the GPU (``-ngl``'s share of the layers).
        head_on_gpu: Whether the output head is on the GPU.
        gpu_dense_bytes: Non-expert weights of the GPU layers, the head when it is there.
        gpu_expert_bytes: Experts of GPU layers that ``n_cpu_moe`` leaves on the GPU.
        host_dense_bytes: Non-expert weights of host layers, the head when it is there.
        host_expert_bytes: Experts in host memory: those of host layers and of the first
            ``n_cpu_moe`` layers.
        host_kv_layers: Layers whose KV cache (and attention) stays on the host.
    """

    gpu_layers: int
    head_on_gpu: bool
    gpu_dense_bytes: float
    gpu_expert_bytes: float
    host_dense_bytes: float
    host_expert_bytes: float
    host_kv_layers: int

    @property
    def host_bytes(self) -> float:
        return self.host_dense_bytes + self.host_expert_bytes


def placement(s: Scenario, gpu_layers: int) -> Placement:
    """Where llama.cpp puts each layer for ``gpu_layers`` of them on the GPU (the last ones, as
    -ngl does) and the scenario's ``n_cpu_moe`` (the first layers' experts on the host)."""
    m, w = s.model, s.weights
    n = m.n_layers
    share = expert_share(m)
    first_gpu = n - gpu_layers
    head_on_gpu = not isinstance(s.gpu_layers, int) or s.gpu_layers >= 1
    head = w.output_bytes + w.other_bytes
    gd, ge, hd, he = (head, 0.0, 0.0, 0.0) if head_on_gpu else (0.0, 0.0, head, 0.0)
    for i, layer in enumerate(w.per_layer_bytes):
        experts = layer * share
        if i < first_gpu:
            hd, he = hd + layer - experts, he + experts
        elif i < s.n_cpu_moe:
            gd, he = gd + layer - experts, he + experts
        else:
            gd, ge = gd + layer - experts, ge + experts
    return Placement(gpu_layers, head_on_gpu, gd, ge, hd, he, first_gpu)


def bandwidth_efficiency(gpu: GpuSpec, k: EngineConstants) -> float:
    """Share of the card's bandwidth the engine's decode kernels stream weights at."""
    return k.weight_bw_efficiency * (k.volta_bw_factor if gpu.compute_capability == "7.0" else 1.0)


def soft_max(a: float, b: float, k: float = ROOFLINE_SHARPNESS) -> float:
    return (a**k + b**k) ** (1.0 / k)


# ----------------------------------------------------------------------------------- memory
#
# Each engine's memory model is its engine model's own (``EngineModel.memory``, in the engine's
# plugin, the same its real backend uses); an engine without one is an error, not another
# engine's formula.


def memory(s: Scenario, k: EngineConstants) -> MemoryEstimate:
    """Device memory of the configuration with every layer on the GPU, by the engine's own model."""
    return engine_model(s.engine).memory(s, k)


def gpu_layer_split(s: Scenario, k: EngineConstants, mem: MemoryEstimate) -> int:
    """How many decoder layers stay on the GPU (the rest run on the host)."""
    n = s.model.n_layers
    if s.gpu_layers == "all" and (k.spill != "layers" or mem.total_bytes <= s.gpu.vram_bytes):
        return n
    # llama.cpp moves the layers that do not fit to the CPU ("silently", as the article found
    # with its 16.3 GB file on a 16 GB card); engines that cannot spill fail to load instead.
    if isinstance(s.gpu_layers, int):
        return max(0, min(n, s.gpu_layers - 1))  # -ngl N: the head and N - 1 layers
    # "auto": fill the card's physical memory, layer by layer from the last (as -ngl counts);
    # the output head, the KV of GPU layers, buffers and the context must fit too. Experts
    # that n_cpu_moe keeps on the host take no room on the card.
    per_layer_kv = mem.kv_bytes / n
    fixed = mem.buffers_bytes + mem.overhead_bytes + s.weights.output_bytes + s.weights.other_bytes
    free = s.gpu.vram_bytes - fixed
    share = expert_share(s.model)
    on_gpu = 0
    for i in reversed(range(n)):
        layer_bytes = s.weights.per_layer_bytes[i] * (1.0 - share if i < s.n_cpu_moe else 1.0)
        need = layer_bytes + per_layer_kv
        if free < need:
            break
        free -= need
        on_gpu += 1
    return on_gpu


# ----------------------------------------------------------------------------------- speed


@dataclass(frozen=True)
class Prediction:
    """What the twin predicts for one configuration."""

    decode_tok_s: float
    per_user_tok_s: float
    aggregate_tok_s: float
    prefill_tok_s: float
    ttft_ms: float
    roofline_tok_s: float
    step_ms_single: float
    step_ms_parallel: float
    gpu_layers: int
    host_layers: int
    host_expert_layers: int
    bytes_per_token: float
    terms_ms: Mapping[str, float]

    def as_dict(self) -> dict[str, Any]:
        return {
            "decode_tok_s": self.decode_tok_s,
            "per_user_tok_s": self.per_user_tok_s,
            "aggregate_tok_s": self.aggregate_tok_s,
            "prefill_tok_s": self.prefill_tok_s,
            "ttft_ms": self.ttft_ms,
            "roofline_tok_s": self.roofline_tok_s,
        }


def _cache(s: Scenario) -> CacheType | str:
    """The scenario's cache type as the twinned engines declare it (the twin models them without
    the registry); a name they lack goes on to the installed backends' catalog."""
    return resolve_cache_type(s.cache_type, twinned_cache_types()) or s.cache_type


def kv_read_bytes_per_token(s: Scenario, k: EngineConstants) -> float:
    """Bytes of cache traffic per context token and decode step (all layers, K and V)."""
    per_elem = cache_bytes_per_element(_cache(s))
    if per_elem < 2.0:  # quantized: some engines dequantize into an FP16 copy first
        per_elem += k.quant_cache_extra_bytes
    return s.model.n_layers * s.model.kv_dim * 2 * per_elem


def unfused_copy_bytes(m: ModelSpec, k: EngineConstants) -> float:
    """Bytes per context token and step (all layers) that attention without flash-attn moves
    beyond reading the cache: ExLlamaV2 attends over the context in use (``past_len + q_len``
    keys, attn.py) after widening grouped K and V to every query head (``repeat_kv``), a copy
    written and read again; with one key head per query head nothing is copied."""
    if m.n_kv_heads >= m.n_heads:
        return 0.0
    return m.n_layers * k.unfused_kv_copies * 2 * m.q_dim * 2


def host_rate(s: Scenario, host: HostConstants) -> float:
    """Bytes per second the CPU reads and multiplies host weights at during decode: the host's
    memory bandwidth, or the engine's threads' rate when that is lower and the threads are known."""
    rate = s.gpu.host_mem_gb_s * 1e9 * host.host_bw_efficiency
    if s.host_threads and host.host_thread_gb_s > 0:
        rate = min(rate, s.host_threads * host.host_thread_gb_s * 1e9)
    return rate


def step_terms(
    s: Scenario,
    k: EngineConstants,
    host: HostConstants,
    parallel: int,
    context_tokens: float,
    gpu_layers: int,
    tokens_per_stream: float = 1.0,
) -> dict[str, float]:
    """Seconds of each term of one decode step for ``parallel`` streams.

    Weights read per step: every non-expert weight once, and of each layer's experts the share
    the step's tokens route to (:func:`distinct_experts`); each on the device it sits on
    (:func:`placement`): the GPU's part over its bandwidth, the host's over :func:`host_rate`.
    Arithmetic counts the active parameters of each token. ``tokens_per_stream`` > 1 is a
    speculative verify pass (:mod:`speculation`): each stream's drafted tokens are rows of the
    same step (arithmetic, routing and sampling count them) over the stream's one cache."""
    g, m = s.gpu, s.model
    bw = g.mem_bandwidth_gb_s * 1e9
    n = m.n_layers
    where = placement(s, gpu_layers)
    cache_streams, parallel = parallel, parallel * tokens_per_stream  # rows of the step from here on
    routed = distinct_experts(m, parallel) / m.n_experts if m.is_moe else 1.0
    frac_gpu = gpu_layers / n
    # The embedding row lookup reads one row per token: no bandwidth worth counting.
    weights_read = where.gpu_dense_bytes + where.gpu_expert_bytes * routed
    kv_read = cache_streams * context_tokens * kv_read_bytes_per_token(s, k) * frac_gpu
    t_mem = (weights_read + kv_read) / (bw * bandwidth_efficiency(g, k))
    # Arithmetic on the GPU: its share of each token's active parameters (layers and experts alike).
    used = m.n_experts_used / m.n_experts if m.is_moe else 1.0
    active_gpu = where.gpu_dense_bytes + where.gpu_expert_bytes * used
    active_all = active_gpu + where.host_dense_bytes + where.host_expert_bytes * used
    n_lin = active_linear_params(m) * active_gpu / max(active_all, 1.0)
    vector_rows = min(parallel, k.vector_max_batch)
    t_comp = vector_rows * 2 * n_lin / (fp16_core_tflops(g) * 1e12 * k.decode_compute_efficiency)
    t_comp += (parallel - vector_rows) * 2 * n_lin / matrix_rows_rate(g, k, parallel)
    # A trellis weight is decoded once per step (the GEMV/GEMM tile shares it across the rows).
    t_comp += n_lin * k.trellis_ops_per_weight / (int32_tops(g) * 1e12)
    t_fixed = n * k.layer_us_ghz * 1e-6 / (g.boost_clock_mhz / 1000.0)
    t_serve = parallel * m.vocab_size * k.sample_ns_per_vocab * 1e-9 if s.harness == "server" else 0.0
    t_unfused = 0.0
    if not s.flash_attn:
        t_unfused += n * k.unfused_attn_per_layer_us * 1e-6
        t_unfused += (
            cache_streams * context_tokens * unfused_copy_bytes(m, k) * frac_gpu / (bw * bandwidth_efficiency(g, k))
        )
    t_host = 0.0
    host_read = where.host_dense_bytes + where.host_expert_bytes * routed
    if host_read:
        # Host layers and host experts run on the CPU, streaming their weights from host
        # memory, and the host layers' KV with them; the activations cross PCIe twice per
        # step and host segment (negligible next to the weights). A step of at least the
        # engine's offload batch copies the weights to the GPU instead (offload.offloaded).
        host_kv = cache_streams * context_tokens * kv_read_bytes_per_token(s, k) * where.host_kv_layers / n
        if k.op_offload_min_batch and offload.offloaded(parallel, k.op_offload_min_batch):
            t_host = host_read / (g.pcie_gb_s * 1e9 * host.host_pcie_efficiency) + host_kv / host_rate(s, host)
        else:
            t_host = (host_read + host_kv) / host_rate(s, host) + k.spill_step_ms * 1e-3
        t_host += 2 * parallel * m.hidden_size * 2 / (g.pcie_gb_s * 1e9)
    return {
        "fixed": t_fixed,
        "serve": t_serve,
        "memory": t_mem,
        "compute": t_comp,
        "roofline": soft_max(t_mem, t_comp),
        "unfused_attention": t_unfused,
        "host": t_host,
    }


def step_seconds(terms: Mapping[str, float]) -> float:
    return terms["fixed"] + terms["serve"] + terms["roofline"] + terms["unfused_attention"] + terms["host"]


def decode_seconds(
    s: Scenario, k: EngineConstants, host: HostConstants, parallel: int, context_tokens: float, gpu_layers: int
) -> float:
    """Seconds per generated token of each of ``parallel`` streams: one step, or with
    speculation (``s.speculation``) a cycle's drafting and verify pass over the tokens it yields."""
    if s.speculation is not None and s.speculation.spec_type != "none":
        return s.speculation.seconds_per_token(s, k, host, parallel, context_tokens, gpu_layers)
    return step_seconds(step_terms(s, k, host, parallel, context_tokens, gpu_layers))


def prefill_tok_s(s: Scenario, k: EngineConstants, host: HostConstants, gpu_layers: int) -> float:
    """Prompt tokens per second over the ``parallel`` prompts of a batch of requests.

    Tensor-core bound on the GPU, on each token's active parameters, the experts' share padded
    to the engine's tiles (:func:`offload.expert_tile_factor`). Each ubatch that reaches the
    engine's offload batch (:func:`offload.offloaded`) copies the host weights it uses to the
    GPU: host layers whole, of host experts those its tokens route to
    (:func:`distinct_experts`); a smaller ubatch leaves them to the CPU, which multiplies each
    token with its share of them at :func:`host_rate`. A larger ``ubatch`` means fewer crossings."""
    g, m = s.gpu, s.model
    tokens = max(1, s.parallel * s.prompt_tokens)
    rate = prefill_tflops(g) * 1e12 * k.prefill_efficiency
    expert_active = m.n_layers * m.n_experts_used * 3 * m.hidden_size * m.expert_ffn_size if m.is_moe else 0
    other_active = active_linear_params(m) - expert_active
    where = placement(s, gpu_layers)
    pcie = g.pcie_gb_s * 1e9 * host.host_pcie_efficiency
    used = m.n_experts_used / m.n_experts if m.is_moe else 1.0
    host_per_token = where.host_dense_bytes + where.host_expert_bytes * used
    host_share = host_per_token / max(where.gpu_dense_bytes + where.gpu_expert_bytes * used + host_per_token, 1.0)
    seconds = 0.0
    for ub in offload.ubatch_sizes(tokens, s.ubatch):
        pad = offload.expert_tile_factor(m, ub, k.expert_tile_columns)
        gpu_s = ub * 2 * (other_active + expert_active * pad) / rate
        if not where.host_bytes:
            seconds += gpu_s
        elif offload.offloaded(ub, k.op_offload_min_batch):
            routed = distinct_experts(m, ub) / m.n_experts if m.is_moe else 1.0
            seconds += gpu_s + (where.host_dense_bytes + where.host_expert_bytes * routed) / pcie
        else:
            seconds += gpu_s * (1 - host_share) + ub * host_per_token / host_rate(s, host)
    return tokens / seconds


def predict(s: Scenario, k: EngineConstants, host: HostConstants) -> Prediction:
    """Speed of the configuration under autotune's measurement protocol."""
    mem = memory(s, k)
    gpu_layers = gpu_layer_split(s, k, mem)
    c_decode = s.prompt_tokens + s.output_tokens / 2  # mean context while generating
    jobs = min(s.jobs_at_once or s.parallel, s.parallel)  # sequences the engine runs together
    t1_terms = step_terms(s, k, host, 1, c_decode, gpu_layers)
    tp_terms = step_terms(s, k, host, jobs, c_decode, gpu_layers)
    t1, tp = (decode_seconds(s, k, host, p, c_decode, gpu_layers) for p in (1, jobs))
    pf = prefill_tok_s(s, k, host, gpu_layers)
    request_s = k.request_ms * 1e-3 if s.harness == "server" else 0.0
    aggregate, per_user, ttft_s = service.served(s.parallel, jobs, s.prompt_tokens / pf, s.output_tokens, tp, request_s)
    where = placement(s, gpu_layers)
    used = distinct_experts(s.model, 1) / s.model.n_experts if s.model.is_moe else 1.0
    weights_per_token = (
        where.gpu_dense_bytes + where.host_dense_bytes + (where.gpu_expert_bytes + where.host_expert_bytes) * used
    )
    bytes_per_token = weights_per_token + c_decode * kv_read_bytes_per_token(s, k)
    return Prediction(
        decode_tok_s=1.0 / t1,
        per_user_tok_s=per_user,
        aggregate_tok_s=aggregate,
        prefill_tok_s=pf,
        ttft_ms=1000.0 * ttft_s,
        roofline_tok_s=s.gpu.mem_bandwidth_gb_s * 1e9 / bytes_per_token,
        step_ms_single=1000.0 * t1,
        step_ms_parallel=1000.0 * tp,
        gpu_layers=gpu_layers,
        host_layers=s.model.n_layers - gpu_layers,
        host_expert_layers=min(s.model.n_layers, max(s.n_cpu_moe, s.model.n_layers - gpu_layers))
        if s.model.is_moe
        else 0,
        bytes_per_token=bytes_per_token,
        terms_ms={name: 1000.0 * v for name, v in tp_terms.items()},
    )
