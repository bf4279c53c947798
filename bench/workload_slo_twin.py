"""The twin's winners for a chat and a RAG profile, with and without latency targets (issue 29).

    python bench/workload_slo_twin.py [--trials 40]

One model (qwen2.5-7b), one card (H200), twin-llama.cpp over two formats, parallel 1..64 and
ubatch 512/2048, 64 requests drawn from each preset: each profile is tuned once for aggregate
throughput and once under p95 TTFT and ITL targets (goodput). The figures are the twin's
predictions, not measurements; docs/workload.md quotes them.
"""

from __future__ import annotations

import argparse
import tempfile
import tomllib
from pathlib import Path

import optuna

from autotune import plugins
from autotune.config import parse_study_config
from autotune.study import run_study

STUDY = """
[study]
name = "{name}"
seed = 3
n_trials = {trials}
baseline = false
[hardware]
gpu = "h200"
[model]
ref = "qwen2.5-7b"
[workload]
profile = "{profile}"
requests = 64
[[candidates]]
backend = "twin-llama.cpp"
weights = ["gguf:Q4_K_M", "gguf:Q8_0"]
[space]
ctx = [16384]
parallel = [1, 2, 4, 8, 16, 32, 64]
ubatch = [512, 2048]
[objective]
{objective}
"""
# The targets: an interactive chat's first token within 300 ms; a RAG answer's within 1 s (its
# prompts are 2000 tokens); both stream at least ~65 tokens/s (ITL 15 ms) at p95.
TARGETS = {"chat": "ttft_p95_ms = 300\nitl_p95_ms = 15", "rag": "ttft_p95_ms = 1000\nitl_p95_ms = 15"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=40)
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    plugins.get_backends()  # the twin, from the installed entry points
    with tempfile.TemporaryDirectory() as tmp:
        for profile, targets in TARGETS.items():
            for tag, objective in (("throughput", ""), ("targets", targets)):
                name = f"{profile}-{tag}"
                cfg = parse_study_config(
                    tomllib.loads(STUDY.format(name=name, trials=args.trials, profile=profile, objective=objective)),
                    source=name,
                )
                best = run_study(cfg, storage=f"sqlite:///{Path(tmp) / name}.db").best
                if best is None:
                    print(f"{name}: no configuration met the targets")
                    continue
                p, m = best["params"], best["metrics"]
                print(
                    f"{name:16s} {p.get('weights')} parallel {p.get('parallel')} ubatch {p.get('ubatch')}: "
                    f"aggregate {m['aggregate_tok_s']:.0f} tok/s, goodput {m['goodput_tok_s']:.0f} tok/s, "
                    f"TTFT p95 {m['ttft_p95_ms']:.0f} ms, ITL p95 {m['itl_p95_ms']:.1f} ms"
                )


if __name__ == "__main__":
    main()
