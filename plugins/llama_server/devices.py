"""Which of the study's devices llama-server offloads to: ``devices`` (``-dev``).

``-dev CUDA0,CUDA1`` names the devices by ggml's names (``--list-devices``): CUDA device N of
the server's ``CUDA_VISIBLE_DEVICES`` is ``CUDA<N>``; an RPC device is ``RPC<N>`` in the order
the ``--rpc`` endpoints register (ggml-rpc.cpp ``ggml_backend_rpc_add_server``: ``dev_name =
"RPC" + dev_id``, one global counter). Absent, llama.cpp offloads to every device; ``-ts`` and
``-mg`` then index the devices ``-dev`` lists, in its order (common/arg.cpp builds
``params.devices`` from the list, llama_model_load_from_file uses it as the model's devices).
``-dev none`` (no offload) is ``gpu_layers = 0``'s business, not accepted here.

Experts per card: this build (llama-cpp-python 0.3.36's llama.cpp) has no per-device expert
flag; ``--n-cpu-moe`` keeps the first N layers' experts on the host and ``-ot PATTERN=BUFT``
names a buffer type per tensor, which is not searched (issue 49 leaves it open).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from autotune.api import MemoryEstimate, Param, StudyContext, TrialConfig

__all__ = ["count", "engine_names", "flags", "parameters", "problem", "selected", "spread"]

KEY = "devices"


def engine_names(ctx: StudyContext) -> tuple[str, ...]:
    """ggml's name of each of the study's devices, in device order (RPC on a CPU study)."""
    p = getattr(ctx, "placement", None)
    if p is None:
        return ()
    prefix = "RPC" if p.on_cpu else "CUDA"
    return tuple(f"{prefix}{i}" for i in range(len(p.cards)))


def _names(value: Any) -> tuple[str, ...] | None:
    if not isinstance(value, str) or not value.strip():
        return None
    return tuple(v.strip() for v in value.split(","))


def parameters(space: Mapping[str, Sequence[Any]]) -> list[Param]:
    if KEY not in space:
        return []
    return [
        Param(
            KEY,
            tuple(v for v in space[KEY] if _names(v)),
            'the devices llama-server offloads to (-dev), e.g. "CUDA0,CUDA1" or "RPC1"; absent: all',
            accepted=('device names such as "CUDA0,CUDA1"',),
        )
    ]


def problem(config: TrialConfig, ctx: StudyContext) -> str | None:
    """Why ``devices`` names what the study does not have (None: it names a subset)."""
    value = config.option(KEY)
    if value is None:
        return None
    known = engine_names(ctx)
    names = _names(value)
    if not known:
        return f"devices {value!r}: the study has one device ([hardware] gpus names several)"
    if names is None or any(n not in known for n in names) or len(set(names)) != len(names):
        return f"devices {value!r}: name each of the study's devices once at most, from {', '.join(known)}"
    return None


def selected(config: TrialConfig, ctx: StudyContext) -> tuple[int, ...]:
    """The study's device numbers llama-server uses, in ``-dev`` order (all without ``devices``)."""
    known = engine_names(ctx)
    names = _names(config.option(KEY))
    if names is None or problem(config, ctx):
        return tuple(range(len(known) or 1))
    return tuple(known.index(n) for n in names)


def count(config: TrialConfig, ctx: StudyContext) -> int:
    """How many devices ``-ts`` and ``-mg`` index."""
    return len(selected(config, ctx))


def spread(mem: MemoryEstimate, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
    """``mem``'s per-device bytes (in ``-dev`` order) put back in the study's device order, 0 on
    the devices left out (they hold nothing, not even a context)."""
    chosen = selected(config, ctx)
    n = len(engine_names(ctx))
    if not mem.per_device_bytes or tuple(chosen) == tuple(range(n)):
        return mem
    out = [0] * n
    for j, d in enumerate(chosen):
        out[d] = mem.per_device_bytes[j]
    from dataclasses import replace

    return replace(
        mem,
        per_device_bytes=tuple(out),
        notes=(*mem.notes, f"-dev {config.option(KEY)}: devices {', '.join(map(str, chosen))} of {n}"),
    )


def flags(config: TrialConfig) -> list[str]:
    value = config.option(KEY)
    return [] if value is None else ["-dev", str(value)]
