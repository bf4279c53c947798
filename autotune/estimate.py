"""``autotune estimate``: memory breakdown and predicted speed of one configuration, no launch.

The memory comes from the named backend's own estimate; the speed from a model backend of
the same engine (the digital twin) for the card and model given. ``ctx`` is per sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune import plugins
from autotune.backend import BaseBackend, StudyContext, TrialConfig, Workload
from autotune.errors import ConfigError, UnknownNameError
from autotune.gguf_file import read_gguf
from autotune.hardware import resolve_gpu
from autotune.measure import Protocol
from autotune.models import resolve_model


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
    gpu = resolve_gpu(gpu_key)
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
                       vram_budget_bytes=gpu.vram_bytes, protocol=Protocol(), for_gpu=True)
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
    no_prediction = None if predictor is not None else "no speed model for this engine is installed"
    if predictor is not None:
        probe = TrialConfig(predictor.name, _format_of(weights), ctx_tokens, parallel, config.options)
        try:
            predictor.refuse(probe, ctx)  # type: ignore[attr-defined]
        except AttributeError:
            pass
        except Exception as exc:  # the engine's own refusal, e.g. FlashAttention 2 on Volta
            refused = str(exc)
        if refused is None:
            try:
                predicted = predictor.predict(probe, ctx)
            except ConfigError as exc:  # a weights file whose format the speed model has no entry for
                no_prediction = f"{predictor.name} cannot predict its speed: {exc}"
    return {
        "config": config.as_dict(),
        "gpu": gpu.key,
        "model": model.key,
        "vram": {**mem.to_dict(), "budget_bytes": gpu.vram_bytes, "fits": mem.total_bytes <= gpu.vram_bytes},
        "predicted": dict(predicted) if predicted else None,
        "refused": refused,
        "invalid": invalid,
        "predictor": predictor.name if predictor else None,
        "no_prediction": no_prediction,
    }


def _format_of(weights: str) -> str:
    """A weights file as the speed model knows it: ``gguf:<its file type>``; other refs as they are.

    The speed model works from bytes per weight of a format, which a GGUF file's header names
    (``general.file_type``); memory comes from the file's own tensors either way.
    """
    path = Path(weights).expanduser()
    if not path.is_file():
        return weights
    try:
        header = read_gguf(path)
    except ConfigError:  # not a GGUF file: no speed prior
        return weights
    if header.file_type is not None:
        return "gguf:" + header.file_type
    # No file type in the header: the type most of the layers' matrices have.
    types = [t.ggml_type for t in header.tensors if t.layer is not None and len(t.shape) > 1]
    return "gguf:" + max(set(types), key=types.count) if types else weights


def estimate_text(r: dict[str, Any]) -> str:
    v = r["vram"]
    # MiB for small models (a test model of a few MiB would print as 0.00 GiB everywhere).
    gib, unit = (2**30, "GiB") if v["total_bytes"] >= 2**30 else (2**20, "MiB")
    c = r["config"]
    lines = [
        f"{c['backend']} {c['weights']} ctx {c['ctx']} x {c['parallel']} "
        + " ".join(f"{k}={val}" for k, val in c.items() if k not in ("backend", "weights", "ctx", "parallel"))
        + f" on {r['gpu']}, model {r['model']}",
        f"  VRAM: weights {v['weights_bytes'] / gib:.2f} + KV {v['kv_bytes'] / gib:.2f} + buffers "
        f"{v['buffers_bytes'] / gib:.2f} + overhead {v['overhead_bytes'] / gib:.2f} = {v['total_bytes'] / gib:.2f} {unit} "
        f"of {v['budget_bytes'] / 2**30:.2f} GiB: {'fits' if v['fits'] else 'DOES NOT FIT'}",
    ]
    if v["host_bytes"]:
        lines.append(f"  host memory: {v['host_bytes'] / gib:.2f} {unit}")
    for note in v.get("notes", []):
        lines.append(f"  - {note}")
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
    elif not r.get("refused") and r.get("no_prediction"):
        lines.append(f"  {r['no_prediction']}")
    return "\n".join(lines)
