"""Per-trial table of a measured study, with each configuration's share of the bandwidth roofline.

Reads the trials straight from the study's storage and writes them as JSON (everything the
trial recorded that the table uses) and as a Markdown table:

    python bench/study_table.py sqlite:///study.db --study h200-exllamav2-vs-llama \
        --gpu h200 --json out.json --md out.md

Roofline share: a decode step reads every weight resident on the GPU once (the KV cache adds
a few percent at short contexts and is left out), so ``gpu weight bytes x decode steps per
second / peak bandwidth``. Steps per second are the single-stream decode rate for one stream,
and ``aggregate / jobs decoded together`` under load: a server that queues its jobs (ExLlamaV2
without paged attention) decodes one at a time, a batching one decodes all ``parallel``.

KLD (nats): what the trial recorded when the study's quality metric was ``kld``, else, with
``--kld FILE``, the row of bench/exllamav3_h200/kld_artifacts.py's JSON for the same backend,
weights and cache type (the artifact's KL divergence against its engine's full precision).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import optuna

from autotune.errors import ConfigError
from autotune.hardware.gpus import get_gpu
from autotune.report.text import load_study
from autotune.study import records
from autotune.study.records import TrialRecord

MiB = 2**20


def _jobs_at_once(r: TrialRecord, parallel: int) -> int:
    generator = r.engine_facts.get("generator") or {}
    return int(generator.get("jobs_at_once", parallel))


def rows(study: optuna.Study, bandwidth_gb_s: float) -> list[dict[str, Any]]:
    out = []
    for r in records.records(study):
        config = dict(r.config or {})
        row: dict[str, Any] = {
            "trial": r.number,
            "state": r.state.name,
            "backend": config.get("backend"),
            "weights": config.get("weights"),
            "ctx": config.get("ctx"),
            "parallel": config.get("parallel"),
            "options": {k: v for k, v in config.items() if k not in ("backend", "weights", "ctx", "parallel")},
            "reason": r.fail_reason or r.prune_reason,
        }
        quality = dict(r.quality or {})
        if quality.get("metric") == "kld" and quality.get("value") is not None:
            row["kld"] = quality["value"]
        if r.state == optuna.trial.TrialState.COMPLETE and r.metrics:
            predicted = dict(r.predicted_vram or {})
            measured, residual = r.measured_vram_bytes, r.vram_residual_bytes
            weights = int(predicted.get("weights_bytes", 0))
            parallel = int(config.get("parallel") or 1)
            jobs = _jobs_at_once(r, parallel)
            decode = r.median("decode_tok_s")
            aggregate = r.median("aggregate_tok_s")
            row.update(
                {
                    "decode_tok_s": decode,
                    "aggregate_tok_s": aggregate,
                    "per_user_tok_s": r.median("per_user_tok_s"),
                    "ttft_ms": r.median("ttft_ms"),
                    "prefill_tok_s": r.median("prefill_tok_s"),
                    "jobs_at_once": jobs,
                    "attention_path": r.engine_facts.get("attention_path"),
                    "generator_mode": (r.engine_facts.get("generator") or {}).get("mode"),
                    "measured_vram_bytes": measured,
                    "predicted_vram_bytes": predicted.get("total_bytes"),
                    "vram_prediction_error": r.vram_prediction_error,
                    # The raw model before the study's learned correction: measured - residual.
                    "raw_vram_prediction_error": (-residual / measured) if measured and residual is not None else None,
                    "gpu_weights_bytes": weights,
                    "kv_bytes": predicted.get("kv_bytes"),
                    "roofline_share_single": weights * decode / (bandwidth_gb_s * 1e9) if decode else None,
                    "roofline_share_aggregate": (weights * aggregate / jobs / (bandwidth_gb_s * 1e9))
                    if aggregate
                    else None,
                    "deploy_command": r.deploy_command,
                    "metrics": dict(r.metrics),
                    "engine_facts": dict(r.engine_facts),
                    "predicted_vram": predicted,
                }
            )
        out.append(row)
    return out


def add_kld(table: list[dict[str, Any]], measured: list[dict[str, Any]]) -> None:
    """Give each row without a KLD of its own the one measured for its backend, weights and cache."""
    found = {(m["backend"], m["weights"], m.get("cache_type")): m["kld_mean"] for m in measured if "kld_mean" in m}
    for row in table:
        key = (row["backend"], row["weights"], (row.get("options") or {}).get("cache_type"))
        if row.get("kld") is None and key in found:
            row["kld"] = found[key]


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def _num(x: float | None, fmt: str = "{:.0f}") -> str:
    return "" if x is None else fmt.format(x)


def markdown(table: list[dict[str, Any]], bandwidth_gb_s: float) -> str:
    head = (
        "| trial | backend | weights | cache | parallel | jobs at once | decode tok/s (1 stream) | aggregate tok/s "
        "| per user tok/s | TTFT ms | NVML MiB | predicted MiB (error; raw model) | GPU weights MiB "
        "| roofline, 1 stream | roofline, aggregate | KLD (nats) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in table:
        opts = dict(r.get("options") or {})
        if r["state"] != "COMPLETE" or "decode_tok_s" not in r:
            lines.append(
                f"| {r['trial']} | {r['backend']} | {r['weights']} | {opts.get('cache_type', '')} "
                f"| {r['parallel']} | {r['state'].lower()}: {r.get('reason') or ''} |"
                + " |" * 9
                + f" {_num(r.get('kld'), '{:.5f}')} |"
            )
            continue
        measured = r["measured_vram_bytes"]
        lines.append(
            f"| {r['trial']} | {r['backend']} | {r['weights']} | {opts.get('cache_type', '')} | {r['parallel']} "
            f"| {r['jobs_at_once']} | {_num(r['decode_tok_s'])} | {_num(r['aggregate_tok_s'])} "
            f"| {_num(r['per_user_tok_s'])} | {_num(r['ttft_ms'])} | {_num(measured and measured / MiB)} "
            f"| {_num(r['predicted_vram_bytes'] / MiB)} ({_pct(r['vram_prediction_error'])}; "
            f"{_pct(r['raw_vram_prediction_error'])}) | {_num(r['gpu_weights_bytes'] / MiB)} "
            f"| {_pct(r['roofline_share_single']).lstrip('+')} | {_pct(r['roofline_share_aggregate']).lstrip('+')} "
            f"| {_num(r.get('kld'), '{:.5f}')} |"
        )
    lines.append("")
    lines.append(
        f"Roofline: GPU-resident weight bytes x decode steps/s over {bandwidth_gb_s:.0f} GB/s; "
        "error = (predicted - NVML) / NVML, with and without the study's learned correction."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("storage", help="the study's storage URL, e.g. sqlite:///study.db")
    p.add_argument("--study", help="study name (default: the storage's only study)")
    p.add_argument("--gpu", default="h200", help="catalog GPU whose peak bandwidth is the roofline (default h200)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--md", help="write the Markdown table here (default: stdout)")
    p.add_argument("--kld", help="kld_artifacts.py's JSON: a KLD column for trials that recorded none")
    args = p.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = load_study(args.storage, args.study)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    bandwidth = get_gpu(args.gpu).mem_bandwidth_gb_s
    table = rows(study, bandwidth)
    if args.kld:
        with open(args.kld, encoding="utf-8") as f:
            add_kld(table, json.load(f))
    md = markdown(table, bandwidth)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1, default=str)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(md)
    else:
        sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
