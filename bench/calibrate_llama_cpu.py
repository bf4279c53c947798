"""Calibrate autotune's llama-server measurement against llama.cpp's own benchmarks, on the CPU.

A tuner that measures a configuration slower than its engine can run it may rank
configurations by its own overheads. This script measures the same model, the same
settings and the same workload three ways, with binaries from one llama.cpp tree (those
``autotune engine build llama.cpp --cpu`` makes):

* single-stream decode: ``llama-bench`` tg (decode from an empty cache) against the decode
  rate autotune records for one request through ``llama-server`` (the server's own timings);
* aggregate output at 1, 2 and 4 streams: ``llama-batched-bench`` (B prompts prefilled
  together, then decoded in lockstep; output tokens over prefill + decode time, and its
  decode-only S_TG) against autotune's aggregate (output tokens of all streams over the span
  from the first request to the last end, through HTTP);

and also records the CPU time autotune's own process (the load generator) spends while it
measures, since on a 2-core machine every client cycle is one the engine does not get.

    python bench/calibrate_llama_cpu.py                       # 76M Llama shape, F16 and Q8_0
    python bench/calibrate_llama_cpu.py --json bench/results/calibrate_llama_cpu.json

It prints a table with the ratios autotune / llama.cpp and writes everything as JSON. The
test tests/plugins/test_llama_calibration.py runs a reduced version of :func:`calibrate`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.errors import MeasurementError
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_gguf
from autotune_plugins.llama_server import engine, synth
from autotune_plugins.llama_server.backend import LlamaServerBackend

# The shape issue 18 measured: ~74M parameters with llama-bpe's 128k vocabulary, whose
# embedding and output head are most of it (a small model's decode is the head's matmul).
ISSUE_SHAPE = synth.SynthSpec(
    arch="llama", n_layers=8, hidden=256, n_heads=4, n_kv_heads=2, ffn=1024, context_length=2048
)


@dataclass(frozen=True)
class Setup:
    """What is measured: one workload, one server configuration, several stream counts.

    Attributes:
        ctx: Context per sequence (autotune's ``ctx``; the server gets ctx x parallel).
        prompt_tokens: Prompt length of each request (llama-batched-bench ``-npp``).
        output_tokens: Tokens generated per request (llama-bench ``-n``, ``-ntg``).
        threads: CPU threads of every engine process.
        streams: Concurrent requests measured for the aggregate.
        flash_attn: Flash attention on or off, everywhere.
        bench_runs: Runs of llama-bench (its ``-r``) and of llama-batched-bench (which has no
            repetitions of its own); the median is kept.
        protocol: autotune's repetition rules for its own measurement.
    """

    ctx: int = 512
    prompt_tokens: int = 16
    output_tokens: int = 128
    threads: int = 2
    streams: tuple[int, ...] = (1, 2, 4)
    flash_attn: bool = True
    bench_runs: int = 3
    protocol: Protocol = field(
        default_factory=lambda: Protocol(warmup_runs=1, min_runs=3, max_runs=6, rel_spread_tol=0.05)
    )


def make_models(
    out_dir: Path, shape: synth.SynthSpec = ISSUE_SHAPE, qtypes: Sequence[str] = ("Q8_0",), keep_f16: bool = True
) -> dict[str, Path]:
    """Writes the F16 model (and its quantized copies) with ``autotune synth``'s library.

    Returns:
        {"F16": path, "Q8_0": path, ...}; F16 left out unless ``keep_f16``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    f16 = out_dir / f"calib-{shape.name}-f16.gguf"
    if not f16.is_file():
        synth.write_model(shape, f16, vocab_from=synth.find_vocab(shape.arch), seed=0)
    models = {"F16": f16} if keep_f16 else {}
    for qtype in qtypes:
        target = f16.with_name(f"{f16.stem}-{qtype}.gguf")
        models[qtype] = target if target.is_file() else synth.quantize(f16, qtype, timeout_s=300)
    return models


def _run(cmd: list[str], timeout_s: float) -> str:
    proc = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise MeasurementError(f"{' '.join(cmd)}: exit status {proc.returncode}: {tail}")
    return proc.stdout + "\n" + proc.stderr


def llama_bench_decode(model: Path, setup: Setup, binary: Path | None = None, timeout_s: float = 600) -> dict[str, Any]:
    """llama-bench's tg<output_tokens>: decode tokens/s from an empty cache, ``bench_runs`` times."""
    binary = binary or engine.find_engine_tool("llama-bench", arch="cpu")
    cmd = [
        str(binary),
        "-m",
        str(model),
        "-p",
        "0",
        "-n",
        str(setup.output_tokens),
        "-t",
        str(setup.threads),
        "-fa",
        "on" if setup.flash_attn else "off",
        "-ngl",
        "0",
        "-r",
        str(setup.bench_runs),
        "-o",
        "json",
    ]
    out = _run(cmd, timeout_s)
    start, end = out.find("["), out.rfind("]")
    rows = json.loads(out[start : end + 1])
    samples = [float(s) for r in rows if int(r.get("n_gen", 0)) == setup.output_tokens for s in r["samples_ts"]]
    if not samples:
        raise MeasurementError(f"{' '.join(cmd)}: no tg{setup.output_tokens} result in its JSON")
    return {"decode_tok_s": statistics.median(samples), "samples": samples, "command": " ".join(cmd)}


def batched_bench(
    model: Path, setup: Setup, binary: Path | None = None, timeout_s: float = 900
) -> dict[int, dict[str, Any]]:
    """llama-batched-bench at every stream count, ``bench_runs`` times.

    Returns:
        For each stream count: ``e2e_tok_s`` (output tokens over prefill + decode time: the
        quantity autotune's aggregate is) and ``decode_tok_s`` (its S_TG: output tokens over
        decode time only), medians of the runs.
    """
    binary = binary or engine.find_engine_tool("llama-batched-bench", arch="cpu")
    n_kv = max(setup.streams) * setup.ctx  # what the server gets: -c ctx x parallel
    cmd = [
        str(binary),
        "-m",
        str(model),
        "-c",
        str(n_kv),
        "-npp",
        str(setup.prompt_tokens),
        "-ntg",
        str(setup.output_tokens),
        "-npl",
        ",".join(map(str, setup.streams)),
        "-t",
        str(setup.threads),
        "-fa",
        "on" if setup.flash_attn else "off",
        "-ngl",
        "0",
        "--output-format",
        "jsonl",
    ]
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in setup.streams}
    for _ in range(setup.bench_runs):
        for line in _run(cmd, timeout_s).splitlines():
            if line.startswith("{") and '"pl"' in line:
                row = json.loads(line)
                runs[int(row["pl"])].append(
                    {"e2e_tok_s": row["pl"] * row["tg"] / row["t"], "decode_tok_s": float(row["speed_tg"])}
                )
    missing = [n for n, r in runs.items() if not r]
    if missing:
        raise MeasurementError(f"{' '.join(cmd)}: no result for {missing} streams")
    return {
        n: {
            "e2e_tok_s": statistics.median(r["e2e_tok_s"] for r in rs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
            "runs": rs,
            "command": " ".join(cmd),
        }
        for n, rs in runs.items()
    }


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def autotune_measure(model: Path, setup: Setup, parallel: int) -> dict[str, Any]:
    """One configuration through autotune's backend, as a study measures it."""
    ctx = StudyContext(
        gpu=get_gpu("t4"),  # a context needs a card; on a machine without one the server runs -ngl 0
        model=model_from_gguf(model),
        workload=Workload(prompt_tokens=setup.prompt_tokens, output_tokens=setup.output_tokens),
        vram_budget_bytes=16 * 2**30,
        protocol=setup.protocol,
        settings={"threads": setup.threads, "startup_timeout_s": 120, "gpu_layers": 0},
        base_dir=model.parent,
    )
    config = TrialConfig(
        "llama-server", model.name, setup.ctx, parallel, (("cache_type", "f16"), ("flash_attn", setup.flash_attn))
    )
    cpu0, wall0 = _cpu_seconds(), time.monotonic()
    m = LlamaServerBackend().run(config, ctx)
    cpu, wall = _cpu_seconds() - cpu0, time.monotonic() - wall0
    return {
        "decode_tok_s": m.metrics["decode_tok_s"].median,
        "aggregate_tok_s": m.metrics["aggregate_tok_s"].median,
        "runs": m.metrics["aggregate_tok_s"].n,
        "command": m.attrs.get("command"),
        # The load generator's share of the machine while it measured (HTTP, JSON, threads).
        "client_cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "client_cores": round(cpu / wall, 3),
    }


def _spread(values: Sequence[float]) -> float:
    """(max - min) / median: how far apart a tool's own runs were."""
    return (max(values) - min(values)) / statistics.median(values) if values else 0.0


def calibrate(models: dict[str, Path], setup: Setup) -> list[dict[str, Any]]:
    """Every measurement for every model: one row per model with the ratios.

    llama.cpp's tools run before and after autotune and their runs are pooled: on a shared
    machine the load drifts, and the bracket keeps autotune's numbers from being compared
    with a moment the machine was quieter or busier.
    """
    rows = []
    for label, model in models.items():
        bench_runs = [llama_bench_decode(model, setup)]
        batched_runs = [batched_bench(model, setup)]
        ours = {n: autotune_measure(model, setup, n) for n in setup.streams}
        bench_runs.append(llama_bench_decode(model, setup))
        batched_runs.append(batched_bench(model, setup))
        samples = [s for b in bench_runs for s in b["samples"]]
        bench = {
            "decode_tok_s": statistics.median(samples),
            "samples": samples,
            "spread": _spread(samples),
            "before_after": [b["decode_tok_s"] for b in bench_runs],
            "command": bench_runs[0]["command"],
        }
        batched = {}
        for n in setup.streams:
            runs = [r for b in batched_runs for r in b[n]["runs"]]
            batched[n] = {
                "e2e_tok_s": statistics.median(r["e2e_tok_s"] for r in runs),
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                "spread": _spread([r["e2e_tok_s"] for r in runs]),
                "before_after": [b[n]["e2e_tok_s"] for b in batched_runs],
                "runs": runs,
                "command": batched_runs[0][n]["command"],
            }
        single = ours[min(setup.streams)]
        rows.append(
            {
                "model": label,
                "file": str(model),
                "bytes": model.stat().st_size,
                "llama_bench": bench,
                "llama_batched_bench": {str(n): v for n, v in batched.items()},
                "autotune": {str(n): v for n, v in ours.items()},
                "decode_ratio": single["decode_tok_s"] / bench["decode_tok_s"],
                "aggregate_ratio": {
                    str(n): ours[n]["aggregate_tok_s"] / batched[n]["e2e_tok_s"] for n in setup.streams
                },
                # A constant cost per output token (sampling the vocabulary, detokenising, one SSE
                # event) shows as the same number here at every stream count.
                "extra_ms_per_token": {
                    "1": 1000 * (1 / single["decode_tok_s"] - 1 / bench["decode_tok_s"]),
                    **{
                        f"{n} streams": 1000 * (1 / ours[n]["aggregate_tok_s"] - 1 / batched[n]["e2e_tok_s"])
                        for n in setup.streams
                    },
                },
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]], setup: Setup) -> str:
    """The comparison as a Markdown table: autotune, llama.cpp's tool, autotune / tool."""
    lines = [
        f"ctx {setup.ctx}, flash-attn {'on' if setup.flash_attn else 'off'}, {setup.prompt_tokens}-token prompt, "
        f"{setup.output_tokens} output tokens, {setup.threads} threads (tok/s; medians)",
        "",
        "| model | quantity | autotune | llama.cpp tool (spread of its runs) | ratio | extra ms per "
        "output token | tool's decode-only S_TG | client CPU (cores) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        first = str(min(setup.streams))
        a, b = r["autotune"][first], r["llama_bench"]
        lines.append(
            f"| {r['model']} | single-stream decode vs llama-bench tg{setup.output_tokens} | "
            f"{a['decode_tok_s']:.1f} | {b['decode_tok_s']:.1f} ({100 * b['spread']:.0f}%) | "
            f"{r['decode_ratio']:.2f} | {r['extra_ms_per_token']['1']:.2f} | | {a['client_cores']:.2f} |"
        )
        for n in setup.streams:
            a, b = r["autotune"][str(n)], r["llama_batched_bench"][str(n)]
            lines.append(
                f"| {r['model']} | aggregate, {n} stream{'s' if n > 1 else ''} vs llama-batched-bench | "
                f"{a['aggregate_tok_s']:.1f} | {b['e2e_tok_s']:.1f} ({100 * b['spread']:.0f}%) | "
                f"{r['aggregate_ratio'][str(n)]:.2f} | {r['extra_ms_per_token'][f'{n} streams']:.2f} | "
                f"{b['decode_tok_s']:.1f} | {a['client_cores']:.2f} |"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=None,
        help="Where the synthetic models go (reused when present) [default: a temporary directory].",
    )
    parser.add_argument("--quant", default="Q8_0", help="Quantized copies to measure besides F16, comma-separated.")
    parser.add_argument("--json", type=Path, default=None, help="Write every number here.")
    parser.add_argument(
        "--runs",
        type=int,
        default=5,
        help="Runs of each llama.cpp tool, before and after autotune's (all pooled, median kept).",
    )
    parser.add_argument("--min-runs", type=int, default=5, help="autotune's fewest measured runs per configuration.")
    parser.add_argument("--max-runs", type=int, default=10, help="autotune's most measured runs per configuration.")
    args = parser.parse_args(argv)
    setup = Setup(
        bench_runs=args.runs,
        protocol=Protocol(
            warmup_runs=1, min_runs=args.min_runs, max_runs=max(args.max_runs, args.min_runs), rel_spread_tol=0.05
        ),
    )
    with tempfile.TemporaryDirectory(prefix="autotune-calibrate-") as tmp:
        models_dir = args.models_dir or Path(tmp)
        qtypes = [q.strip().upper() for q in args.quant.split(",") if q.strip()]
        models = make_models(models_dir, ISSUE_SHAPE, qtypes)
        started = time.monotonic()
        rows = calibrate(models, setup)
    table = format_table(rows, setup)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        server = engine.find_llama_server({}, arch="cpu")
        args.json.write_text(
            json.dumps(
                {
                    "setup": {**asdict(setup), "protocol": asdict(setup.protocol)},
                    "shape": asdict(ISSUE_SHAPE),
                    "engine": engine.engine_version(server).label,
                    "server": str(server),
                    "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
                    "seconds": round(time.monotonic() - started, 1),
                    "rows": rows,
                    "table": table,
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
