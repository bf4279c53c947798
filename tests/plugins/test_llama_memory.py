"""The memory model against llama-server's own start-up figures, on the CPU.

llama.cpp logs the bytes of each buffer it allocates (``-lv 4``): model, KV cache, compute.
Each configuration here is launched for real and its log compared with autotune's estimate.
Goals (issue: a memory model you can trust): weights and KV within 1%, total within 5%.
"""

from __future__ import annotations

import shutil

import pytest

from autotune.engine.backend import TrialConfig
from autotune.modelfiles.models import model_from_gguf
from autotune_plugins.llama_server.formats import gguf_file_weights
from autotune_plugins.llama_server import memory
from autotune.toolkit import processes
from autotune_plugins.llama_server.backend import LlamaServerBackend, parse_log
from autotune_plugins.llama_server.synth import SynthSpec, quantize, write_model
from tests.conftest import shared_file
from tests.engine_fixtures import cpu_build
from tests.plugins.test_llama_server_backend import make_ctx, servers_on

MiB = 2**20

SHAPES = {
    # 13M parameters, llama: MLP-dominated activations.
    "tiny": SynthSpec(arch="llama", n_layers=4, hidden=512, n_heads=8, n_kv_heads=4, ffn=1536, context_length=8192),
    # Qwen2 0.5B widths on 4 layers, the real 151,936-token vocabulary, tied head.
    "qwen": SynthSpec(
        arch="qwen2",
        n_layers=4,
        hidden=896,
        n_heads=14,
        n_kv_heads=2,
        ffn=4864,
        context_length=32768,
        tie_embeddings=True,
    ),
    # A mixture of experts (qwen3moe): 16 experts, 4 used, so a token's MLP is 4 x 256 wide, not
    # the 512 its feed_forward_length says: the compute buffer must follow the experts.
    "moe": SynthSpec(
        arch="qwen3moe",
        n_layers=2,
        hidden=256,
        n_heads=4,
        n_kv_heads=2,
        ffn=512,
        head_size=64,
        experts=16,
        experts_used=4,
        expert_ffn=256,
        context_length=8192,
    ),
}

# (model file, ctx per sequence, parallel, cache type, flash attention, ubatch)
CASES = [
    ("stories260K.gguf", 512, 1, "f16", True, 512),
    ("stories260K.gguf", 4096, 4, "f16", True, 512),
    ("stories260K.gguf", 4096, 1, "f16", False, 512),
    ("stories260K.gguf", 1000, 3, "f16", False, 256),
    ("tiny-f16.gguf", 4096, 1, "f16", True, 512),
    ("tiny-f16.gguf", 1024, 4, "f16", False, 512),
    ("tiny-f16.gguf", 2048, 2, "q8_0", True, 128),
    ("tiny-f16-Q5_0.gguf", 3000, 2, "q4_0", True, 512),
    ("tiny-f16-Q6_K.gguf", 2048, 4, "f16", False, 256),
    ("qwen-f16.gguf", 4096, 1, "f16", True, 512),
    ("qwen-f16.gguf", 2048, 2, "q8_0", True, 256),
    ("qwen-f16.gguf", 1024, 4, "f16", False, 512),
    ("qwen-f16-Q8_0.gguf", 4096, 2, "f16", True, 512),
    ("qwen-f16-Q5_K_M.gguf", 2048, 1, "q4_0", True, 512),
    ("moe-f16.gguf", 2048, 1, "f16", True, 512),
    ("moe-f16-Q8_0.gguf", 4096, 2, "f16", False, 256),
    ("moe-f16-Q6_K.gguf", 1024, 3, "q8_0", True, 128),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    build = cpu_build()
    root = tmp_path_factory.mktemp("vram-models")
    shutil.copy(shared_file("models/stories260K.gguf"), root / "stories260K.gguf")
    qwen_vocab = build.install_dir / "src" / "models" / "ggml-vocab-qwen2.gguf"
    vocab = {"llama": root / "stories260K.gguf", "qwen2": qwen_vocab, "qwen3moe": root / "stories260K.gguf"}
    for name, spec in SHAPES.items():
        f16 = write_model(spec, root / f"{name}-f16.gguf", vocab_from=vocab[spec.arch], seed=0).path
        # Not Q4_0/Q4_K: a CPU build repacks those into a second, interleaved copy for its SIMD
        # kernels (CPU_REPACK in the log), a host-RAM layout no GPU build has.
        for case in CASES:
            if case[0].startswith(f"{name}-f16-"):
                quantize(f16, case[0].removesuffix(".gguf").rsplit("-", 1)[1], binary=build.quantize, timeout_s=300)
    return root


@pytest.mark.parametrize(
    "name, ctx, parallel, cache, fa, ub",
    CASES,
    ids=[f"{c[0].removesuffix('.gguf')}-c{c[1]}x{c[2]}-{c[3]}-fa{int(c[4])}-ub{c[5]}" for c in CASES],
)
def test_estimate_matches_the_engines_own_figures(models, name, ctx, parallel, cache, fa, ub):
    path = models / name
    model = model_from_gguf(path)
    predicted = memory.estimate(model, gguf_file_weights(path), ctx, parallel, cache, fa, ubatch=ub, gpu=False)

    # The engine's figures: launch it with exactly these flags and read its log.
    backend = LlamaServerBackend()
    c = make_ctx(path)
    config = TrialConfig(
        "llama-server", name, ctx, parallel, (("cache_type", cache), ("flash_attn", fa), ("ubatch", ub))
    )
    server = backend.launch(config, c, False, models, verbose=True)
    try:
        backend.wait_ready(server, 120)
        logged = parse_log(server.log())
    finally:
        processes.stop(server.proc)
    assert "CPU_REPACK" not in logged["model_buffer_mib"], "a repacked type: the CPU layout differs from a GPU's"
    weights = sum(logged["model_buffer_mib"].values()) * MiB
    kv = sum(logged["kv_buffer_mib"].values()) * MiB
    compute = sum(logged["compute_buffer_mib"].values()) * MiB
    total = weights + kv + compute

    def err(a: float, b: float) -> float:
        return abs(a - b) / b

    # The log prints MiB with 2 decimals: allow that rounding on small buffers.
    assert err(predicted.weights_bytes, weights) <= 0.01 or abs(predicted.weights_bytes - weights) <= 0.006 * MiB
    assert err(predicted.kv_bytes, kv) <= 0.01 or abs(predicted.kv_bytes - kv) <= 0.006 * MiB
    assert err(predicted.total_bytes, total) <= 0.05, (
        f"compute predicted {predicted.buffers_bytes / MiB:.2f} MiB, logged {compute / MiB:.2f}"
    )
    assert logged["kv_cells"] == memory.LAYOUT.cells(ctx, parallel)
    assert servers_on(path) == []
