"""autotune drives llama-server as llama.cpp's own llama-bench runs the same graph.

The reduced form of bench/calibrate_llama_cpu.py: one small synthetic Llama, CPU, one thread
(the benchmark's two threads wait for each other every step, so on a loaded machine its runs
took minutes), flash attention, 64 output tokens, two runs each side. It needs a llama.cpp build with llama-bench (``autotune
engine build llama.cpp --cpu``): skipped without one, failed under AUTOTUNE_REQUIRE_ENGINE=1.

What it checks is what a lost decode would come from, none of it a speed: the thread count,
flash attention and layers passed as llama-bench gets them, no debug log level, a load
generator that leaves the engine its cores, and a decode rate read from the server's own
timings. The speed ratio itself is printed, not asserted: it is a benchmark's figure
(bench/calibrate_llama_cpu.py, interleaved rounds; issue 18 measured 0.90 for F16 and 0.88 for
Q8_0 on a quiet 2-core machine), and as an assertion it was decided by the machine's
neighbours: the same code measured 0.50 to 0.89 from one run to the next on the shared 2-core
VM, where one of the server's two threads descheduled halves every token (autotune's runs of
one test: 246-301 and 442-446 tok/s).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from autotune.errors import AutotuneError
from autotune.measure import Protocol
from autotune_plugins.llama_server import engine
from autotune_plugins.llama_server.synth import SynthSpec, write_model
from tests.conftest import REPO
from tests.engine_fixtures import cpu_build, missing

spec = importlib.util.spec_from_file_location("calibrate_llama_cpu", REPO / "bench" / "calibrate_llama_cpu.py")
calibrate = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = calibrate  # its dataclasses look their module up there
spec.loader.exec_module(calibrate)

# ~45M parameters with llama's 32k SPM vocabulary: a decode step of a few milliseconds on
# 2 cores, long enough that per-token server costs are a fraction, as on a real model.
SHAPE = SynthSpec(arch="llama", n_layers=4, hidden=512, n_heads=8, n_kv_heads=4, ffn=1536, context_length=2048)
SETUP = calibrate.Setup(
    output_tokens=64,
    streams=(1,),
    threads=1,
    bench_runs=2,
    protocol=Protocol(warmup_runs=1, min_runs=2, max_runs=2, rel_spread_tol=0.05),
)


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    build = cpu_build()
    try:
        engine.find_engine_tool("llama-bench", arch="cpu")
    except AutotuneError as exc:
        missing(str(exc))
    vocab = build.install_dir / "src" / "models" / "ggml-vocab-llama-spm.gguf"
    if not vocab.is_file():
        missing(f"{vocab} (the vocabulary the test model copies)")
    out = tmp_path_factory.mktemp("calibration") / "calib-f16.gguf"
    return write_model(SHAPE, out, vocab_from=vocab, seed=0).path


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_autotune_drives_the_engine_as_llama_bench_does(bench_model):
    ours = calibrate.autotune_measure(bench_model, SETUP, parallel=1)
    bench = calibrate.llama_bench_decode(bench_model, SETUP)
    served, benched = ours["command"].split(), bench["command"].split()
    for name in ("-t", "-fa", "-ngl"):
        assert flag(served, name) == flag(benched, name), (name, ours["command"], bench["command"])
    assert flag(served, "-t") == str(SETUP.threads)
    assert not {"-lv", "--verbosity", "-v", "--verbose", "--log-verbose"} & set(served), ours["command"]
    # The client's CPU time over the measurement's wall time: the HTTP, JSON and threads of the
    # load generator may not take a core from the engine's threads (0.08 measured beside 2).
    assert ours["client_cores"] < 0.5, ours
    assert ours["decode_tok_s"] > 0 and ours["runs"] >= SETUP.protocol.min_runs
    print(
        f"decode tok/s (a figure, not a verdict): autotune {ours['decode_tok_s']:.1f}, llama-bench "
        f"tg{SETUP.output_tokens} {bench['decode_tok_s']:.1f}, ratio {ours['decode_tok_s'] / bench['decode_tok_s']:.2f}"
    )
