"""llama-server's memory model against the H200 offload probe (bench/results/offload_probe_h200).

For each recorded launch (``--fit off``: the configurations autotune itself would launch) it
prints, per device, what :func:`autotune_plugins.llama_server.memory.estimate` predicts against
what llama.cpp logged (CUDA0 model / KV / compute; host: CPU_Mapped model + CPU KV + CUDA_Host
compute) and against NVML's figure for the server process (the GPU total, CUDA context
included). The model files are not kept, so the weights are llama-quantize's tensor plan for
the shapes the probe wrote (:func:`predict_gguf_weights`): their error is the plan's too.

    python bench/offload_memory_check.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from autotune.modelfiles.models import ModelSpec
from autotune_plugins.llama_server import memory
from autotune_plugins.llama_server.formats import predict_gguf_weights

MiB = 2**20
HERE = Path(__file__).resolve().parent / "results" / "offload_probe_h200"
VOCAB = 151936  # ggml-vocab-qwen2.gguf, which the probe's synth used

# The shapes of bench/h200_offload_probe.sh's `autotune synth` lines.
MODELS = {
    "q7b-Q4_K_M.gguf": ModelSpec(
        key="q7b",
        name="q7b",
        architecture="qwen2",
        n_layers=28,
        hidden_size=3584,
        n_heads=28,
        n_kv_heads=4,
        head_dim=128,
        ffn_size=18944,
        vocab_size=VOCAB,
        n_params=7_600_000_000,
        tie_embeddings=False,
        max_context=32768,
        source="bench/h200_offload_probe.sh",
    ),
    "q30a3b12-Q4_K_M.gguf": ModelSpec(
        key="q30a3b12",
        name="q30a3b12",
        architecture="qwen3moe",
        n_layers=12,
        hidden_size=2048,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        ffn_size=6144,
        vocab_size=VOCAB,
        n_params=7_900_000_000,
        tie_embeddings=False,
        max_context=32768,
        n_experts=128,
        n_experts_used=8,
        expert_ffn_size=768,
        source="bench/h200_offload_probe.sh",
    ),
}


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def rows() -> list[tuple[str, str, tuple[float, float | None], ...]]:
    """(probe, case, then (predicted, measured) MiB for CUDA0 model, CUDA0 KV, CUDA0 compute, host,
    CUDA0 logged, NVML) per recorded launch."""
    found = []
    for f in sorted(HERE.glob("offload_*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            argv, logged = r["argv"], r["buffers_mib"]
            if flag(argv, "--fit") == "on":
                continue  # llama.cpp chose the offload itself: not a configuration autotune launches
            model = MODELS[r["model"]]
            ngl = int(flag(argv, "-ngl", "999"))
            e = memory.estimate(
                model,
                predict_gguf_weights(model, "Q4_K_M"),
                int(flag(argv, "-c")),
                int(flag(argv, "-np", "1")),
                "f16",
                flag(argv, "-fa") == "on",
                ubatch=int(flag(argv, "-ub", "512")),
                gpu=True,
                gpu_layers=None if ngl >= 999 else ngl,
                n_cpu_moe=int(flag(argv, "--n-cpu-moe", "0")),
            )
            host = logged.get("CPU_Mapped model", 0) + logged.get("CPU KV", 0) + logged.get("CUDA_Host compute", 0)
            gpu_logged = logged.get("CUDA0 model", 0) + logged.get("CUDA0 KV", 0) + logged.get("CUDA0 compute", 0)
            found.append(
                (
                    f"{f.stem.removeprefix('offload_')}:{r['model'].split('-')[0]}",
                    " ".join(f"{k}={v}" for k, v in r["case"].items()),
                    (e.weights_bytes / MiB, logged.get("CUDA0 model", 0)),
                    (e.kv_bytes / MiB, logged.get("CUDA0 KV", 0)),
                    (e.buffers_bytes / MiB, logged.get("CUDA0 compute", 0)),
                    ((e.host_bytes + e.host_buffers_bytes) / MiB, host),
                    ((e.total_bytes - e.overhead_bytes) / MiB, gpu_logged),
                    (e.total_bytes / MiB, r.get("nvml_process_mib")),
                )
            )
    return found


def main() -> int:
    table = rows()

    def cell(pair: tuple[float, float | None]) -> str:
        p, m = pair
        if not m:
            return f"{p:8.1f}/{'-':>8}       "
        return f"{p:8.1f}/{m:8.1f} {100 * (p - m) / m:+5.1f}%"

    head = ("probe", "case", "CUDA0 model", "CUDA0 KV", "CUDA0 compute", "host (all)", "CUDA0 logged", "NVML")
    print(
        "predicted/measured MiB and error; host = CPU_Mapped model + CPU KV + CUDA_Host compute; CUDA0 logged = "
        "the three CUDA0 buffers; NVML = the predicted total (with the CUDA context and a MoE's pool) against "
        "NVML's figure for the server process"
    )
    print(
        "in-sample: STAGED_MLP_COEF, moe_ffn_coef and CUDA_MOE_POOL_BYTES were read from the moe rows; the dense "
        "rows and moe ngl=6 check them"
    )
    print(f"{head[0]:<16} {head[1]:<16} " + " ".join(f"{h:<24}" for h in head[2:]))
    worst = 0.0
    for name, case, *pairs in table:
        print(f"{name:<16} {case:<16} " + " ".join(f"{cell(p):<24}" for p in pairs))
        if pairs[-1][1]:
            worst = max(worst, abs(pairs[-1][0] - pairs[-1][1]) / pairs[-1][1])
    print(f"worst NVML error: {100 * worst:.1f}% over {len(table)} launches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
