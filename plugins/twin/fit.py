"""Fit the twin's constants to the article's measured rows and print the fit table.

    python -m autotune_plugins.twin.fit                 # print the table with the stored constants
    python -m autotune_plugins.twin.fit --refit --write # fit again (needs scipy) and store

Every row of reference/article_v100_qwen27b.toml is predicted by the physics with the same
constants, and printed beside the range the article reports; a row passes when it lands in
that range widened by 10%. The constants that the rows cannot pin down are set from physics
or other sources and say so. A second table compares the twin with published measurements it
was not fitted on (other cards, other models).
"""

from __future__ import annotations

import argparse
import math
import sys
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autotune.formats import weights_for
from autotune.hardware import get_gpu
from autotune.models import get_model

from autotune_plugins.twin import load_constants, physics, quality

REPO = Path(__file__).resolve().parents[2]
DEFAULT_REFERENCE = REPO / "reference" / "article_v100_qwen27b.toml"
CONSTANTS = Path(__file__).with_name("constants.toml")
WIDEN = 0.10
GiB = 2**30

ENGINE = {"llama.cpp": "llama.cpp", "exllamav2": "exllamav2"}
CACHE = {("exllamav2", "q8"): "q8", ("exllamav2", "fp16"): "fp16"}

# Published llama.cpp MMLU on LLaMA 3 8B (13,943 tasks): BF16 41.04 vs Q4_K_M 40.67, KLD 0.031273
# (llama.cpp tools/perplexity/README.md) -> 11.8 points per unit KLD at 8B.
PUBLISHED_POINTS_PER_KLD_8B = (41.04 - 40.67) / 0.031273
# Not fitted: kernel launches and small ops per layer and step (~10 kernels of ~2.5 µs).
PER_LAYER_US = 25.0


@dataclass(frozen=True)
class Row:
    id: str
    engine: str
    weights: str
    ctx: int
    cache: str
    flash_attn: bool
    parallel: int
    data: dict[str, Any]


def load_rows(path: Path) -> tuple[dict[str, Any], list[Row]]:
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    rows = []
    for r in doc["row"]:
        if "backend" not in r:
            continue
        engine = ENGINE[r["backend"]]
        rows.append(Row(r["id"], engine, r["weights"], r["ctx"], r["cache"], r["flash_attn"], r["parallel"], r))
    return doc, rows


def scenario(row: Row, doc: dict[str, Any], parallel: int | None = None, **changes: Any) -> physics.Scenario:
    model = get_model("qwen2.5-27b-article")
    gpu = get_gpu("v100-16gb")
    auto = "auto" in str(row.data.get("gpu_layers", "")) or "offloaded" in str(row.data.get("note", ""))
    s = physics.Scenario(
        engine=row.engine, gpu=gpu, model=model, weights=weights_for(model, row.weights), ctx=row.ctx,
        parallel=parallel or row.parallel, cache_type=row.cache, flash_attn=row.flash_attn,
        prompt_tokens=doc["workload"]["max_prompt_tokens"], output_tokens=doc["workload"]["max_new_tokens"],
        gpu_layers="auto" if (auto or row.engine == "llama.cpp") else "all",
    )
    return replace(s, **changes)


def predictions(doc: dict[str, Any], rows: list[Row], engines: dict[str, physics.EngineConstants],
                host: physics.HostConstants, ppk8: float) -> list[dict[str, Any]]:
    """Each reported figure with its prediction: id, what, low, high, predicted."""
    out = []
    model = get_model("qwen2.5-27b-article")
    for r in rows:
        k = engines[r.engine]
        s = scenario(r, doc)
        p = physics.predict(s, k, host)
        d = r.data
        if "decode_tok_s" in d:
            out.append({"id": r.id, "what": "decode tok/s", "range": d["decode_tok_s"], "pred": p.decode_tok_s})
        if "prefill_tok_s" in d:
            out.append({"id": r.id, "what": "prefill tok/s", "range": d["prefill_tok_s"], "pred": p.prefill_tok_s})
        if "aggregate_tok_s" in d and isinstance(d["aggregate_tok_s"], list):
            out.append({"id": r.id, "what": "aggregate tok/s", "range": d["aggregate_tok_s"], "pred": p.aggregate_tok_s})
        if "per_user_tok_s" in d:
            out.append({"id": r.id, "what": "per-user tok/s", "range": d["per_user_tok_s"], "pred": p.per_user_tok_s})
        if "vram_gb" in d:
            # nvidia-smi prints MiB; "15.6 GB" is read as its MiB / 1024, i.e. GiB.
            total = physics.memory(s, k).total_bytes / GiB
            out.append({"id": r.id, "what": "VRAM GiB", "range": [d["vram_gb"], d["vram_gb"]], "pred": total})
        if "decode_gain_vs_fa_off" in d:
            # FA off cannot keep a quantized V cache in llama.cpp: the "off" side is row 1's f16.
            off = physics.predict(replace(s, flash_attn=False, cache_type="f16"), k, host)
            out.append({"id": r.id, "what": "FA on/off gain", "range": d["decode_gain_vs_fa_off"],
                        "pred": p.decode_tok_s / off.decode_tok_s - 1.0})
        if "quality_drop_points_vs_exl2_4_0" in d:
            ref = quality.drop_points(model, "exl2:4.0", "fp16", ppk8)
            mine = quality.drop_points(model, r.weights, r.cache, ppk8)
            out.append({"id": r.id, "what": "MMLU drop vs 4.0 bpw", "range": d["quality_drop_points_vs_exl2_4_0"],
                        "pred": mine - ref})
        if r.id == "5b":
            # "KV for 8 sequences presses VRAM": the article ran it at the edge of the card.
            # The twin's reading: more than 90% of the card, beyond any sane safety margin.
            mem = physics.memory(s, k).total_bytes
            out.append({"id": r.id, "what": "VRAM share at 8 streams", "range": [0.9, 1.0 / (1 + WIDEN)],
                        "pred": mem / s.gpu.vram_bytes,
                        "note": f"{mem / GiB:.2f} GiB of {s.gpu.vram_bytes / GiB:.2f}; aggregate {p.aggregate_tok_s:.1f} tok/s"})
        if p.host_layers and items_note(out, r.id):
            out[-1]["note"] = f"{p.host_layers} of {s.model.n_layers} layers on the host"
    return out


def items_note(out: list[dict[str, Any]], row_id: str) -> bool:
    return bool(out) and out[-1]["id"] == row_id and not out[-1].get("note")


def inside(item: dict[str, Any]) -> bool:
    lo, hi = item["range"]
    if lo == hi == 0:
        return abs(item["pred"]) <= WIDEN
    return lo * (1 - WIDEN) - 1e-12 <= item["pred"] <= hi * (1 + WIDEN) + 1e-12


def fit(doc: dict[str, Any], rows: list[Row]) -> tuple[dict[str, physics.EngineConstants], physics.HostConstants, float]:
    """Least squares on log(predicted / reported midpoint) over the rows' figures."""
    from scipy.optimize import least_squares  # fitting only: not a runtime dependency

    engines, host, _ = load_constants()
    names = [
        ("llama.cpp", "weight_bw_efficiency", 0.1, 0.9),
        ("llama.cpp", "unfused_attn_per_layer_us", 0.0, 300.0),
        ("llama.cpp", "prefill_efficiency", 0.01, 0.8),
        ("exllamav2", "weight_bw_efficiency", 0.1, 0.9),
        ("exllamav2", "unfused_attn_ns_per_token_layer", 0.0, 200.0),
        ("exllamav2", "decode_compute_efficiency", 0.02, 0.9),
        ("exllamav2", "prefill_efficiency", 0.01, 0.8),
        ("host", "host_bw_efficiency", 0.3, 3.0),
    ]

    def build(x: list[float]) -> tuple[dict[str, physics.EngineConstants], physics.HostConstants]:
        e = dict(engines)
        h = host
        for (eng, field, _, _), value in zip(names, x):
            if eng == "host":
                h = replace(h, **{field: value})
            else:
                e[eng] = replace(e[eng], **{field: value})
        # No llama.cpp row runs several streams: its per-stream compute share is ExLlamaV2's.
        e["llama.cpp"] = replace(e["llama.cpp"], decode_compute_efficiency=e["exllamav2"].decode_compute_efficiency)
        return e, h

    def residuals(x: list[float]) -> list[float]:
        e, h = build(x)
        res = []
        for item in predictions(doc, rows, e, h, PUBLISHED_POINTS_PER_KLD_8B):
            if item["what"] in ("VRAM GiB", "MMLU drop vs 4.0 bpw", "VRAM share at 8 streams"):
                continue
            lo, hi = item["range"]
            mid = (lo + hi) / 2
            pred = max(item["pred"], 1e-9)
            if item["what"] == "FA on/off gain":
                res.append((pred - mid) * 5)
                continue
            # Aim at the middle of the reported range, but mostly stay inside its widened
            # bounds: the acceptance test is the range, and the article's ranges disagree
            # with each other by more than their width in places (rows 2b and 3b).
            res.append(0.3 * math.log(pred / mid))
            res.append(10 * max(0.0, math.log(pred / (hi * (1 + WIDEN) * 0.99))))
            res.append(10 * max(0.0, math.log(lo * (1 - WIDEN) * 1.01 / pred)))
        return res

    x0 = []
    for eng, field, lo, hi in names:
        v = getattr(host if eng == "host" else engines[eng], field)
        x0.append(min(max(v, lo * 1.01), hi * 0.99))
    sol = least_squares(residuals, x0, bounds=([n[2] for n in names], [n[3] for n in names]))
    e, h = build(list(sol.x))

    # ExLlamaV2's context/allocator overhead is what row 2's measured VRAM leaves over.
    r2 = next(r for r in rows if "vram_gb" in r.data)
    s2 = scenario(r2, doc)
    m2 = physics.memory(s2, e["exllamav2"])
    rest = r2.data["vram_gb"] * GiB - (m2.weights_bytes + m2.kv_bytes + m2.buffers_bytes)
    e["exllamav2"] = replace(e["exllamav2"], context_bytes=float(round(rest)))

    # Quality: the published sensitivity, lowered only as far as the article's own sample
    # needs (row 4: 3.3 bpw within 1 point of 4.0 bpw), keeping 5% of that point to spare.
    model = get_model("qwen2.5-27b-article")
    r4 = next(r for r in rows if "quality_drop_points_vs_exl2_4_0" in r.data)
    unit = quality.drop_points(model, r4.weights, r4.cache, 1.0) - quality.drop_points(model, "exl2:4.0", "fp16", 1.0)
    bound = 0.95 * r4.data["quality_drop_points_vs_exl2_4_0"][1] / unit
    return e, h, min(PUBLISHED_POINTS_PER_KLD_8B, bound)


# Published measurements the fit never saw: (gpu, model, engine, weights, tok/s, source).
HOLDOUT = [
    ("rtx3090", "llama-2-7b", "llama.cpp", "gguf:Q4_0", 121.82, "llama.cpp PR #4766, tg128"),
    ("rtx4090", "llama-2-7b", "llama.cpp", "gguf:Q8_0", 98.13, "llama.cpp PR #4766, tg128"),
    ("p40", "llama-2-7b", "llama.cpp", "gguf:Q4_0", 56.79, "llama.cpp PR #4766, tg128"),
    ("rtx4090", "llama-2-7b", "exllamav2", "exl2:4.0", 207.0, "exllamav2 README"),
    ("rtx4090", "llama-2-7b", "exllamav2", "exl2:3.0", 245.0, "exllamav2 README"),
    ("rtx4090", "llama-2-70b", "exllamav2", "exl2:2.5", 37.0, "exllamav2 README"),
]


def holdout(engines: dict[str, physics.EngineConstants], host: physics.HostConstants) -> list[dict[str, Any]]:
    out = []
    for gpu_key, model_key, engine, fmt, published, source in HOLDOUT:
        model = get_model(model_key)
        s = physics.Scenario(engine=engine, gpu=get_gpu(gpu_key), model=model, weights=weights_for(model, fmt),
                             ctx=512, parallel=1, cache_type="f16" if engine == "llama.cpp" else "fp16",
                             flash_attn=engine == "exllamav2", prompt_tokens=1, output_tokens=128)
        p = physics.predict(s, engines[engine], host)
        out.append({"gpu": gpu_key, "model": model_key, "weights": fmt, "engine": engine, "published": published,
                    "pred": p.decode_tok_s, "ratio": p.decode_tok_s / published, "source": source})
    return out


def write_constants(engines: dict[str, physics.EngineConstants], host: physics.HostConstants, ppk8: float) -> None:
    lines = [
        "# Fitted constants of the digital twin. Written by: python -m autotune_plugins.twin.fit --refit --write",
        "# Each engine constant is explained in plugins/twin/physics.py (EngineConstants); the fit in docs/twin.md.",
        "",
        "[host]",
        f"host_bw_efficiency = {host.host_bw_efficiency:.4f}",
        "",
        "[quality]",
        f"points_per_kld_8b = {ppk8:.4f}",
    ]
    for name, k in engines.items():
        lines += ["", f'[engines."{name}"]']
        for field, value in vars(k).items():
            if isinstance(value, bool):
                lines.append(f"{field} = {'true' if value else 'false'}")
            elif isinstance(value, str):
                lines.append(f'{field} = "{value}"')
            elif field == "context_bytes":
                lines.append(f"{field} = {int(value)}")
            else:
                lines.append(f"{field} = {value:.4f}")
    CONSTANTS.write_text("\n".join(lines) + "\n", encoding="utf-8")


def table(items: list[dict[str, Any]]) -> str:
    lines = [f"{'row':<4} {'figure':<22} {'reported':>14} {'widened':>17} {'twin':>9}  ok"]
    for it in items:
        lo, hi = it["range"]
        rep = f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"
        wid = f"{lo * (1 - WIDEN):.3g}-{hi * (1 + WIDEN):.3g}"
        ok = "yes" if inside(it) else "NO"
        note = f"  ({it['note']})" if it.get("note") else ""
        lines.append(f"{it['id']:<4} {it['what']:<22} {rep:>14} {wid:>17} {it['pred']:>9.3f}  {ok}{note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE)
    ap.add_argument("--refit", action="store_true", help="fit the constants again (needs scipy)")
    ap.add_argument("--write", action="store_true", help="store the fitted constants in constants.toml")
    args = ap.parse_args(argv)
    doc, rows = load_rows(args.reference)
    if args.refit:
        engines, host, ppk8 = fit(doc, rows)
        if args.write:
            write_constants(engines, host, ppk8)
    else:
        engines, host, ppk8 = load_constants()
    items = predictions(doc, rows, engines, host, ppk8)
    print(f"Twin vs the article's rows (V100 16 GB, {args.reference.name}); pass = inside the range widened by 10%")
    print(table(items))
    print(f"\n{sum(inside(i) for i in items)}/{len(items)} figures inside their widened range")
    print("\nHoldout: published single-stream decode the fit never saw (tg128-like: 1 prompt token, 128 out)")
    for h in holdout(engines, host):
        print(f"  {h['gpu']:<8} {h['model']:<12} {h['engine']:<10} {h['weights']:<10} published {h['published']:>7.1f}"
              f"  twin {h['pred']:>7.1f}  ratio {h['ratio']:.2f}  ({h['source']})")
    return 0 if all(inside(i) for i in items) else 1


if __name__ == "__main__":
    sys.exit(main())
