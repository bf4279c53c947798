"""The llama_server plugin's synthetic models: GGUF contents, shapes, and llama.cpp loading them."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import click
import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from autotune import plugins
from autotune.errors import ConfigError
from autotune.modelfiles.models import model_from_gguf
from autotune_plugins.llama_server import synth
from autotune_plugins.llama_server.synth import SynthSpec, write_model
from tests.conftest import shared_file
from tests.engine_fixtures import cpu_build

REPO = Path(__file__).resolve().parents[2]
TINY = SynthSpec(arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, context_length=2048)


def _shared_dirs() -> list[Path]:
    dirs = [Path(os.environ["AUTOTUNE_SHARED"])] if os.environ.get("AUTOTUNE_SHARED") else []
    return dirs + [REPO.parent / "shared", Path("/work/shared")]


@pytest.fixture(scope="module")
def stories() -> Path:
    """llama.cpp CI's stories260K.gguf: a llama tokenizer of 512 tokens."""
    for d in _shared_dirs():
        if (d / "models" / "stories260K.gguf").is_file():
            return d / "models" / "stories260K.gguf"
    return shared_file("models/stories260K.gguf")


@pytest.fixture(scope="module")
def tiny(stories, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    write_model(TINY, out, vocab_from=stories, seed=1)
    return out


@pytest.fixture(scope="module")
def built_engine():
    """A complete llama.cpp build in the default cache (skip, or fail in CI)."""
    return cpu_build()


@pytest.fixture
def cli():
    import autotune_plugins.llama_server as module

    @click.group()
    def group():
        """A fresh group, so the real CLI keeps its commands."""

    plugins.register_plugin(module, name="llama_server", source="autotune")
    try:
        plugins.add_commands(group)
    finally:
        plugins.unregister_plugin("llama_server")
    return group


def fields(path: Path) -> tuple[dict, dict]:
    """A GGUF file's metadata fields and tensors, by name."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {k: f for k, f in reader.fields.items()}, {t.name: t for t in reader.tensors}


# ------------------------------------------------------------------ contents


def test_metadata(tiny):
    kv, _ = fields(tiny)
    expect = {
        "general.architecture": "llama",
        "llama.block_count": 2,
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.context_length": 2048,
        "llama.rope.dimension_count": 16,
        "llama.vocab_size": 512,
        "general.file_type": 1,  # MOSTLY_F16
    }
    for key, value in expect.items():
        assert kv[key].contents() == value, key
    assert kv["llama.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(1e-5)
    assert kv["llama.rope.freq_base"].contents() == pytest.approx(500000.0)
    assert "no meaningful output quality" in kv["general.description"].contents()


def test_tokenizer_copied_verbatim(tiny, stories):
    import gguf

    src = {k: f for k, f in gguf.GGUFReader(stories).fields.items() if k.startswith("tokenizer.")}
    kv, _ = fields(tiny)
    assert set(src) == {k for k in kv if k.startswith("tokenizer.")}
    for key, f in src.items():
        assert kv[key].types == f.types, key
        assert [bytes(kv[key].parts[i]) for i in kv[key].data] == [bytes(f.parts[i]) for i in f.data], key


def test_tensor_names_shapes_and_types(tiny):
    import gguf

    _, tensors = fields(tiny)
    # GGUF lists ne[0] first: a [out, in] matrix is stored as (in, out).
    expect = {
        "token_embd.weight": ((64, 512), "F16"),
        "blk.0.attn_norm.weight": ((64,), "F32"),
        "blk.0.attn_q.weight": ((64, 64), "F16"),
        "blk.0.attn_k.weight": ((64, 32), "F16"),
        "blk.0.attn_v.weight": ((64, 32), "F16"),
        "blk.0.attn_output.weight": ((64, 64), "F16"),
        "blk.1.ffn_norm.weight": ((64,), "F32"),
        "blk.1.ffn_gate.weight": ((64, 128), "F16"),
        "blk.1.ffn_up.weight": ((64, 128), "F16"),
        "blk.1.ffn_down.weight": ((128, 64), "F16"),
        "output_norm.weight": ((64,), "F32"),
        "output.weight": ((64, 512), "F16"),
    }
    for name, (shape, kind) in expect.items():
        t = tensors[name]
        assert tuple(int(d) for d in t.shape) == shape, name
        assert t.tensor_type == gguf.GGMLQuantizationType[kind], name
    assert len(tensors) == 1 + 2 * 9 + 2
    assert not any(".bias" in n for n in tensors)  # llama has no attention biases
    weights = np.asarray(tensors["blk.0.ffn_up.weight"].data, dtype=np.float32)
    assert np.isfinite(weights).all() and 0.015 < weights.std() < 0.025
    assert np.all(np.asarray(tensors["output_norm.weight"].data) == 1.0)


def test_model_from_gguf_agrees(tiny):
    m = model_from_gguf(tiny)
    assert (m.architecture, m.n_layers, m.hidden_size, m.n_heads, m.n_kv_heads, m.ffn_size, m.vocab_size) == (
        "llama",
        2,
        64,
        4,
        2,
        128,
        512,
    )
    assert m.head_dim == 16 and not m.tie_embeddings
    assert m.n_params == sum(t.n_elements for t in synth.tensor_plan(TINY, 512))


def test_qwen2_has_qkv_biases_and_tied_embeddings(stories, tmp_path):
    spec = SynthSpec(arch="qwen2", n_layers=1, hidden=64, n_heads=4, n_kv_heads=1, ffn=96, tie_embeddings=True)
    out = write_model(spec, tmp_path / "q.gguf", vocab_from=stories).path
    kv, tensors = fields(out)
    assert kv["qwen2.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(1e-6)
    assert tuple(int(d) for d in tensors["blk.0.attn_q.bias"].shape) == (64,)
    assert tuple(int(d) for d in tensors["blk.0.attn_k.bias"].shape) == (16,)
    assert "output.weight" not in tensors
    assert model_from_gguf(out).tie_embeddings


# A Qwen3-30B-A3B-like block in miniature: heads wider than hidden / heads, QK norms, a router
# and three expert tensors of 8 experts, 2 used per token.
TINY_MOE = SynthSpec(
    arch="qwen3moe",
    n_layers=2,
    hidden=64,
    n_heads=4,
    n_kv_heads=2,
    ffn=192,
    head_size=32,
    experts=8,
    experts_used=2,
    expert_ffn=48,
    context_length=2048,
)


def test_qwen3moe_tensors_and_metadata(stories, tmp_path):
    import gguf

    out = write_model(TINY_MOE, tmp_path / "moe.gguf", vocab_from=stories).path
    kv, tensors = fields(out)
    for key, value in {
        "general.architecture": "qwen3moe",
        "qwen3moe.expert_count": 8,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_feed_forward_length": 48,
        "qwen3moe.attention.key_length": 32,
        "qwen3moe.attention.value_length": 32,
        "qwen3moe.rope.dimension_count": 32,
        "qwen3moe.feed_forward_length": 192,
    }.items():
        assert kv[key].contents() == value, key
    # ne[0] first: llama.cpp's create_tensor shapes in src/models/qwen3moe.cpp.
    expect = {
        "blk.0.attn_q.weight": ((64, 128), "F16"),  # 4 heads x 32 = 128 wide, from hidden 64
        "blk.0.attn_k.weight": ((64, 64), "F16"),
        "blk.0.attn_output.weight": ((128, 64), "F16"),
        "blk.0.attn_q_norm.weight": ((32,), "F32"),
        "blk.0.attn_k_norm.weight": ((32,), "F32"),
        "blk.1.ffn_gate_inp.weight": ((64, 8), "F32"),
        "blk.1.ffn_gate_exps.weight": ((64, 48, 8), "F16"),
        "blk.1.ffn_up_exps.weight": ((64, 48, 8), "F16"),
        "blk.1.ffn_down_exps.weight": ((48, 64, 8), "F16"),
    }
    for name, (shape, kind) in expect.items():
        assert tuple(int(d) for d in tensors[name].shape) == shape, name
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType[kind], name
    assert not any(n.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", ".bias")) for n in tensors)
    m = model_from_gguf(out)
    assert (m.architecture, m.head_dim, m.q_dim) == ("qwen3moe", 32, 128)
    assert (m.n_experts, m.n_experts_used, m.expert_ffn_size, m.mlp_width) == (8, 2, 48, 96)
    assert m.n_params == sum(t.n_elements for t in synth.tensor_plan(TINY_MOE, 512))


def test_expert_fields_are_checked():
    with pytest.raises(ConfigError, match=r"experts: llama is a dense architecture \(a MoE one: qwen3moe\)"):
        SynthSpec(arch="llama", n_layers=1, hidden=64, n_heads=4, n_kv_heads=2, ffn=8, experts=4)
    with pytest.raises(ConfigError, match=r"experts_used: qwen3moe needs it.*expert_ffn: qwen3moe needs it"):
        SynthSpec(arch="qwen3moe", n_layers=1, hidden=64, n_heads=4, n_kv_heads=2, ffn=8, experts=4)
    with pytest.raises(ConfigError, match=r"experts_used = 5: at most experts \(4\)"):
        SynthSpec(
            arch="qwen3moe",
            n_layers=1,
            hidden=64,
            n_heads=4,
            n_kv_heads=2,
            ffn=8,
            experts=4,
            experts_used=5,
            expert_ffn=8,
        )
    # An explicit head size frees hidden from being a multiple of the heads, as in Qwen3.
    assert SynthSpec(arch="qwen3", n_layers=1, hidden=72, n_heads=4, n_kv_heads=2, ffn=8, head_size=32).head_dim == 32


def test_streaming_in_chunks_matches_one_shot(stories, tmp_path, monkeypatch):
    whole = write_model(TINY, tmp_path / "a.gguf", vocab_from=stories, seed=7).path
    # Chunks far smaller than a tensor, and not a divisor of its size: the layout must not change.
    monkeypatch.setattr(synth, "CHUNK_ELEMENTS", 1000)
    chunked = write_model(TINY, tmp_path / "b.gguf", vocab_from=stories, seed=7).path
    assert chunked.read_bytes() == whole.read_bytes()


def test_same_seed_same_file(stories, tmp_path):
    a = write_model(TINY, tmp_path / "a.gguf", vocab_from=stories, seed=3).path
    b = write_model(TINY, tmp_path / "b.gguf", vocab_from=stories, seed=3).path
    c = write_model(TINY, tmp_path / "c.gguf", vocab_from=stories, seed=4).path
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_bad_shapes_are_listed():
    with pytest.raises(ConfigError, match=r"hidden = 65: must be a multiple of heads \(4\)"):
        SynthSpec(arch="llama", n_layers=1, hidden=65, n_heads=4, n_kv_heads=2, ffn=8)
    with pytest.raises(ConfigError, match=r"kv_heads = 3: must divide heads"):
        SynthSpec(arch="llama", n_layers=1, hidden=64, n_heads=4, n_kv_heads=3, ffn=8)
    with pytest.raises(ConfigError, match=r"arch 'gpt2'.*n_layers = 0"):
        SynthSpec(arch="gpt2", n_layers=0, hidden=64, n_heads=4, n_kv_heads=2, ffn=8)


def test_existing_output_is_not_overwritten(tiny, stories):
    with pytest.raises(ConfigError, match="already exists"):
        write_model(TINY, tiny, vocab_from=stories)


def test_vocab_without_tokenizer(tmp_path, tiny):
    import gguf

    bare = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(bare, "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(ConfigError, match="no tokenizer.ggml.tokens"):
        write_model(TINY, tmp_path / "x.gguf", vocab_from=bare)


def test_find_vocab_error_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="--vocab-from"):
        synth.find_vocab("qwen2", cache_dir=tmp_path)


def test_cli_writes_the_model(cli, stories, tmp_path):
    out = tmp_path / "cli.gguf"
    result = CliRunner().invoke(
        cli,
        [
            "synth",
            "--arch",
            "llama",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--ffn",
            "128",
            "--vocab-from",
            str(stories),
            "--out",
            str(out),
            "--seed",
            "5",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "vocab 512" in result.output
    assert model_from_gguf(out).vocab_size == 512
    again = CliRunner().invoke(
        cli,
        [
            "synth",
            "--arch",
            "llama",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--ffn",
            "128",
            "--vocab-from",
            str(stories),
            "--out",
            str(out),
        ],
    )
    assert again.exit_code == 2 and "already exists" in again.output


def test_cli_help_warns_about_quality(cli):
    result = CliRunner().invoke(cli, ["synth", "--help"])
    assert "real speed and memory behaviour" in result.output
    assert "no meaningful quality" in result.output


def test_unknown_quantization_type(tiny):
    with pytest.raises(ConfigError, match=r"'Q5_X'.*Q4_K_M"):
        synth.quantize(tiny, "Q5_X")


# ------------------------------------------------------------------ disk space


def _free(n: int):
    return lambda path: shutil._ntuple_diskusage(total=10 * n + 1, used=9 * n, free=n)


def test_states_what_it_will_write(stories, tmp_path):
    said: list[str] = []
    result = write_model(TINY, tmp_path / "m.gguf", vocab_from=stories, quantize=("Q8_0", "Q4_K_M"), say=said.append)
    [line] = said
    assert "m.gguf" in line and "m-Q8_0.gguf" in line and "m-Q4_K_M.gguf" in line and "free there" in line
    tokenizer, n_vocab = synth.read_tokenizer(stories)
    plan = synth.disk_plan(TINY, tmp_path / "m.gguf", tokenizer=tokenizer, n_vocab=n_vocab, quantize=("Q8_0",))
    f16, q8 = plan.files[0][1], plan.files[1][1]
    # Never below the real file (the check must not pass a model that does not fit), a small header over.
    assert result.size_bytes <= f16 <= 1.1 * result.size_bytes
    assert q8 < f16 and plan.total_bytes == f16 + q8


def test_refuses_to_fill_the_disk(stories, tmp_path, monkeypatch):
    monkeypatch.setattr(synth.shutil, "disk_usage", _free(100_000))
    out = tmp_path / "sub" / "m.gguf"  # a directory that does not exist yet: its parent's file system
    with pytest.raises(ConfigError, match=r"not enough disk space: will write 0\.\d MiB .*0\.1 MiB free") as info:
        write_model(TINY, out, vocab_from=stories, quantize=("Q8_0",))
    assert "m-Q8_0.gguf" in str(info.value) and "--out" in str(info.value)
    assert not out.exists() and not out.with_name("m.gguf.partial").exists()


def test_quantize_checks_the_space_before_running(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(synth.shutil, "disk_usage", _free(1000))
    with pytest.raises(ConfigError, match="not enough disk space"):
        synth.quantize(tiny, "Q8_0", out=tmp_path / "q.gguf", binary=tmp_path / "never-run")


# ------------------------------------------------------------------ with the built engine


def test_quantize(tiny, built_engine, tmp_path, engine_plugins):  # the llama-server plugin quotes a GGUF file
    import gguf

    for qtype in ("Q8_0", "Q4_0"):
        out = synth.quantize(
            tiny, qtype, out=tmp_path / f"tiny-{qtype}.gguf", binary=built_engine.quantize, timeout_s=120
        )
        reader = gguf.GGUFReader(out)
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["blk.0.ffn_up.weight"] == qtype
        assert types["blk.0.attn_norm.weight"] == "F32"
        assert model_from_gguf(out).artifact_bytes == {f"gguf:{qtype}": out.stat().st_size}
        tokenizer, n_vocab = synth.read_tokenizer(tiny)
        [_, (_, estimated, _)] = synth.disk_plan(
            TINY, tiny, tokenizer=tokenizer, n_vocab=n_vocab, quantize=(qtype,)
        ).files
        assert abs(estimated - out.stat().st_size) <= 0.1 * out.stat().st_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_until_healthy(server: Path, model: Path, timeout_s: float = 60.0) -> str:
    port = _free_port()
    # Its own session, so the whole process group can be killed whatever happens.
    proc = subprocess.Popen(
        [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "256", "-t", "1", "-np", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited with {proc.returncode}:\n{proc.stdout.read().decode()[-3000:]}")
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if r.status_code == 200 and r.json().get("status") == "ok":
                    reply = httpx.post(
                        f"http://127.0.0.1:{port}/completion",
                        json={"prompt": "Once upon a time", "n_predict": 8},
                        timeout=30,
                    )
                    assert reply.status_code == 200, reply.text
                    return reply.json()["content"]
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.25)
        pytest.fail(f"llama-server not healthy after {timeout_s:.0f}s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died on its own: the failure above says why
        proc.wait()


@pytest.mark.parametrize("qtype", [None, "Q4_0"])
def test_llama_server_loads_the_synthetic_model(tiny, built_engine, tmp_path, qtype):
    model = (
        tiny
        if qtype is None
        else synth.quantize(tiny, qtype, out=tmp_path / f"m-{qtype}.gguf", binary=built_engine.quantize, timeout_s=120)
    )
    text = _serve_until_healthy(built_engine.server, model)
    assert isinstance(text, str)  # gibberish, but generated: no NaN abort, no load failure


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_llama_server_loads_a_synthetic_moe(built_engine, tmp_path, qtype):
    """llama.cpp's loader accepts every tensor of the qwen3moe plan (it names any it misses),
    quantized copies too, and generates from them."""
    model = write_model(TINY_MOE, tmp_path / "moe.gguf", vocab_from=synth.find_vocab("qwen3moe")).path
    if qtype:
        model = synth.quantize(
            model, qtype, out=tmp_path / f"moe-{qtype}.gguf", binary=built_engine.quantize, timeout_s=120
        )
    assert isinstance(_serve_until_healthy(built_engine.server, model), str)


def test_llama_cpp_vocab_files(built_engine, tmp_path):
    """Both shipped vocab files give models llama.cpp accepts, with their full vocabularies."""
    for arch, n_vocab in (("llama", 128256), ("qwen2", 151936)):
        vocab = synth.find_vocab(arch)
        spec = SynthSpec(arch=arch, n_layers=1, hidden=64, n_heads=4, n_kv_heads=2, ffn=128)
        result = write_model(spec, tmp_path / f"{arch}.gguf", vocab_from=vocab)
        assert result.n_vocab == n_vocab == model_from_gguf(result.path).vocab_size
        _serve_until_healthy(built_engine.server, result.path)


def test_memory_stays_bounded(stories, tmp_path, monkeypatch):
    """Tensors are streamed: peak memory follows the chunk, not the largest tensor."""
    import tracemalloc

    monkeypatch.setattr(synth, "CHUNK_ELEMENTS", 2**20)  # 4 MB of float32 per chunk
    spec = SynthSpec(arch="llama", n_layers=1, hidden=2048, n_heads=16, n_kv_heads=4, ffn=8192)
    tracemalloc.start()
    try:
        result = write_model(spec, tmp_path / "big.gguf", vocab_from=stories)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    largest = max(t.nbytes for t in synth.tensor_plan(spec, 512))
    assert largest == 2048 * 8192 * 2  # 32 MiB: held whole, it would dominate the peak
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    assert result.size_bytes > sum(t.nbytes for t in synth.tensor_plan(spec, 512))
