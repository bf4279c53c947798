"""Synthetic GGUF models: random weights in the exact shape of a real architecture.

A model of a given architecture and shape costs llama.cpp the same memory and time whatever
its weights are: the same tensors are read per token, the same KV cache is allocated, the
same kernels run. A random-weight file therefore lets a study measure speed and memory on a
machine that never downloaded the real model, at any size (a 32B shape is written in minutes).
Its output is gibberish: it has no meaningful quality and must never be used to measure one.

The file has what llama.cpp's loader checks: the architecture's metadata keys, a real
tokenizer (every ``tokenizer.*`` key copied from a vocab-only GGUF that llama.cpp ships in
``models/``, e.g. ``ggml-vocab-llama-bpe.gguf``), and tensors with llama.cpp's names and
shapes, in F16 with F32 norms and biases, as ``convert_hf_to_gguf.py --outtype f16`` writes
them. Tensors are generated and written one chunk at a time, so memory stays at tens of MB
even for a 14 GB file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autotune._builtin import processes
from autotune.api import AutotuneError
from autotune._builtin import ConfigError
from autotune_plugins.llama_server.gguf_tokenizer import read_tokenizer
from autotune_plugins.llama_server.synth_shapes import ARCH_DEFAULTS, SynthSpec, TensorPlan, tensor_plan

__all__ = [
    "ARCH_DEFAULTS",
    "DiskPlan",
    "SynthResult",
    "SynthSpec",
    "TensorPlan",
    "disk_plan",
    "find_vocab",
    "quantize",
    "quantize_types",
    "read_tokenizer",
    "quantized_path",
    "tensor_plan",
    "write_model",
]

# Standard deviation of the weights: the usual initialiser scale (GPT-2, Llama's
# initializer_range = 0.02). With unit norms it keeps activations and logits small, so
# generation yields finite numbers at any depth instead of NaN.
WEIGHT_STD = 0.02
# Elements generated per chunk (16 MB as float32): memory stays bounded whatever the tensor size,
# and chunks stay large enough that numpy, not Python, sets the pace.
CHUNK_ELEMENTS = 4 * 2**20

_F16 = 1  # gguf.LlamaFileType.MOSTLY_F16: "all F16 except 1-d tensors"


@dataclass(frozen=True)
class SynthResult:
    """A written model.

    Attributes:
        path: The ``.gguf`` file.
        size_bytes: Its size.
        n_params: Parameters (all tensor elements).
        n_vocab: Tokens in the tokenizer (= rows of ``token_embd.weight``).
    """

    path: Path
    size_bytes: int
    n_params: int
    n_vocab: int


# --------------------------------------------------------------------------------------
# Tokenizer (read by :mod:`~autotune_plugins.llama_server.gguf_tokenizer`)
# --------------------------------------------------------------------------------------


def find_vocab(arch: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Finds llama.cpp's vocab-only GGUF for an architecture.

    Looks in the sources of builds made by ``autotune engine build llama.cpp``
    (``<build>/src/models/``), then in downloaded llama-cpp-python sdists, from which the one
    file is extracted into ``<engines>/vocab/``.

    Args:
        arch: "llama" (``ggml-vocab-llama-bpe.gguf``, Llama 3's tokenizer) or "qwen2".
        cache_dir: The engines directory; default ``engine.engines_dir()``.

    Returns:
        The vocab file.

    Raises:
        ConfigError: Not found; the message says to pass --vocab-from or build the engine.
    """
    from autotune_plugins.llama_server import engine

    if arch not in ARCH_DEFAULTS:
        raise ConfigError(f"arch {arch!r}: use one of {', '.join(sorted(ARCH_DEFAULTS))}")
    name = ARCH_DEFAULTS[arch]["vocab_file"]
    root = engine.engines_dir(cache_dir)
    for candidate in sorted(root.glob(f"llama.cpp-*/src/models/{name}"), reverse=True):
        if candidate.is_file():
            return candidate
    extracted = root / "vocab" / name
    if extracted.is_file():
        return extracted
    for sdist in sorted((root / "downloads").glob("llama_cpp_python-*.tar.gz"), reverse=True):
        try:
            with tarfile.open(sdist) as tar:
                for member in tar:
                    if member.isfile() and member.name.endswith(f"/vendor/llama.cpp/models/{name}"):
                        src = tar.extractfile(member)
                        if src is None:
                            continue
                        extracted.parent.mkdir(parents=True, exist_ok=True)
                        tmp = extracted.with_suffix(".partial")
                        with src, tmp.open("wb") as dst:
                            shutil.copyfileobj(src, dst)
                        tmp.replace(extracted)
                        return extracted
        except (tarfile.TarError, OSError):
            continue  # a broken download: try the next
    raise ConfigError(
        f"no {name} found in {root}: pass --vocab-from PATH (any GGUF with a tokenizer), "
        "or run `autotune engine build llama.cpp` first, which keeps llama.cpp's vocab files"
    )


# --------------------------------------------------------------------------------------
# Disk space
# --------------------------------------------------------------------------------------

GiB = 2**30
# GGUFWriter's default data alignment (general.alignment): each tensor starts on it.
_ALIGN = 32


@dataclass(frozen=True)
class DiskPlan:
    """What ``synth`` will write, file by file, and the free space where it goes.

    Attributes:
        directory: Where the files go (the free space is that file system's).
        files: ``(path, bytes, how the size is known)`` for the model and each quantized copy.
        free_bytes: Free space on ``directory``'s file system now.
    """

    directory: Path
    files: tuple[tuple[Path, int, str], ...]
    free_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.files)

    def describe(self) -> str:
        parts = ", ".join(f"{path.name} {_size(size)} ({how})" for path, size, how in self.files)
        return f"will write {_size(self.total_bytes)} to {self.directory}: {parts}; {_size(self.free_bytes)} free there"

    def check(self) -> None:
        """Raises ConfigError when the files do not fit the free space."""
        if self.total_bytes > self.free_bytes:
            raise ConfigError(
                f"--out {self.directory}: not enough disk space: {self.describe()}. Free "
                f"{_size(self.total_bytes - self.free_bytes)} more, choose another --out, "
                "or ask for fewer --quantize copies"
            )


def _header_bytes(tokenizer: list[tuple[str, Any, Any, Any]], plan: list[TensorPlan]) -> int:
    """The GGUF header, key/value section and tensor index, about: the tokenizer (strings as
    length + bytes, numbers at 8 bytes at most) is most of it; 4 KiB covers the architecture
    keys and the alignment padding."""
    total = 4096
    for key, value, _vtype, _sub in tokenizer:
        total += 8 + len(key) + 4 + 12
        items = value if isinstance(value, list) else [value]
        total += sum(8 + len(v) if isinstance(v, bytes) else 8 for v in items)
    return total + sum(8 + len(t.name) + 4 + 8 * len(t.shape) + 4 + 8 for t in plan)


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def quantized_path(model: str | os.PathLike[str], qtype: str) -> Path:
    """Where :func:`quantize` writes ``qtype`` by default: ``<stem>-<TYPE>.gguf`` beside it."""
    src = Path(model)
    return src.with_name(f"{src.stem}-{qtype.upper()}.gguf")


def _as_model(spec: SynthSpec, n_vocab: int) -> Any:
    from autotune.api import ModelSpec

    return ModelSpec(
        key=spec.name,
        name=spec.name,
        architecture=spec.arch,
        n_layers=spec.n_layers,
        hidden_size=spec.hidden,
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
        ffn_size=spec.ffn,
        vocab_size=n_vocab,
        n_params=sum(t.n_elements for t in tensor_plan(spec, n_vocab)),
        tie_embeddings=spec.tie_embeddings,
        max_context=spec.context_length,
        source="autotune synth",
    )


def _quantized_bytes(model: Any, qtype: str, unquantized_bytes: int) -> tuple[int, str]:
    """Tensor bytes of a ``qtype`` copy (autotune.engine.formats' per-tensor types), or the
    unquantized size as a bound for a type it has no table for."""
    from autotune._builtin import UnknownNameError
    from autotune_plugins.llama_server.formats import predict_gguf_weights

    try:
        return predict_gguf_weights(model, qtype).total_bytes, "estimated"
    except UnknownNameError:
        return unquantized_bytes, "no size table for this type: counted at the unquantized size"


def _free_bytes(directory: Path) -> tuple[Path, int]:
    """Free space of the file system ``directory`` will be on (it may not exist yet)."""
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return directory.absolute(), shutil.disk_usage(existing).free


def disk_plan(
    spec: SynthSpec,
    out: str | os.PathLike[str],
    *,
    tokenizer: list[tuple[str, Any, Any, Any]],
    n_vocab: int,
    quantize: tuple[str, ...] = (),
) -> DiskPlan:
    """The bytes ``synth`` will write (the F16 model, exactly but for the header; each
    quantized copy, estimated) and the free space where they go.

    Args:
        spec: The model's shape.
        out: The model's path; quantized copies go beside it (:func:`quantized_path`).
        tokenizer: The keys :func:`read_tokenizer` returned (their size is the header's).
        n_vocab: Tokens in the tokenizer.
        quantize: Types that will be made from the model afterwards.
    """
    out_path = Path(out)
    plan = tensor_plan(spec, n_vocab)
    header = _header_bytes(tokenizer, plan)
    f16 = header + sum(-(-t.nbytes // _ALIGN) * _ALIGN for t in plan)
    files = [(out_path, f16, "F16 matrices, F32 norms")]
    if quantize:
        model = None if spec.is_moe else _as_model(spec, n_vocab)
        for qtype in quantize:
            if model is None:
                # The size tables know dense blocks only: a copy is no larger than its source.
                size, how = f16 - header, "MoE: counted at the unquantized size, an upper bound"
            else:
                size, how = _quantized_bytes(model, qtype, f16 - header)
            files.append((quantized_path(out_path, qtype), header + size, how))
    directory, free = _free_bytes(out_path.parent)
    return DiskPlan(directory, tuple(files), free)


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


def _chunks(t: TensorPlan, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's values in row-major order, at most CHUNK_ELEMENTS at a time."""
    n = t.n_elements
    for start in range(0, n, CHUNK_ELEMENTS):
        size = min(CHUNK_ELEMENTS, n - start)
        if t.fill == "ones":
            yield np.ones(size, dtype=t.dtype)
        else:
            # float32 draws are twice as fast as float64 and exact enough for an F16 target.
            values = rng.standard_normal(size, dtype=np.float32)
            values *= WEIGHT_STD
            yield values.astype(t.dtype, copy=False)


def gguf_writer(path: Path, spec: SynthSpec, tokenizer: Sequence[Any], n_vocab: int, plan: Sequence[TensorPlan]) -> Any:
    """A ``gguf.GGUFWriter`` on ``path`` holding a synthetic model's metadata, tokenizer and tensor
    table, nothing written yet: what ``write_model`` fills with weights (and
    bench/offload_grid_models.py leaves as a hole)."""
    import gguf

    defaults = ARCH_DEFAULTS[spec.arch]
    w = gguf.GGUFWriter(path, spec.arch)
    w.add_name(spec.name)
    w.add_description(
        "Random weights written by `autotune synth`: real speed and memory behaviour, no meaningful output quality."
    )
    w.add_block_count(spec.n_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_layer_norm_rms_eps(defaults["rms_eps"])
    w.add_rope_freq_base(defaults["rope_freq_base"])
    w.add_rope_dimension_count(spec.head_dim)
    if spec.head_size is not None:
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    if spec.is_moe:
        w.add_expert_count(spec.experts)
        w.add_expert_used_count(spec.experts_used)
        w.add_expert_feed_forward_length(spec.expert_ffn)
    w.add_vocab_size(n_vocab)
    w.add_file_type(_F16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in tokenizer:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in plan:
        w.add_tensor_info(t.name, t.shape, np.dtype(t.dtype), t.nbytes)

    return w


def write_model(
    spec: SynthSpec,
    out: str | os.PathLike[str],
    *,
    vocab_from: str | os.PathLike[str],
    seed: int = 0,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    quantize: tuple[str, ...] = (),
    say: Callable[[str], None] | None = None,
) -> SynthResult:
    """Writes a random-weight GGUF model.

    The model has the speed and memory behaviour of a real model of this shape but no
    meaningful output quality.

    The file is written to ``<out>.partial`` and renamed when complete, so an interrupted
    run never leaves a truncated model under the final name.

    Args:
        spec: Architecture and shape.
        out: Output path.
        vocab_from: GGUF whose ``tokenizer.*`` keys are copied; the vocabulary size is its token
            count.
        seed: Seed of the weights; the same seed writes the same file.
        overwrite: Replace an existing ``out``; without it an existing file is an error.
        progress: Called with (tensors written, tensors total).
        quantize: Types the caller will make from the model afterwards (:func:`quantize`,
            default output path): their estimated sizes count in the disk check.
        say: Told, before anything is written, what will be written and the free space.

    Returns:
        What was written.

    Raises:
        ConfigError: ``out`` exists, ``vocab_from`` has no tokenizer, or the files would not
            fit the free disk space (:class:`DiskPlan`).
    """
    import gguf

    out_path = Path(out)
    if out_path.exists() and not overwrite:
        raise ConfigError(f"--out {out_path}: already exists (pass --force to replace it)")
    # The whole plan before a byte is written: a bad --quantize type was refused only after the
    # F16 model (gigabytes, minutes) was written.
    check_quantize_types(quantize)
    for qtype in quantize:
        dst = quantized_path(out_path, qtype)
        if dst.exists() and not overwrite:
            raise ConfigError(f"--quantize {qtype}: {dst} already exists (pass --force to replace it)")
    tokenizer, n_vocab = read_tokenizer(vocab_from)
    space = disk_plan(spec, out_path, tokenizer=tokenizer, n_vocab=n_vocab, quantize=tuple(quantize))
    if say is not None:
        say(space.describe())
    space.check()
    plan = tensor_plan(spec, n_vocab)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".partial")

    def remove_partial() -> None:
        tmp.unlink(missing_ok=True)

    # SIGTERM (a batch system's stop, `kill`) ends the process without the except below: the
    # exit hook removes the partial file then too (it was 0.4-0.8 GB left behind).
    processes.on_exit(remove_partial)
    w = gguf_writer(tmp, spec, tokenizer, n_vocab, plan)
    rng = np.random.default_rng(seed)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        # Tensor data is written here chunk by chunk, with GGUFWriter's layout (each tensor at
        # an offset aligned to data_alignment, then padded): write_tensor_data() would need the
        # whole tensor in memory, 1 GB for a 150k x 3584 F16 embedding.
        assert w.fout is not None and len(w.fout) == 1
        fout = w.fout[0]
        align = w.data_alignment
        for i, t in enumerate(plan):
            fout.write(b"\0" * (gguf.GGUFWriter.ggml_pad(fout.tell(), align) - fout.tell()))
            for chunk in _chunks(t, rng):
                chunk.tofile(fout)
            fout.write(b"\0" * (gguf.GGUFWriter.ggml_pad(t.nbytes, align) - t.nbytes))
            if progress is not None:
                progress(i + 1, len(plan))
        fout.flush()
        w.close()
        tmp.replace(out_path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        processes.forget(remove_partial)
    return SynthResult(out_path, out_path.stat().st_size, sum(t.n_elements for t in plan), n_vocab)


# --------------------------------------------------------------------------------------
# Quantizing
# --------------------------------------------------------------------------------------


def quantize_types() -> list[str]:
    """The type names ``llama-quantize`` accepts, from gguf's ``LlamaFileType`` (Q4_K_M, Q8_0...)."""
    import gguf

    return [n.removeprefix("MOSTLY_") for n in gguf.LlamaFileType.__members__ if n.startswith("MOSTLY_")]


def check_quantize_types(types: Sequence[str]) -> None:
    """Raises ConfigError naming every type ``llama-quantize`` does not know."""
    allowed = quantize_types()
    bad = [t for t in types if t.upper() not in allowed]
    if bad:
        raise ConfigError(
            f"--quantize {', '.join(map(repr, bad))}: not a llama.cpp type (use one of {', '.join(allowed)})"
        )


def quantize(
    model: str | os.PathLike[str],
    qtype: str,
    *,
    out: str | os.PathLike[str] | None = None,
    binary: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    timeout_s: float | None = None,
) -> Path:
    """Quantizes a GGUF model with llama.cpp's ``llama-quantize``.

    Args:
        model: The F16 (or F32) input.
        qtype: A llama.cpp type name: Q4_K_M, Q8_0, Q4_0...
        out: Output path; default ``<model stem>-<TYPE>.gguf`` beside the input.
        binary: ``llama-quantize``; default found like the server (see
            ``engine.find_llama_quantize``).
        overwrite: Replace an existing output.
        timeout_s: Bound on the run; None waits (a 70B quantization takes many minutes).

    Returns:
        The quantized file.

    Raises:
        ConfigError: Unknown type or the output exists.
        AutotuneError: ``llama-quantize`` is missing or failed (the message quotes its output).
    """
    from autotune_plugins.llama_server import engine

    qtype = qtype.upper()
    check_quantize_types((qtype,))
    src = Path(model)
    dst = Path(out) if out else quantized_path(src, qtype)
    if dst.exists() and not overwrite:
        raise ConfigError(f"{dst}: already exists (pass --force to replace it)")
    _check_quantized_space(src, qtype, dst)
    exe = Path(binary) if binary else engine.find_llama_quantize()
    tmp = dst.with_name(dst.name + ".partial")

    def remove_partial() -> None:
        tmp.unlink(missing_ok=True)

    processes.on_exit(remove_partial)  # SIGTERM while llama-quantize writes
    try:
        proc = processes.run(
            [str(exe), str(src), str(tmp), qtype],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout_s=timeout_s,
        )
    except FileNotFoundError:
        processes.forget(remove_partial)
        raise AutotuneError(f"{exe}: no such executable") from None
    except BaseException as exc:
        remove_partial()
        processes.forget(remove_partial)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise AutotuneError(f"llama-quantize {qtype}: no result after {timeout_s:.0f}s") from None
        raise
    processes.forget(remove_partial)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = " | ".join(proc.stdout.decode("utf-8", "replace").strip().splitlines()[-3:])
        raise AutotuneError(f"llama-quantize {src.name} {qtype} failed (exit status {proc.returncode}): {tail}")
    tmp.replace(dst)
    return dst


def _check_quantized_space(src: Path, qtype: str, dst: Path) -> None:
    """Refuse a copy that would not fit, before llama-quantize fills the disk."""
    from autotune._builtin import model_from_gguf

    try:
        model = model_from_gguf(src)
    except AutotuneError:
        return  # not a model autotune reads: llama-quantize reports what is wrong with it
    if model.is_moe:
        size, how = src.stat().st_size, "MoE: counted at the source's size, an upper bound"
    else:
        size, how = _quantized_bytes(model, qtype, src.stat().st_size)
    directory, free = _free_bytes(dst.parent)
    DiskPlan(directory, ((dst, size, how),), free).check()
