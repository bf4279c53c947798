"""The memory model against the card: NVML-measured memory of real llama-server processes.

For each configuration (GGUF file x ctx x cache type x parallel x ubatch) it launches
llama-server through autotune's own backend (the flags a study would use), sends one request
so that lazily allocated buffers exist, reads the process's memory from NVML and the buffer
sizes from llama.cpp's log, and puts autotune's prediction beside them:

    CUDA_VISIBLE_DEVICES=0 python bench/vram_check.py MODEL-Q8_0.gguf MODEL-Q4_K_M.gguf \
        --server BUILD/bin/llama-server --gpu h200 --out results.json --md results.md

Writes a JSON record per configuration and a markdown table with the median and worst error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_gguf
from autotune.toolkit import processes
from autotune_plugins.llama_server.backend import LlamaServerBackend, parse_log

MiB = 2**20


def process_mib(pid: int) -> float | None:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid and p.usedGpuMemory is not None:
                return p.usedGpuMemory / MiB
    finally:
        pynvml.nvmlShutdown()
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--server", required=True)
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--caches", nargs="+", default=["f16", "q8_0"])
    ap.add_argument("--ubatch", type=int, nargs="+", default=[512])
    ap.add_argument("--no-fa-too", action="store_true", help="also run each f16 configuration without flash attention")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--md", type=Path, required=True)
    args = ap.parse_args()

    backend = LlamaServerBackend()
    rows = []
    log_dir = Path(tempfile.mkdtemp(prefix="vram-check-"))
    grid = list(itertools.product(args.models, args.ctx, args.caches, args.parallel, args.ubatch, [True]))
    if args.no_fa_too:
        grid += [(m, c, "f16", p, u, False) for (m, c, k, p, u, _) in grid if k == "f16"]
    for model_path, ctx_tokens, cache, parallel, ub, fa in grid:
        ctx = StudyContext(
            gpu=get_gpu(args.gpu),
            model=model_from_gguf(model_path),
            workload=Workload(prompt_tokens=64, output_tokens=16),
            vram_budget_bytes=10**13,
            protocol=Protocol(),
            settings={"binary": args.server, "startup_timeout_s": 300},
            base_dir=model_path.parent,
        )
        config = TrialConfig(
            "llama-server",
            model_path.name,
            ctx_tokens,
            parallel,
            (("cache_type", cache), ("flash_attn", fa), ("ubatch", ub)),
        )
        predicted = backend.estimate_memory(config, ctx)
        server = backend.launch(config, ctx, True, log_dir)
        try:
            backend.wait_ready(server, 300)
            httpx.post(f"{server.url}/completion", json={"prompt": "Once upon a time", "n_predict": 16}, timeout=120)
            time.sleep(0.5)
            measured = process_mib(server.proc.pid)
            logged = parse_log(server.log())
        finally:
            processes.stop(server.proc)
        # CUDA0 only: CUDA_Host buffers are pinned host memory.
        gpu_buffers = {
            k: sum(v for dev, v in logged.get(k, {}).items() if dev.startswith("CUDA") and "Host" not in dev)
            for k in ("model_buffer_mib", "kv_buffer_mib", "compute_buffer_mib")
        }
        row = {
            "model": model_path.name,
            "ctx": ctx_tokens,
            "parallel": parallel,
            "cache": cache,
            "ubatch": ub,
            "flash_attn": fa,
            "measured_mib": measured,
            "predicted": predicted.to_dict(),
            "logged_cuda_mib": gpu_buffers,
            "offloaded_layers": logged.get("offloaded_layers"),
            "error": None if measured is None else (predicted.total_bytes / MiB - measured) / measured,
        }
        rows.append(row)
        print(
            json.dumps(
                {
                    k: row[k]
                    for k in ("model", "ctx", "parallel", "cache", "ubatch", "flash_attn", "measured_mib", "error")
                }
            ),
            flush=True,
        )
    args.out.write_text(json.dumps(rows, indent=1))

    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    lines = [
        "| weights | ctx | np | cache | ub | fa | NVML MiB | predicted MiB | error | weights pred/logged | "
        "KV pred/logged | compute pred/logged |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, g = r["predicted"], r["logged_cuda_mib"]
        lines.append(
            f"| {r['model']} | {r['ctx']} | {r['parallel']} | {r['cache']} | {r['ubatch']} | {int(r['flash_attn'])} | "
            f"{r['measured_mib']:.0f} | {p['total_bytes'] / MiB:.0f} | {100 * r['error']:+.1f}% | "
            f"{p['weights_bytes'] / MiB:.0f}/{g['model_buffer_mib']:.0f} | {p['kv_bytes'] / MiB:.0f}/{g['kv_buffer_mib']:.0f} | "
            f"{p['buffers_bytes'] / MiB:.0f}/{g['compute_buffer_mib']:.0f} |"
        )
    lines.append("")
    lines.append(
        f"{len(errors)} configurations: median |error| {100 * statistics.median(errors):.1f}%, "
        f"worst {100 * max(errors):.1f}%"
    )
    args.md.write_text("\n".join(lines) + "\n")
    print(lines[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
