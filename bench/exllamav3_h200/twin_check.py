"""The twins against an H200 study's measured trials (issue 42 item 3).

For every trial that loaded, `autotune estimate` asks the engine's twin for the same
configuration (the model's config.json, the format, ctx, cache, streams, the study's workload)
and this prints predicted / measured for decode, aggregate and memory, with the median and worst
error per twin. Nothing is fitted here: it checks the constants as they stand.

Usage: python bench/exllamav3_h200/twin_check.py STUDY_JSON MODEL_DIR [--json OUT] [--md OUT]
  STUDY_JSON: bench/study_table.py's --json (e.g. bench/results/exl3_h200/h200_exl3_study.json)
  MODEL_DIR:  a directory with the source's config.json (no weights needed)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

TWINS = {"exllamav3": "twin-exllamav3", "exllamav2": "twin-exllamav2", "llama-server": "twin-llama.cpp"}
MiB = 2**20


def predict(row: dict, model_dir: str, prompt: int, output: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "autotune.cli",
        "estimate",
        "--gpu",
        "h200",
        "--model",
        model_dir,
        "--backend",
        TWINS[row["backend"]],
        "--weights",
        row["weights"],
        "--ctx",
        str(row["ctx"]),
        "--cache",
        row["options"]["cache_type"],
        "--parallel",
        str(row["parallel"]),
        "--prompt-tokens",
        str(prompt),
        "--output-tokens",
        str(output),
        "--json",
    ]
    if row["backend"] == "exllamav2" and row.get("jobs_at_once") == 1 and row["parallel"] > 1:
        cmd += ["--setting", 'unpaged_parallel="queue"']  # as measured: one job at a time
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if not out.stdout.strip().startswith("{"):
        raise SystemExit(f"estimate failed for trial {row['trial']}: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study_json")
    ap.add_argument("model_dir")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--md", dest="md_out")
    a = ap.parse_args(argv)
    rows = [r for r in json.loads(Path(a.study_json).read_text()) if r["state"] == "COMPLETE"]
    table = []
    for r in rows:
        p = predict(r, a.model_dir, a.prompt_tokens, a.output_tokens)
        table.append(
            {
                "trial": r["trial"],
                "backend": r["backend"],
                "weights": r["weights"],
                "cache": r["options"]["cache_type"],
                "parallel": r["parallel"],
                "decode": r["decode_tok_s"],
                "decode_twin": p["predicted"]["decode_tok_s"],
                "aggregate": r["aggregate_tok_s"],
                "aggregate_twin": p["predicted"]["aggregate_tok_s"],
                "memory_mib": r["measured_vram_bytes"] / MiB,
                "memory_twin_mib": p["vram"]["predicted_bytes"] / MiB,
            }
        )
    lines = [
        "| trial | engine | weights | cache | streams | decode (twin / measured) | aggregate (twin / measured) "
        "| memory MiB (twin / NVML) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        lines.append(
            f"| {t['trial']} | {t['backend']} | {t['weights']} | {t['cache']} | {t['parallel']} "
            f"| {t['decode_twin']:.0f} / {t['decode']:.0f} = {t['decode_twin'] / t['decode']:.2f} "
            f"| {t['aggregate_twin']:.0f} / {t['aggregate']:.0f} = {t['aggregate_twin'] / t['aggregate']:.2f} "
            f"| {t['memory_twin_mib']:.0f} / {t['memory_mib']:.0f} = {t['memory_twin_mib'] / t['memory_mib']:.2f} |"
        )
    lines.append("")
    summary = {}
    for engine in sorted({t["backend"] for t in table}):
        mine = [t for t in table if t["backend"] == engine]
        s = {}
        for key in ("decode", "aggregate", "memory_mib"):
            twin_key = "memory_twin_mib" if key == "memory_mib" else f"{key}_twin"
            errors = [t[twin_key] / t[key] - 1 for t in mine]
            s[key] = {"median_error": statistics.median(errors), "worst_error": max(errors, key=abs), "n": len(errors)}
        summary[engine] = s
        lines.append(
            f"{TWINS[engine]} ({len(mine)} trials): "
            + "; ".join(
                f"{k.replace('_mib', '')} median {v['median_error']:+.0%}, worst {v['worst_error']:+.0%}"
                for k, v in s.items()
            )
        )
    text = "\n".join(lines)
    print(text)
    if a.md_out:
        Path(a.md_out).write_text(text + "\n")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"trials": table, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
