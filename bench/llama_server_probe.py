"""Measure llama-server on a real GPU: decode speed, aggregate under parallel streams, memory.

A stand-alone probe (it needs only the Python standard library, httpx and nvidia-smi), run
on the device machine before autotune's llama-server backend exists, to give the memory model
and the twin real figures to be checked against:

    python bench/llama_server_probe.py --server BUILD/bin/llama-server --out RESULTS.json \
        MODEL-Q8_0.gguf MODEL-Q4_K_M.gguf ... [--parallel 1 4] [--ctx 4096]

For each model and parallel value it starts llama-server with every layer on the GPU, flash
attention on, an f16 cache of ctx x parallel cells (llama-server's -c is shared by its -np
slots), sends one warm-up request, then `parallel` simultaneous requests of ~prompt tokens
with n_predict tokens each, and records the server's own timings per request, the wall time
of the batch, the memory the process holds on the GPU (nvidia-smi), and the buffer sizes
llama.cpp logs at start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

BUFFER_LINES = {
    "model_buffer_mib": re.compile(r"CUDA0 model buffer size\s*=\s*([\d.]+) MiB"),
    "kv_buffer_mib": re.compile(r"CUDA0 KV buffer size\s*=\s*([\d.]+) MiB"),
    "compute_buffer_mib": re.compile(r"CUDA0 compute buffer size\s*=\s*([\d.]+) MiB"),
    "host_model_buffer_mib": re.compile(r"CPU_Mapped model buffer size\s*=\s*([\d.]+) MiB"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_used_mib(pid: int) -> float | None:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


def run_one(
    server: str, model: Path, ctx: int, parallel: int, cache: str, prompt_words: int, n_predict: int, log_dir: Path
) -> dict:
    port = free_port()
    log_path = log_dir / f"{model.stem}-np{parallel}-{cache}.log"
    cmd = [
        server,
        "-m",
        str(model),
        "-c",
        str(ctx * parallel),
        "-np",
        str(parallel),
        "-ngl",
        "999",
        "-fa",
        "on",
        "-ctk",
        cache,
        "-ctv",
        cache,
        "--fit",
        "off",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-webui",
        "-lv",
        "4",
        "-b",
        "2048",
        "-ub",
        "512",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    # A local server: no proxy from the environment; one connection per simultaneous request.
    http = httpx.Client(trust_env=False, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                if http.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise RuntimeError("llama-server not ready after 180 s")
        words = (
            "the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
            "boxing matches in the old town square "
        ).split()
        prompt = " ".join(words[i % len(words)] for i in range(prompt_words))

        def complete(seed: int) -> dict:
            r = http.post(
                f"http://127.0.0.1:{port}/completion",
                timeout=600,
                json={
                    "prompt": f"{seed} {prompt}",
                    "n_predict": n_predict,
                    "ignore_eos": True,
                    "temperature": 0,
                    "cache_prompt": False,
                },
            )
            r.raise_for_status()
            return r.json()["timings"]

        complete(-1)  # warm-up: CUDA graphs, allocator
        results: list[dict] = [None] * parallel  # type: ignore[list-item]
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                results[i] = complete(i)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(parallel)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        peak = 0.0
        while any(t.is_alive() for t in threads):
            used = gpu_used_mib(proc.pid)
            peak = max(peak, used or 0.0)
            time.sleep(0.2)
        wall = time.monotonic() - t0
        if errors:
            raise errors[0]
        text = log_path.read_text()
        buffers = {}
        for key, rx in BUFFER_LINES.items():
            found = [float(x) for x in rx.findall(text)]
            buffers[key] = sum(found) if found else None
        return {
            "model": model.name,
            "model_bytes": model.stat().st_size,
            "parallel": parallel,
            "ctx_per_slot": ctx,
            "cache_type": cache,
            "prompt_tokens": statistics.median(r["prompt_n"] for r in results),
            "decode_tok_s_per_stream": [r["predicted_per_second"] for r in results],
            "prefill_tok_s_per_stream": [r["prompt_per_second"] for r in results],
            "aggregate_tok_s": parallel * n_predict / wall,
            "wall_s": wall,
            "gpu_used_mib_peak": peak,
            **buffers,
            "command": " ".join(cmd),
        }
    finally:
        http.close()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--server", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--caches", nargs="+", default=["f16"], help="KV-cache types to try (-ctk/-ctv)")
    ap.add_argument("--prompt-words", type=int, default=700)
    ap.add_argument("--n-predict", type=int, default=256)
    args = ap.parse_args()
    gpu = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    rows = []
    for model in args.models:
        for p in args.parallel:
            for cache in args.caches:
                try:
                    row = run_one(
                        args.server, model, args.ctx, p, cache, args.prompt_words, args.n_predict, args.out.parent
                    )
                except Exception as exc:  # keep the other configurations
                    row = {"model": model.name, "parallel": p, "cache_type": cache, "error": str(exc)[-1500:]}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
    args.out.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=2))
    print(f"\n{gpu}")
    print(
        f"{'model':<22} {'np':>3} {'cache':>5} {'decode/stream':>14} {'aggregate':>10} {'GPU MiB':>9} {'model MiB':>10} {'KV MiB':>8} {'compute MiB':>12}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<22} {r['parallel']:>3} {r['cache_type']:>5}  ERROR {r['error'][:80]}")
            continue
        print(
            f"{r['model']:<22} {r['parallel']:>3} {r['cache_type']:>5} {statistics.median(r['decode_tok_s_per_stream']):>14.1f} "
            f"{r['aggregate_tok_s']:>10.1f} {r['gpu_used_mib_peak']:>9.0f} {r['model_buffer_mib'] or 0:>10.1f} "
            f"{r['kv_buffer_mib'] or 0:>8.1f} {r['compute_buffer_mib'] or 0:>12.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
