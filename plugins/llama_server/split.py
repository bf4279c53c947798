"""llama-server across several devices: its split dimensions, their rules, its command line and
each device's share of the memory (issue 40).

The dimensions (``[space]`` keys, searched when the study names more than one card):

* ``split_mode`` (``-sm``): ``none`` (one device, ``-mg``), ``layer`` (whole layers and their
  KV cache per device, in ``-ts`` proportions), ``row`` (each matrix split by rows; CUDA's split
  buffers only), ``tensor`` (weights and KV split for tensor parallelism, EXPERIMENTAL);
* ``tensor_split`` (``-ts``): proportions per device, written as llama.cpp takes them ("3,1");
* ``main_gpu`` (``-mg``): the device of ``split_mode = none``, and of row split's KV cache and
  intermediate results.

The rules, from the llama.cpp this package builds (vendor/llama.cpp of llama-cpp-python
0.3.36, 0c1e57098):

* ``row`` needs a device with split buffers (make_gpu_buft_list: "device X does not support
  split buffers" otherwise): CUDA's; an RPC device has none;
* ``tensor`` needs flash attention (llama_init_from_model: "SPLIT_MODE_TENSOR requires
  flash_attn to be enabled"), and an architecture outside llm_arch_supports_sm_tensor's list
  (:data:`NO_TENSOR_ARCHS`); ``--fit`` is not implemented for it (common/fit.cpp);
* ``-ts`` with more entries than devices, or ``-mg`` past the last device, fail at load.

Where layers go (``layer`` split), as load_tensors computes it: the split points are the
running sums of ``-ts`` normalised to 1; of the ``act = min(ngl, n_layer + 1)`` offloaded
layers counted from ``i_gpu_start = n_layer + 1 - ngl``, layer ``il`` goes to the first device
whose split point is above ``(il - i_gpu_start) / act``, in float32; the output layer is layer
``n_layer``; the token embeddings stay on the host. Each layer's KV cache is on its layer's
device (offload_kqv). :func:`layer_devices` is that formula, and :func:`estimate` each
device's weights, KV cache and compute buffer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np

from autotune.api import MemoryEstimate, ModelSpec, Param, StudyContext, TrialConfig
from autotune.api import WeightsBreakdown
from autotune._builtin import kv_cache_bytes
from autotune._builtin import cuda_visible as placement_cuda_visible
from autotune._builtin import resolve_cache_type as resolve
from autotune_plugins.llama_server import devices, memory
from autotune_plugins.llama_server.declarations import CACHE_TYPES

__all__ = [
    "MODES",
    "NO_TENSOR_ARCHS",
    "check",
    "device_estimate",
    "estimate",
    "flags",
    "layer_devices",
    "n_devices",
    "parameters",
    "parse_ts",
    "rpc_device_count",
    "ts_candidates",
]

MiB = 2**20
MODES = ("none", "layer", "row", "tensor")
KEYS = ("split_mode", "tensor_split", "main_gpu", "devices")
# llm_arch_supports_sm_tensor (src/llama-arch.cpp) returns false for these, by llama.cpp's
# GGUF architecture names; every other architecture may use -sm tensor.
NO_TENSOR_ARCHS = frozenset(
    {
        "grok",
        "mpt",
        "plamo2",
        "minicpm3",
        "gemma3n",
        "mamba",
        "mamba2",
        "jamba",
        "falcon-h1",
        "olmo2",
        "olmoe",
        "deepseek2",
        "deepseek32",
        "hunyuan-v4",
        "dots3note",
        "glm-dsa",
        "bitnet",
        "t5",
        "nemotron_h",
        "nemotron_h_moe",
        "granitehybrid",
        "minimax01",
        "minimax-m2",
        "minimax-m3",
        "mistral4",
        "kimi-linear",
        "bailingmoe3",
        "kimi-k3",
        "glm5-next",
        "qwen3tts",
        "qwen4exp",
    }
)


# The rules :func:`check` applies, for ``autotune plugins``.
RULES = (
    "split_mode row: CUDA cards only (split buffers; an RPC or CPU device refuses it)",
    "split_mode tensor: needs flash_attn on, and an architecture llama.cpp implements it for; --fit does not apply",
    "tensor_split: at most one proportion per device; ignored (measured once, even) with split_mode none",
    "main_gpu: one of the study's devices",
    "devices: a subset of the study's devices by ggml's names (CUDA0, RPC1, ...), each once; -ts and -mg index it",
)


def n_devices(ctx: StudyContext) -> int:
    """The devices llama-server is given: the study's cards (one without ``[hardware] gpus``)."""
    p = getattr(ctx, "placement", None)
    return len(p.cards) if p is not None else 1


def rpc_device_count(ctx: StudyContext) -> int:
    """How many rpc-server processes stand for the study's devices: one per ``"cpu"`` card when
    the study names several (a CPU-only machine's devices are llama.cpp's RPC backend's)."""
    p = getattr(ctx, "placement", None)
    return len(p.cards) if p is not None and p.on_cpu and len(p.cards) > 1 else 0


def parse_ts(text: Any, n: int | None = None) -> tuple[float, ...] | None:
    """``-ts`` as llama.cpp reads it (numbers split by ``,`` or ``/``); None when it is not one."""
    if not isinstance(text, str):
        return None
    try:
        values = tuple(float(v) for v in text.replace("/", ",").split(",") if v.strip())
    except ValueError:
        return None
    if not values or any(v < 0 for v in values) or not sum(values) or (n is not None and len(values) > n):
        return None
    return values


def ts_candidates(budgets: Sequence[int]) -> list[str]:
    """A few ``-ts`` values from the cards' budgets: even, in proportion to each budget, and that
    proportion shifted a tenth toward the first card and away from it (the main card holds the
    output layer; the search decides). Small integers, as a person would write them."""
    n = len(budgets)
    if n < 2:
        return []
    total = sum(budgets)
    share = [b / total for b in budgets]
    out = [",".join("1" for _ in budgets), _ratio(share)]
    for shift in (0.1, -0.1):
        moved = [max(0.05, s + (shift if i == 0 else -shift / (n - 1))) for i, s in enumerate(share)]
        out.append(_ratio(moved))
    return list(dict.fromkeys(out))


def _ratio(share: Sequence[float]) -> str:
    """Proportions as the smallest integers (out of 20) that keep them within 5 points."""
    for denominator in range(1, 21):
        ints = [round(s * denominator) for s in share]
        if all(ints) and all(abs(i / sum(ints) - s) <= 0.05 for i, s in zip(ints, share)):
            return ",".join(str(i) for i in ints)
    return ",".join(str(max(1, round(s * 20))) for s in share)


def parameters(space: Mapping[str, Sequence[Any]]) -> list[Param]:
    """The split dimensions the study names, exactly as given (values llama.cpp refuses are left
    for the core to report with ``accepted``)."""
    params = []
    if "split_mode" in space:
        params.append(
            Param(
                "split_mode",
                tuple(v for v in space["split_mode"] if v in MODES),
                "how the model is split across the devices (-sm): none (one device, -mg), layer (whole "
                "layers per device, -ts), row (matrices by rows; CUDA), tensor (tensor parallel; needs "
                "flash_attn)",
                accepted=MODES,
            )
        )
    if "tensor_split" in space:
        params.append(
            Param(
                "tensor_split",
                tuple(v for v in space["tensor_split"] if parse_ts(v)),
                'proportions per device (-ts), e.g. "3,1"; one entry per device at most',
                accepted=('proportions such as "1,1" or "3,1"',),
            )
        )
    if "main_gpu" in space:
        params.append(
            Param(
                "main_gpu",
                tuple(v for v in space["main_gpu"] if type(v) is int and v >= 0),
                "the device of split_mode none, and of row split's KV cache (-mg)",
                accepted=("a device number from 0",),
            )
        )
    return params + devices.parameters(space)


def check(config: TrialConfig, ctx: StudyContext, model: ModelSpec, cuda: bool) -> list[str]:
    """The split's rules (see the module's docstring): what llama-server would refuse at load."""
    mode = config.option("split_mode")
    out = [why] if (why := devices.problem(config, ctx)) else []
    n = devices.count(config, ctx) if n_devices(ctx) > 1 else 1
    if mode is not None and n < 2 and mode != "none":
        out.append(f"split_mode {mode}: one device to split over (the study's [hardware] gpus, or devices, names one)")
    if mode == "row" and not cuda:
        out.append(
            "split_mode row: these devices have no split buffers (llama.cpp: CUDA's only; an RPC or CPU "
            "device refuses it)"
        )
    if mode == "tensor":
        if not config.option("flash_attn", True):
            out.append("split_mode tensor needs flash_attn on (llama.cpp: SPLIT_MODE_TENSOR requires flash_attn)")
        arch = (getattr(model, "architecture", None) or "").lower()
        if arch in NO_TENSOR_ARCHS:
            out.append(f"split_mode tensor: llama.cpp does not implement it for architecture '{arch}'")
    ts = config.option("tensor_split")
    if ts is not None and parse_ts(ts, n) is None:
        out.append(
            f'tensor_split {ts!r}: give at most {n} non-negative proportions, not all 0, e.g. "{",".join("1" * n)}"'
        )
    if mode == "none" and ts is not None and len(set(parse_ts(ts) or (0.0, 1.0))) > 1:
        # -ts does nothing to one device: the search measures split mode none once, with the even split.
        out.append(
            f"tensor_split {ts!r} does nothing with split_mode none (one device, -mg): the even split stands for it"
        )
    mg = config.option("main_gpu")
    if mg is not None and int(mg) >= n:
        out.append(f"main_gpu {mg}: the study has devices 0..{n - 1}")
    return out


def flags(config: TrialConfig) -> list[str]:
    """``-sm``/``-ts``/``-mg`` of a configuration, only those it names (so a one-card study's
    command line is as it was)."""
    out = devices.flags(config)
    if config.option("split_mode") is not None:
        out += ["-sm", str(config.option("split_mode"))]
    if config.option("tensor_split") is not None and config.option("split_mode", "layer") != "none":
        out += ["-ts", str(config.option("tensor_split"))]
    if config.option("main_gpu") is not None:
        out += ["-mg", str(int(config.option("main_gpu")))]
    return out


def layer_devices(n_layers: int, gpu_layers: int | None, ts: Sequence[float]) -> list[int | None]:
    """The device of each layer, the output layer last (``n_layers + 1`` entries); None: the host.

    llama.cpp's load_tensors, in its float32 arithmetic (a layer on a split point goes to the
    next device, and float32 decides which layers are on one).
    """
    n_dev = len(ts)
    sums = np.cumsum(np.asarray(ts, dtype=np.float32), dtype=np.float32)
    points = sums / np.float32(sums[-1])
    ngl = n_layers + 1 if gpu_layers is None else max(0, int(gpu_layers))
    start = max(n_layers + 1 - ngl, 0)
    act = min(ngl, n_layers + 1)
    out: list[int | None] = []
    for il in range(n_layers + 1):
        if il < start or il - start >= act:
            out.append(None)
            continue
        x = np.float32(il - start) / np.float32(act)
        out.append(min(int(np.searchsorted(points[:n_dev], x, side="right")), n_dev - 1))
    return out


def estimate(
    base: MemoryEstimate,
    model: ModelSpec,
    weights: WeightsBreakdown,
    config: TrialConfig,
    n: int,
    gpu_layers: int | None,
    kv_bytes_all: int,
    buffers: int,
    overhead: int,
    pipeline_bytes: int = 0,
) -> MemoryEstimate:
    """``base`` (one device's estimate of the same configuration) with each device's share.

    Args:
        base: The one-device estimate (:func:`memory.estimate`): its host part and notes stay.
        kv_bytes_all: The KV cache of every layer, wherever it is.
        buffers: One device's compute buffer for this configuration.
        overhead: Each device's fixed cost (a CUDA context; 0 for an RPC device).
        pipeline_bytes: What pipeline parallelism adds to the compute buffer of each device
            that holds layers (:func:`pipeline_copies_bytes`; 0 when it is off).
    """
    mode = config.option("split_mode", "layer")
    main = int(config.option("main_gpu", 0) or 0)
    ts = parse_ts(config.option("tensor_split"), n) or (1.0,) * n  # no -ts: llama.cpp splits by free memory
    ts = tuple(ts) + (0.0,) * (n - len(ts))
    n_layers = len(weights.per_layer_bytes) or model.n_layers
    head = weights.output_bytes + weights.other_bytes + (weights.embedding_bytes if weights.head_is_embedding else 0)
    per_dev = [0] * n
    kv_dev = [0] * n
    if mode == "none" or n < 2:
        devices = layer_devices(n_layers, gpu_layers, (1.0,))
        for il, d in enumerate(devices):
            if d is not None:
                per_dev[main] += head if il == n_layers else weights.per_layer_bytes[il]
                kv_dev[main] += kv_bytes_all // n_layers if il < n_layers else 0
        used = [main]
    elif mode == "layer":
        devices = layer_devices(n_layers, gpu_layers, ts)
        for il, d in enumerate(devices):
            if d is None:
                continue
            if il == n_layers:
                per_dev[d] += head
            else:
                per_dev[d] += weights.per_layer_bytes[il]
                kv_dev[d] += kv_bytes_all // n_layers
        # A device that holds only the output layer computes one matrix product of the last
        # rows: its logged compute buffer was 0.00-0.01 MiB (stories260K, -ts 3,1 and 2,1,1).
        used = sorted({d for d in devices[:-1] if d is not None})
        buffers_of = {d: buffers + pipeline_bytes for d in used}
    else:
        # row / tensor: every layer's matrices split in -ts proportions (an approximation: the
        # norms and biases, a few KiB a layer, are not split); row keeps the KV cache on the
        # main device, tensor splits it by heads like the weights.
        total = sum(ts)
        for d in range(n):
            per_dev[d] = int((weights.total_bytes - weights.embedding_bytes) * ts[d] / total)
            if mode == "tensor":
                kv_dev[d] = int(kv_bytes_all * ts[d] / total)
        if mode == "row":
            kv_dev[main] = kv_bytes_all
        used = [d for d in range(n) if ts[d] > 0] or [main]
    if mode != "layer" or n < 2:
        buffers_of = {d: buffers for d in used}
    holding = {d for d in range(n) if per_dev[d] or kv_dev[d]} | set(used)
    shares = tuple(per_dev[d] + kv_dev[d] + buffers_of.get(d, 0) + (overhead if d in holding else 0) for d in range(n))
    note = f"-sm {mode}" + (f" -ts {config.option('tensor_split')}" if mode != "none" else f" -mg {main}")
    notes = (*base.notes, f"{note}: per device " + ", ".join(f"{d}: {b / MiB:.0f} MiB" for d, b in enumerate(shares)))
    return replace(
        base,
        weights_bytes=sum(per_dev),
        kv_bytes=sum(kv_dev),
        buffers_bytes=sum(buffers_of.values()),
        overhead_bytes=overhead * len(holding),
        per_device_bytes=shares,
        notes=notes,
    )


# ggml's scheduler keeps this many copies of each split's inputs when llama.cpp turns pipeline
# parallelism on (GGML_SCHED_MAX_COPIES, 4 by default; the log's "sched copies = 4").
PIPELINE_COPIES = 4
# Bytes per token of a split's inputs besides the residual and the mask (positions, output-row
# ids): fitted on stories260K's logged compute buffers, layer split against none on the same
# configuration, 5 configurations (ubatch 64-512, ctx 256-1024, fused and unfused attention).
PIPELINE_TOKEN_BYTES = 112


def pipeline_copies_bytes(model: ModelSpec, cells_per_sequence: int, ubatch: int, flash_attn: bool) -> int:
    """What pipeline parallelism adds to a layer-holding device's compute buffer: the extra
    copies of its inputs (the micro-batch's residual, the mask and the token inputs).

    llama.cpp turns it on for a layer split over several devices with every layer offloaded,
    the KV cache offloaded and no tensor overrides (llama_context's constructor), on devices
    that support events (CUDA's and RPC's do). Logged on two RPC devices: +0.16 MiB at ubatch
    64 to +3.44 MiB at ubatch 256 unfused over 1024 cells; this formula gives each within 0.2 MiB.
    """
    mask = (
        cells_per_sequence
        * ubatch
        * (memory.CPU_BUFFERS.mask_bytes_fused if flash_attn else memory.CPU_BUFFERS.mask_bytes)
    )
    return (PIPELINE_COPIES - 1) * (mask + ubatch * (model.hidden_size * 4 + PIPELINE_TOKEN_BYTES))


def device_estimate(
    model: ModelSpec,
    weights: WeightsBreakdown,
    config: TrialConfig,
    ctx: StudyContext,
    gpu_layers: int | None,
    cuda: bool,
) -> MemoryEstimate:
    """Each device's memory for ``config`` on the study's devices (CUDA cards, or RPC devices on
    the CPU): the one-device model for what stays on the host, :func:`estimate` for the rest.

    An RPC device is a CPU backend in another process: its compute buffer follows the CPU's
    coefficients and it has no CUDA context.
    """
    ub_opt, b_opt = config.option("ubatch"), config.option("batch")
    cache = config.option("cache_type", "f16")
    fa = bool(config.option("flash_attn", True))
    base = memory.estimate(
        model,
        weights,
        config.ctx,
        config.parallel,
        cache,
        fa,
        ubatch=int(ub_opt) if ub_opt is not None else None,
        gpu=True,
        gpu_layers=gpu_layers,
        n_cpu_moe=int(config.option("n_cpu_moe", 0) or 0),
        batch=int(b_opt) if b_opt is not None else None,
    )
    kv_all, _, _ = kv_cache_bytes(
        model, resolve(cache, CACHE_TYPES) or cache, config.ctx, config.parallel, memory.LAYOUT
    )
    ub = min(int(ub_opt or memory.DEFAULT_UBATCH), int(b_opt or memory.DEFAULT_BATCH), config.ctx * config.parallel)
    cells = memory.LAYOUT.cells_per_sequence(config.ctx)
    if cuda:
        buffers, overhead = base.buffers_bytes, memory.CUDA_CONTEXT_BYTES
    else:
        buffers, overhead = memory.CPU_BUFFERS.bytes(model, cells, ub, fa), 0
    n = devices.count(config, ctx) if n_devices(ctx) > 1 else 1
    n_layers = len(weights.per_layer_bytes) or model.n_layers
    pipelined = (
        config.option("split_mode", "layer") == "layer"
        and n > 1
        and not config.option("n_cpu_moe")
        and (gpu_layers is None or gpu_layers > n_layers)
    )
    mem = estimate(
        base,
        model,
        weights,
        config,
        n,
        gpu_layers,
        kv_all,
        buffers,
        overhead,
        pipeline_copies_bytes(model, cells, ub, fa) if pipelined else 0,
    )
    return devices.spread(mem, config, ctx)


def cuda_visible(ctx: StudyContext) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for a study on several cards (autotune.hardware.placement.cuda_visible);
    None: one card, or RPC devices."""
    p = getattr(ctx, "placement", None)
    if p is None or p.on_cpu:
        return None
    return placement_cuda_visible(p, ctx.gpu_index)


def space(ctx: StudyContext, cuda: bool) -> dict[str, list[Any]]:
    """What a study on several devices searches when its ``[space]`` does not say: the split
    modes these devices take (row on CUDA cards only: an RPC device has no split buffers;
    tensor runs on RPC devices too, through llama.cpp's meta device, which logs its buffers as
    "Meta()" for the devices together) and a few ``-ts`` values from the cards' budgets
    (:func:`ts_candidates`)."""
    p = getattr(ctx, "placement", None)
    if p is None or len(p.cards) < 2:
        return {}
    return {
        "split_mode": ["layer", "none", "tensor", *(("row",) if cuda else ())],
        "tensor_split": ts_candidates(p.budgets),
    }
