"""The drafter's memory in exllamav3: the draft model's weights and its cache, or the MTP head's
cache (its weights are the target's own files).

What TabbyAPI builds (backends/exllamav3/model.py): ``create_cache(draft_cache_mode,
draft_model)`` with the target's ``cache_size``, because the generator asserts "Cache and draft
cache must be same size"; so the draft cache holds the same tokens as the target's, at the
draft's K/V width and layer count (:func:`.memory.cache_bytes` on the draft's shape). The
draft's forward passes run between the target's, so its transients are counted as the larger
of the two working sets, not their sum. An n-gram drafter holds only host-side tables.
"""

from __future__ import annotations

from dataclasses import replace
from autotune.api import MemoryEstimate, ModelSpec

from autotune_plugins.exllamav3 import memory
from autotune_plugins.exllamav3.generator_settings import GeneratorSettings

__all__ = ["with_draft"]

MiB = 2**20


def with_draft(
    target: MemoryEstimate,
    model: ModelSpec,
    settings: GeneratorSettings,
    draft: tuple[str, ModelSpec, memory.Exl3Weights] | None,
    mtp_layers: int | None,
) -> MemoryEstimate:
    """``target`` with the drafter's weights, cache and transients added.

    Args:
        draft: The draft weights' name, architecture and bytes (spec_type draft; a format not
            made yet predicted from the source's shape, as the target's is).
        mtp_layers: The MTP head's layers (spec_type mtp), from the target's config.json.
    """
    bits = settings.draft_kv_bits
    k, v = (None, None) if bits is None else bits
    if settings.spec_type == "mtp":
        # Model.from_config(component="mtp"): the head's layers at the target's K/V width; its
        # weights are counted with the target's directory (every tensor in its safetensors).
        head = replace(model, n_layers=max(1, mtp_layers or 1))
        cache = memory.cache_bytes(head, k, v, settings.cache_tokens)
        return replace(
            target,
            kv_bytes=target.kv_bytes + cache,
            notes=(
                *target.notes,
                (
                    f"mtp head: {head.n_layers} layer(s), cache {settings.draft_cache_type} {cache / MiB:.1f} MiB; its "
                    "weights are in the target's files, counted there"
                ),
            ),
        )
    if settings.spec_type != "draft" or draft is None:
        return target
    name, shape, w = draft
    cache = memory.cache_bytes(shape, k, v, settings.cache_tokens)
    attn, mlp, logits = memory.transient_bytes(shape, settings)
    buffers = max(target.buffers_bytes, max(attn, mlp) + logits)
    return replace(
        target,
        weights_bytes=target.weights_bytes + w.gpu_bytes,
        kv_bytes=target.kv_bytes + cache,
        buffers_bytes=buffers,
        host_bytes=target.host_bytes + w.host_bytes,
        notes=(
            *target.notes,
            (
                f"draft {name}: {w.gpu_bytes / MiB:.1f} MiB weights ({w.host_bytes / MiB:.1f} MiB "
                f"embedding in host memory), cache {settings.draft_cache_type} of {settings.cache_tokens} "
                f"tokens {cache / MiB:.1f} MiB (the target's size, asserted by the generator)"
            ),
        ),
    )
