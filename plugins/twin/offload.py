"""What llama.cpp's scheduler and CUDA kernels do with host weights and routed experts.

Read from llama.cpp (llama-cpp-python 0.3.36's vendored copy), the twin's :mod:`physics` uses:

- Which device multiplies a host-resident weight (``ggml_backend_sched_backend_id_from_cur``
  in ggml-backend.cpp): an op whose weight sits in a host buffer goes to the GPU when the GPU
  backend's ``offload_op`` accepts it, which ggml-cuda.cu's ``ggml_backend_cuda_device_offload_op``
  does when the op's batch (``get_op_batch_size``: ``ne[1]`` of a MUL_MAT, ``ne[2]``, the
  tokens, of a MUL_MAT_ID) is at least ``GGML_OP_OFFLOAD_MIN_BATCH`` (default 32). Below that
  the CPU multiplies it where it lies; at or above it the weight is copied to the GPU for every
  graph the batch runs (once per ubatch): :func:`offloaded`.
- What the CPU reads when it keeps them (ggml-cpu.c, ``ggml_compute_forward_mul_mat_id``): the
  rows of each expert the batch routes to, skipping every expert with none (``cne1 == 0``), so a
  decode step reads its tokens' experts only, at the host's rate (``physics.host_rate``).
- What crosses for experts (``ggml_backend_sched_compute_splits``): of a host MUL_MAT_ID's
  expert tensor only the experts the ubatch's ids name, in runs of consecutive ones; of a dense
  host weight, all of it. The twin's count of routed experts is :func:`physics.distinct_experts`.
- How the GPU multiplies experts (mmq.cu / mmq.cuh, ``ggml_cuda_mul_mat_q`` with ids): the tile
  width J (8..128 columns) is chosen to minimise ``ceil(ncols_opt / J)`` where on NVIDIA
  ``ncols_opt`` is the ubatch's whole token count (only RDNA3/4 choose against the per-expert
  mean), so any ubatch of 128 tokens or more runs J = 128; each expert's tokens then fill
  ``ceil(n_e / J)`` tiles of J columns, and a tile's work is the same however few of its
  columns are real. With uniform routing an expert sees ``ubatch * k / E`` tokens (32 of a
  512-token ubatch for 8 of 128 experts): a quarter of each tile's work is useful
  (:func:`expert_tile_factor`).
"""

from __future__ import annotations

import functools
import math

from autotune.api import ModelSpec


def distinct_experts(model: ModelSpec, tokens: float) -> float:
    """Expected experts of one layer a batch of ``tokens`` tokens touches, each routed to k of E:
    ``E * (1 - (1 - k/E)^B)``, assuming uniform, independent routing (real routers are skewed,
    so this is the upper end: fewer distinct experts read fewer bytes)."""
    e, k = model.n_experts, model.n_experts_used
    if not e:
        return 0.0
    return e * (1.0 - (1.0 - k / e) ** max(tokens, 0.0))


def offloaded(batch: int, min_batch: int) -> bool:
    """Whether llama.cpp multiplies host weights for a batch of ``batch`` tokens on the GPU
    (copying them over): ``min_batch`` is the engine's ``GGML_OP_OFFLOAD_MIN_BATCH`` (0: any
    batch)."""
    return batch >= min_batch


def ubatch_sizes(tokens: int, ubatch: int) -> list[int]:
    """The physical batches a prompt of ``tokens`` runs in: full ubatches, then the remainder."""
    ub = max(1, min(ubatch, tokens))
    full, rest = divmod(max(tokens, 1), ub)
    return [ub] * full + ([rest] if rest else [])


def mmq_tile_columns(batch: int, max_columns: int) -> int:
    """The tile width llama.cpp's MMQ picks for a batch of ``batch`` tokens: the smallest
    multiple of 8 up to ``max_columns`` that needs the fewest tiles (``launch_mul_mat_q``'s
    search, against the whole batch on NVIDIA)."""
    best_j, best_tiles = 8, math.inf
    for j in range(8, max_columns + 1, 8):
        tiles = -(-batch // j)
        if tiles < best_tiles:
            best_j, best_tiles = j, tiles
    return best_j


@functools.lru_cache(maxsize=4096)
def _expected_tiles(batch: int, p: float, j: int) -> float:
    """E[ceil(n / j)] for n ~ Binomial(batch, p): the tiles one expert's tokens fill."""
    mean = batch * p
    sd = math.sqrt(max(batch * p * (1 - p), 1e-12))
    hi = min(batch, int(mean + 12 * sd) + j)
    total = 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    for n in range(1, hi + 1):
        log_pmf = (
            math.lgamma(batch + 1) - math.lgamma(n + 1) - math.lgamma(batch - n + 1) + n * log_p + (batch - n) * log_q
        )
        total += math.exp(log_pmf) * (-(-n // j))
    return total


def expert_tile_factor(model: ModelSpec, batch: int, max_columns: int) -> float:
    """Work the GPU does on a ubatch's experts over the useful work: J columns per tile filled,
    on average, with ``batch * k / E`` tokens (uniform routing; 1.0 for a dense model, a batch
    of one token or an engine without tiles, ``max_columns`` 0)."""
    if not model.is_moe or max_columns <= 0 or batch <= 1:
        return 1.0
    p = model.n_experts_used / model.n_experts
    j = mmq_tile_columns(batch, max_columns)
    return j * _expected_tiles(batch, p, j) / (batch * p)
