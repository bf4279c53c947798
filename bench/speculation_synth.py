"""Decode speed against acceptance on a random-weight model, through llama.cpp's synthetic
acceptance (``--spec-synth-len``, benchmarking only: drafts are accepted at random so that the
mean accepted length is the one asked for; the output is not valid text).

A random-weight model's draft is never accepted on its own, so speculation can only be priced
on it synthetically: this script launches llama-server (through the backend's own command line)
with stories260K (its vocabulary, 50x fewer parameters) as the draft, at n-max N and a synthetic mean length from 1 (nothing
accepted) to N + 1 (everything), and prints the engine's decode rate and its own acceptance
counters beside the run without speculation. What it shows: the acceptance the engine reports
follows the one asked for, and where speculation starts to pay on this machine.

    python bench/speculation_synth.py               # a 13M-parameter Llama shape, n-max 4
    python bench/speculation_synth.py --n-max 6 --tokens 256

It needs a llama.cpp build (`autotune engine build llama.cpp --cpu`). Figures are of the machine
it runs on; say which when quoting them.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

from autotune.toolkit import processes
from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.measure.streams import fetch
from autotune.modelfiles.models import model_from_gguf
from autotune_plugins.llama_server.backend import LlamaServerBackend
from autotune_plugins.llama_server.synth import SynthSpec, write_model

STORIES = Path(__file__).resolve().parents[1] / "tests" / "data" / "stories260K.gguf"
TINY = SynthSpec(arch="llama", n_layers=4, hidden=512, n_heads=8, n_kv_heads=4, ffn=1536, context_length=2048)


def run(model: Path, n_max: int, synth_len: float | None, tokens: int, threads: int, log_dir: Path) -> dict:
    backend = LlamaServerBackend()
    settings = {"threads": threads, "startup_timeout_s": 60, "pin_cores": False}
    if synth_len is not None:
        settings["spec_synth_len"] = synth_len
    ctx = StudyContext(
        gpu=get_gpu("t4"),
        model=model_from_gguf(model),
        workload=Workload(16, tokens),
        vram_budget_bytes=2**34,
        protocol=Protocol(),
        settings=settings,
        base_dir=model.parent,
    )
    options = [("cache_type", "f16"), ("flash_attn", True)]
    if synth_len is not None:
        options += [("draft", str(STORIES)), ("spec_n_max", n_max), ("spec_type", "draft-simple")]
    config = TrialConfig("llama-server", str(model), 512, 1, tuple(sorted(options)))
    server = backend.launch(config, ctx, False, log_dir)
    try:
        backend.wait_ready(server, 60)
        rates, drafted, accepted = [], 0, 0
        for i in range(3):
            r = fetch(
                server.http,
                "POST",
                f"{server.url}/completion",
                120,
                setting="completion",
                json={
                    "prompt": f"{i} Once upon a time",
                    "n_predict": tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                    "cache_prompt": False,
                },
            )
            t = r.json()["timings"]
            rates.append(float(t["predicted_per_second"]))
            drafted += int(t.get("draft_n", 0))
            accepted += int(t.get("draft_n_accepted", 0))
    finally:
        server.close()
        processes.stop(server.proc)
    rates.sort()
    return {"decode_tok_s": rates[1], "drafted": drafted, "accepted": accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-max", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(TINY, Path(tmp) / "tiny-f16.gguf", vocab_from=STORIES, seed=0).path
        print(
            f"machine: {platform.node()} ({platform.processor() or platform.machine()}), {args.threads} thread(s); "
            f"model: random 13M Llama (F16), draft stories260K, n-max {args.n_max}, {args.tokens} tokens x 3 (median)"
        )
        base = run(model, args.n_max, None, args.tokens, args.threads, Path(tmp))
        print(f"{'synth len':>10} {'decode tok/s':>13} {'vs none':>8} {'drafted':>8} {'accepted':>9} {'rate':>6}")
        print(f"{'none':>10} {base['decode_tok_s']:13.1f} {1.0:8.2f}")
        for step in range(args.n_max + 1):
            length = 1 + step
            r = run(model, args.n_max, float(length), args.tokens, args.threads, Path(tmp))
            rate = r["accepted"] / r["drafted"] if r["drafted"] else float("nan")
            print(
                f"{length:>10} {r['decode_tok_s']:13.1f} {r['decode_tok_s'] / base['decode_tok_s']:8.2f} "
                f"{r['drafted']:8d} {r['accepted']:9d} {rate:6.2f}"
            )


if __name__ == "__main__":
    main()
