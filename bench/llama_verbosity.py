"""llama-server measured at its default log verbosity against ``-lv 4``, interleaved.

Until the start-up facts got a launch of their own, every trial ran llama-server at ``-lv 4``
(the level that prints its buffer sizes) and the deploy line kept it. This measures what that
cost: the same configuration launched at the default verbosity and at ``-lv 4`` in alternating
order (ABBA), each launch measured by the backend's own measurement (warm-up, runs, one request
alone and ``parallel`` streams), so the two sides share the machine's drift.

    python bench/llama_verbosity.py MODEL.gguf [--rounds 6] [--ctx 512] [--parallel 4] \
        [--prompt 128] [--output 64] [--out bench/results/llama_verbosity_cpu]

Needs a llama-server build (``autotune engine build llama.cpp --cpu``). Prints a table per
quantity (median of the rounds' medians, each side) and the ratio default / ``-lv 4``, with the
range of the per-round ratios; writes ``OUT.json`` and ``OUT.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from autotune.toolkit import processes
from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_gguf
from autotune_plugins.llama_server.backend import LlamaServerBackend

QUANTITIES = ("decode_tok_s", "prefill_tok_s", "aggregate_tok_s", "per_user_tok_s", "ttft_ms")


def measure(
    backend: LlamaServerBackend, config: TrialConfig, ctx: StudyContext, verbose: bool, gpu: bool
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="autotune-verbosity-") as tmp:
        server = backend.launch(config, ctx, gpu, Path(tmp), verbose=verbose)
        try:
            m = backend._measure(server, config, ctx, gpu, 300.0, 300.0)
        finally:
            server.close()
            processes.stop(server.proc)
    return {q: m.metrics[q].median for q in QUANTITIES if q in m.metrics}


def _gpu_name() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)))
    except Exception as exc:  # noqa: BLE001 - a label only
        return f"unknown GPU ({exc})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--gpu", action="store_true", help="every layer on the GPU (-ngl 999), else the CPU only")
    args = ap.parse_args()

    path = args.model.resolve()
    model = model_from_gguf(path)
    backend = LlamaServerBackend()
    ctx = StudyContext(
        gpu=get_gpu("h200" if args.gpu else "v100-16gb"),
        model=model,
        workload=Workload(args.prompt, args.output),
        vram_budget_bytes=16 * 2**30,
        protocol=Protocol(warmup_runs=1, min_runs=3, max_runs=3),
        base_dir=path.parent,
        for_gpu=args.gpu,
    )
    config = TrialConfig(
        "llama-server", path.name, args.ctx, args.parallel, (("cache_type", "f16"), ("flash_attn", True))
    )
    sides = {"default": [], "lv4": []}
    for r in range(args.rounds):
        order = ("default", "lv4") if r % 2 == 0 else ("lv4", "default")
        for side in order:
            t0 = time.monotonic()
            sides[side].append(measure(backend, config, ctx, verbose=(side == "lv4"), gpu=args.gpu))
            print(
                f"round {r + 1}/{args.rounds} {side:>7}: "
                + ", ".join(f"{q} {v:.1f}" for q, v in sides[side][-1].items())
                + f" ({time.monotonic() - t0:.1f} s)",
                file=sys.stderr,
                flush=True,
            )

    lines = [
        f"llama-server at its default verbosity vs -lv 4, {args.rounds} interleaved rounds (ABBA)",
        f"model {path.name}, ctx {args.ctx} x {args.parallel} slots, prompt {args.prompt}, output {args.output}, "
        f"machine: {platform.node()}, {os.cpu_count()} cores, "
        + (f"every layer on the GPU ({_gpu_name()})" if args.gpu else "CPU only (-ngl 0)"),
        "",
        f"{'quantity':<16} {'default':>10} {'-lv 4':>10} {'ratio':>7}  per-round ratios (min..max)",
    ]
    summary = {}
    for q in QUANTITIES:
        a = [s[q] for s in sides["default"] if q in s]
        b = [s[q] for s in sides["lv4"] if q in s]
        if not a or not b:
            continue
        ratios = [x / y for x, y in zip(a, b) if y]
        med_a, med_b = statistics.median(a), statistics.median(b)
        summary[q] = {
            "default": a,
            "lv4": b,
            "median_default": med_a,
            "median_lv4": med_b,
            "ratio": med_a / med_b if med_b else None,
            "round_ratios": ratios,
        }
        lines.append(
            f"{q:<16} {med_a:>10.1f} {med_b:>10.1f} {med_a / med_b:>7.3f}  {min(ratios):.3f}..{max(ratios):.3f}"
        )
    lines.append("")
    lines.append("ratio = default / -lv 4 (ttft_ms: lower is better, so a ratio under 1 favours the default)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".txt").write_text(text + "\n")
        args.out.with_suffix(".json").write_text(
            json.dumps(
                {
                    "model": path.name,
                    "ctx": args.ctx,
                    "parallel": args.parallel,
                    "prompt": args.prompt,
                    "output": args.output,
                    "rounds": args.rounds,
                    "quantities": summary,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
