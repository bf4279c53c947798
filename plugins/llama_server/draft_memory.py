"""The draft model's memory in llama-server: its weights, its KV cache and its compute buffer,
added to the target's (:func:`.memory.estimate`) for the judge.

What llama.cpp allocates for a draft (``common/speculative.cpp``
``common_base_params_to_speculative``): a second model load (-md, placed by -ngld) and a second
context that copies the target's parameters, so the same ``-c``/``-np`` slots (one stream of
pad256(ctx) cells per slot), the same ``-b``/``-ub`` and flash attention, with the cache types
-ctkd/-ctvd. The draft is therefore the target's own memory model run on the draft's shape,
its file and its cache type; the process's CUDA context is shared, not counted twice.

Checked against the engine's own start-up log (-lv 4), which prints the draft's buffers after
``loading draft model``: ``bench/draft_memory_check.py`` and ``tests/plugins/test_speculation.py``.
draft-mtp runs the target's nextn layers in a context of their own on the target's weights; that
context is not modelled (no MTP model in the CPU tests to calibrate it on): the note says so.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autotune.api import MemoryEstimate, StudyContext, TrialConfig
from autotune._builtin import weights_for
from autotune_plugins.llama_server import memory, speculation
from autotune_plugins.llama_server.formats import gguf_file_weights
from autotune_plugins.llama_server.server import parse_log

__all__ = ["DRAFT_LOG_MARK", "draft_estimate", "split_log", "with_draft"]

# server-context.cpp load_model -> common_speculative_init_result logs this before the draft's load.
DRAFT_LOG_MARK = "loading draft model"
MiB = 2**20


def draft_estimate(backend: Any, config: TrialConfig, ctx: StudyContext, on_gpu: bool) -> MemoryEstimate | None:
    """The draft's own memory (its CUDA context left out), or None when nothing is drafted by a model."""
    name = config.option("draft")
    if not isinstance(name, str) or config.option("spec_type", "none") not in speculation.DRAFT_MODEL_TYPES:
        return None
    path = backend._made(name, ctx)
    if path is None:  # a format not made yet: its tensors as they will be written, from the source's shape
        model, weights = ctx.model, weights_for(ctx.model, name, backend.weight_formats)
    else:
        model, weights = backend._model_for(name, ctx), gguf_file_weights(path)
    layers = config.option("draft_gpu_layers")
    ub, b = config.option("ubatch"), config.option("batch")
    est = memory.estimate(
        model,
        weights,
        config.ctx,
        config.parallel,
        config.option("draft_cache_type", "f16"),
        bool(config.option("flash_attn", True)),
        ubatch=int(ub) if ub is not None else None,
        gpu=on_gpu,
        gpu_layers=layers if isinstance(layers, int) else None,
        batch=int(b) if b is not None else None,
    )
    return replace(est, overhead_bytes=0)


def with_draft(
    target: MemoryEstimate, backend: Any, config: TrialConfig, ctx: StudyContext, on_gpu: bool
) -> MemoryEstimate:
    """``target`` with the draft's weights, KV cache and compute buffer added where they go."""
    if config.option("spec_type") == "draft-mtp":
        return replace(
            target,
            notes=(
                *target.notes,
                "draft-mtp: the MTP context (the target's nextn layers, their KV cache) is not modelled",
            ),
        )
    draft = draft_estimate(backend, config, ctx, on_gpu)
    if draft is None:
        return target
    note = (
        f"draft {config.option('draft')}: {draft.weights_bytes / MiB:.1f} MiB weights, {draft.kv_bytes / MiB:.2f} "
        f"MiB KV ({config.option('draft_cache_type', 'f16')}, the target's {config.parallel} slots), "
        f"{draft.buffers_bytes / MiB:.2f} MiB compute buffer"
    )
    return replace(
        target,
        weights_bytes=target.weights_bytes + draft.weights_bytes,
        kv_bytes=target.kv_bytes + draft.kv_bytes,
        buffers_bytes=target.buffers_bytes + draft.buffers_bytes,
        host_bytes=target.host_bytes + draft.host_bytes,
        host_buffers_bytes=target.host_buffers_bytes + draft.host_buffers_bytes,
        notes=(*target.notes, note),
    )


def split_log(text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The target's and the draft's start-up buffers (:func:`.server.parse_log` of each part of
    a ``-lv 4`` log, cut where the draft's load begins); the draft's is empty without one."""
    at = text.find(DRAFT_LOG_MARK)
    if at < 0:
        return parse_log(text), {}
    return parse_log(text[:at]), parse_log(text[at:])
