"""autotune's single-stream decode through llama-server against llama.cpp's own llama-bench.

The reduced form of bench/calibrate_llama_cpu.py: one small synthetic Llama, CPU, 2 threads,
flash attention, 64 output tokens. It needs a llama.cpp build with llama-bench (``autotune
engine build llama.cpp --cpu``): skipped without one, failed under AUTOTUNE_REQUIRE_ENGINE=1.

The band. autotune's decode rate is the server's own ``predicted_per_second`` for one request,
decoded after a 16-token prompt; llama-bench's tg is the same graph decoding from an empty
cache with nothing else in the process. The server adds per-token work (sampling, the slot
loop, the HTTP thread) and a few more cache positions, so it should come out somewhat
*below* llama-bench: issue 18 measured 0.90 (F16) and 0.88 (Q8_0) on this kind of machine.

* Above 1.10: autotune would report a decode faster than the engine can go: the rate is
  not the decode (e.g. tokens counted wrong, prompt time left out of a denominator that
  should have it, a different model or thread count).
* Below 0.70: nearly a third of the engine lost to how autotune drives it: the load
  generator taking the engine's cores, threads not passed (``-t 1`` gives 0.5-0.65 on 2
  cores), a debug log level slowing the server. The margin under the 10-15 % the server
  itself costs is for a shared 2-core machine, where llama-bench's own runs of this model
  were seen 40 % apart; the two sides run interleaved and each side's median is compared.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

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
BAND = (0.70, 1.10)
SETUP = calibrate.Setup(output_tokens=64, streams=(1,), bench_runs=3,
                        protocol=Protocol(warmup_runs=1, min_runs=3, max_runs=5, rel_spread_tol=0.05))


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


ROUNDS = 4


def low_end(bench: list[float]) -> float:
    """The band's low end, lowered by what llama-bench's own passes say of the machine's noise
    (twice their MAD over their median): a gap inside that is a tie, not a loss. On a quiet
    machine (the passes within a few percent) it is BAND[0], where ``-t 1`` (0.5-0.65) fails;
    with the VM's neighbours busy, llama-bench alone ranged 202-490 tok/s in one test, and the
    same code measured 0.50-0.78 from one run to the next, before this change and after."""
    median = statistics.median(bench)
    mad = statistics.median(abs(b - median) for b in bench)
    return min(BAND[0], 1.0 - 2.0 * mad / median)


def test_single_stream_decode_is_within_the_band_of_llama_bench(bench_model):
    started = time.monotonic()
    # llama-bench and autotune interleaved (B A B A ... B) and each side's median taken: on a
    # shared 2-core machine one llama-bench pass of this model was seen 40 % off the next, so
    # a single bracket decided the verdict by luck.
    bench = [calibrate.llama_bench_decode(bench_model, SETUP)["decode_tok_s"]]
    ours = []
    # A ratio outside the band gets as many rounds again before the verdict, on the medians of
    # all: a neighbour's load on the shared machine once moved one side for a whole bracket
    # (0.68 in a full suite, 0.84-0.89 alone), while what the band guards against (-t 1, a
    # debug log level) stays out of it however long it is measured.
    for _ in range(2):
        for _ in range(ROUNDS):
            ours.append(calibrate.autotune_measure(bench_model, SETUP, parallel=1))
            bench.append(calibrate.llama_bench_decode(bench_model, SETUP)["decode_tok_s"])
        reference = statistics.median(bench)
        decode = statistics.median(o["decode_tok_s"] for o in ours)
        ratio = decode / reference
        low = low_end(bench)
        if low <= ratio <= BAND[1]:
            break
    ours_runs = ", ".join(f"{o['decode_tok_s']:.0f}" for o in ours)
    bench_runs = ", ".join(f"{b:.0f}" for b in bench)
    print(f"decode tok/s: autotune {decode:.1f} (runs {ours_runs}), "
          f"llama-bench tg{SETUP.output_tokens} {reference:.1f} (runs {bench_runs}), "
          f"ratio {ratio:.2f} (band {low:.2f}..{BAND[1]}); client used {max(o['client_cores'] for o in ours):.2f} cores at most; "
          f"{time.monotonic() - started:.0f} s")
    assert low <= ratio <= BAND[1], (
        f"autotune's decode is {ratio:.2f}x llama-bench's ({decode:.1f} vs {reference:.1f} tok/s, medians of "
        f"{len(ours)} and {len(bench)} interleaved passes), outside ({low:.2f}, {BAND[1]}): see this file's docstring for what each "
        f"side means; command: {ours[0]['command']}")
