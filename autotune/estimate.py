"""``autotune estimate``: memory breakdown and predicted speed of one configuration, no launch.

The memory comes from the named backend's own estimate; the speed from a model backend of
the same engine (the digital twin) for the card and model given. ``ctx`` is per sequence.
"""

from __future__ import annotations

from typing import Any

from autotune import plugins
from autotune.backend import BaseBackend, StudyContext, TrialConfig, Workload
from autotune.errors import ConfigError, UnknownNameError
from autotune.hardware import GpuSpec, detect_gpus, get_gpu, nvml_unavailable_reason, spec_for_detected
from autotune.measure import Protocol
from autotune.models import resolve_model


def _gpu(key: str) -> GpuSpec:
    if key != "auto":
        return get_gpu(key)
    found = detect_gpus()
    if not found:
        raise ConfigError(f"--gpu auto: no GPU detected ({nvml_unavailable_reason() or 'none found'}); "
                          "name one with --gpu, e.g. --gpu v100-16gb")
    d = found[0]
    return d.spec if d.spec is not None else spec_for_detected(d)


def _backends(name: str) -> tuple[BaseBackend, BaseBackend | None]:
    """The backend named (or the first of that engine) and a predictor of the same engine."""
    backends = plugins.get_backends()
    chosen = backends.get(name)
    if chosen is None:
        same = [b for b in backends.values() if b.engine == name]
        if not same:
            engines = sorted({b.engine for b in backends.values()})
            raise UnknownNameError(
                f"--backend {name!r}: not an installed backend or engine "
                f"(backends: {', '.join(backends) or 'none'}; engines: {', '.join(engines) or 'none'})"
            )
        chosen = same[0]
    predictor = None
    for candidate in [chosen, *backends.values()]:
        if candidate.engine == chosen.engine and type(candidate).predict is not BaseBackend.predict:
            predictor = candidate
            break
    return chosen, predictor


def estimate_config(gpu_key: str, model_ref: str, backend_name: str, weights: str, ctx_tokens: int,
                    cache_type: str | None, flash_attn: bool, parallel: int, prompt_tokens: int = 1500,
                    output_tokens: int = 800) -> dict[str, Any]:
    """Memory and predicted speed of one configuration.

    Returns:
        ``{"config", "gpu", "model", "vram": {weights_bytes, kv_bytes, buffers_bytes,
        overhead_bytes, total_bytes, budget_bytes, fits, host_bytes}, "predicted":
        {decode_tok_s, prefill_tok_s, aggregate_tok_s, per_user_tok_s, roofline_tok_s} | None,
        "invalid": [reasons], "predictor": name | None}``.
    """
    gpu = _gpu(gpu_key)
    model = resolve_model(model_ref)
    backend, predictor = _backends(backend_name)
    options = {"flash_attn": flash_attn}
    params = {p.name: p for p in backend.parameters({})}
    if cache_type is not None:
        known = params.get("cache_type")
        if known is not None and cache_type not in backend.parameters({"cache_type": (cache_type,)})[0].choices:
            raise ConfigError(f"--cache {cache_type!r}: {backend.name} takes {', '.join(known.choices)}")
        options["cache_type"] = cache_type
    elif "cache_type" in params:
        options["cache_type"] = params["cache_type"].choices[0]
    ctx = StudyContext(gpu=gpu, model=model, workload=Workload(prompt_tokens, output_tokens),
                       vram_budget_bytes=gpu.vram_bytes, protocol=Protocol())
    problem = backend.check_weights(weights, ctx)
    if problem:
        raise ConfigError(f"--weights {weights!r}: {problem}")
    config = TrialConfig(backend.name, weights, ctx_tokens, parallel, tuple(sorted(options.items())))
    invalid = backend.check(config, ctx)
    if ctx_tokens < prompt_tokens + output_tokens:
        invalid.append(f"ctx {ctx_tokens} cannot hold {prompt_tokens} prompt + {output_tokens} output tokens")
    mem = backend.estimate_memory(config, ctx)
    predicted = None
    refused = None
    if predictor is not None:
        probe = TrialConfig(predictor.name, weights, ctx_tokens, parallel, config.options)
        try:
            predictor.refuse(probe, ctx)  # type: ignore[attr-defined]
        except AttributeError:
            pass
        except Exception as exc:  # the engine's own refusal, e.g. FlashAttention 2 on Volta
            refused = str(exc)
        if refused is None:
            predicted = predictor.predict(probe, ctx)
    return {
        "config": config.as_dict(),
        "gpu": gpu.key,
        "model": model.key,
        "vram": {
            "weights_bytes": mem.weights_bytes,
            "kv_bytes": mem.kv_bytes,
            "buffers_bytes": mem.buffers_bytes,
            "overhead_bytes": mem.overhead_bytes,
            "host_bytes": mem.host_bytes,
            "total_bytes": mem.total_bytes,
            "budget_bytes": gpu.vram_bytes,
            "fits": mem.total_bytes <= gpu.vram_bytes,
            "notes": list(mem.notes),
        },
        "predicted": dict(predicted) if predicted else None,
        "refused": refused,
        "invalid": invalid,
        "predictor": predictor.name if predictor else None,
    }


def estimate_text(r: dict[str, Any]) -> str:
    gib = 2**30
    v = r["vram"]
    c = r["config"]
    lines = [
        f"{c['backend']} {c['weights']} ctx {c['ctx']} x {c['parallel']} "
        + " ".join(f"{k}={val}" for k, val in c.items() if k not in ("backend", "weights", "ctx", "parallel"))
        + f" on {r['gpu']}, model {r['model']}",
        f"  VRAM: weights {v['weights_bytes'] / gib:.2f} + KV {v['kv_bytes'] / gib:.2f} + buffers "
        f"{v['buffers_bytes'] / gib:.2f} + overhead {v['overhead_bytes'] / gib:.2f} = {v['total_bytes'] / gib:.2f} GiB "
        f"of {v['budget_bytes'] / gib:.2f} GiB: {'fits' if v['fits'] else 'DOES NOT FIT'}",
    ]
    if v["host_bytes"]:
        lines.append(f"  host memory: {v['host_bytes'] / gib:.2f} GiB")
    for reason in r["invalid"]:
        lines.append(f"  invalid: {reason}")
    if r.get("refused"):
        lines.append(f"  the engine refuses it: {r['refused']}")
    p = r["predicted"]
    if p:
        lines.append(
            f"  predicted ({r['predictor']}): decode {p['decode_tok_s']:.1f} tok/s, prefill {p['prefill_tok_s']:.0f} tok/s, "
            f"aggregate {p['aggregate_tok_s']:.1f} tok/s, per user {p['per_user_tok_s']:.1f} tok/s; "
            f"roofline {p['roofline_tok_s']:.1f} tok/s"
        )
    elif not r.get("refused"):
        lines.append("  no speed model for this engine is installed")
    return "\n".join(lines)
