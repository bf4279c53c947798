"""The one reader of safetensors model directories: Hugging Face and EXL2 alike.

A model directory holds ``config.json`` and ``*.safetensors`` files. Everything autotune learns
from one comes through :func:`read_safetensors_dir`: its config.json (whose
``quantization_config`` the plugin of that quantization reads: EXL2's is
:func:`autotune_plugins.exllamav2.formats.exl2_quantization`), the tensor table of every
safetensors header, and from those the exact bytes of every part of the model
(:func:`autotune.engine.formats.safetensors_dir_weights`). The model's shape is :func:`autotune.modelfiles.models.model_from_hf_config`'s.

Only the headers are read (8-byte little-endian length, then ``{name: {dtype, shape,
data_offsets}}``), never the tensor data and never torch; a 40 GB directory costs what its
headers cost. The result is cached by the files' (path, mtime, size): a study asks about the
same directory at every proposal and reads it once, and a directory rewritten in place is read
again.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError

__all__ = [
    "SAFETENSORS_DTYPE_BYTES",
    "SafetensorsDir",
    "SafetensorsTensor",
    "read_config_json",
    "read_safetensors_dir",
    "read_safetensors_header",
]

#: safetensors dtype names -> bytes per element (the format's spec lists these).
SAFETENSORS_DTYPE_BYTES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# A header larger than this is not a safetensors file (the reference implementation caps it
# at 100 MB too) and must not make us read a whole weights file into memory.
MAX_HEADER_BYTES = 100_000_000

# Hugging Face tensor names of a decoder-only model (transformers' LlamaModel / Qwen2Model; a
# multimodal wrapper puts the language model under language_model.). EXL2 keeps these names
# and adds suffixes (q_weight, q_scale, ...) to the quantized linear layers.
_LAYER_RX = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")
_EMBEDDING_RX = re.compile(r"^(?:language_model\.)?model\.embed_tokens\.weight$")
_HEAD_RX = re.compile(r"^(?:language_model\.)?lm_head\.")


@dataclass(frozen=True)
class SafetensorsTensor:
    """One tensor of a safetensors file, as its header states it.

    Attributes:
        name: The tensor's name (``model.layers.3.mlp.down_proj.q_weight``).
        dtype: The safetensors dtype (``F16``, ``I32``, ...).
        shape: The dimensions, outermost first.
        n_bytes: Data size in bytes, from ``data_offsets``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    n_bytes: int

    @property
    def layer(self) -> int | None:
        """The decoder layer a ``model.layers.N.`` tensor belongs to; None for the others."""
        m = _LAYER_RX.match(self.name)
        return int(m.group(1)) if m else None

    @property
    def is_embedding(self) -> bool:
        """The token embedding (``model.embed_tokens.weight``)."""
        return _EMBEDDING_RX.match(self.name) is not None

    @property
    def is_head(self) -> bool:
        """Part of the output head (``lm_head.*``)."""
        return _HEAD_RX.match(self.name) is not None


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, SafetensorsTensor]:
    """The tensors of one safetensors file, from its header alone (not cached).

    Args:
        path: A ``.safetensors`` file.

    Returns:
        Tensor name -> tensor, with ``n_bytes`` from ``data_offsets`` (checked against dtype x
        shape and the file's size).

    Raises:
        ConfigError: Unreadable or malformed; the message names the file and what is wrong.
    """
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise ConfigError(f"{p}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise ConfigError(f"{p}: not a safetensors file (header length {n} exceeds the file)")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read ({exc})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p}: safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ConfigError(f"{p}: safetensors header must be a JSON object")
    data_bytes = size - 8 - n
    out: dict[str, SafetensorsTensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{p}: tensor '{name}': needs dtype, shape and data_offsets ({exc!r})") from None
        if any(d < 0 for d in shape):
            # Two negative dimensions multiply to a positive size that could match the offsets.
            raise ConfigError(f"{p}: tensor '{name}': shape {list(shape)} has a negative dimension")
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise ConfigError(
                f"{p}: tensor '{name}': dtype {dtype!r} unknown (known: {', '.join(SAFETENSORS_DTYPE_BYTES)})"
            )
        nbytes = end - begin
        expected = math.prod(shape) * SAFETENSORS_DTYPE_BYTES[dtype]
        if nbytes != expected or begin < 0 or end > data_bytes:
            raise ConfigError(
                f"{p}: tensor '{name}': data_offsets [{begin}, {end}] do not hold "
                f"{dtype} x {list(shape)} = {expected} bytes within the file's {data_bytes}"
            )
        out[name] = SafetensorsTensor(name, dtype, shape, nbytes)
    return out


def read_config_json(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The directory's config.json as a dict; {} when it is missing or not a JSON object.

    Lenient on purpose: callers say what they needed from it (its shape is
    :func:`autotune.modelfiles.models.model_from_hf_config`'s to check, with every bad field named).
    """
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


@dataclass(frozen=True)
class SafetensorsDir:
    """What a model directory's config.json and safetensors headers say.

    Attributes:
        path: The directory, resolved.
        config: Its config.json ({} when missing or not a JSON object).
        tensors: Every tensor of every ``*.safetensors`` file (a name in two files: the later).
        files: The safetensors files' names, sorted.
    """

    path: Path
    config: Mapping[str, Any] = field(hash=False)
    tensors: tuple[SafetensorsTensor, ...]
    files: tuple[str, ...]

    @property
    def quant_method(self) -> str | None:
        """``quantization_config.quant_method`` (``exl2``, ``gptq``, ...); None when unquantized."""
        q = self.config.get("quantization_config")
        method = q.get("quant_method") if isinstance(q, dict) else None
        return str(method) if method is not None else None

    @property
    def tied(self) -> bool:
        """``tie_word_embeddings`` (under ``text_config`` for a multimodal wrapper)."""
        text = self.config.get("text_config")
        inner = text.get("tie_word_embeddings") if isinstance(text, dict) else None
        return self.config.get("tie_word_embeddings", inner) is True


def _files_key(model_dir: Path) -> tuple[tuple[str, int, int], ...]:
    files = sorted(model_dir.glob("*.safetensors"))
    config = model_dir / "config.json"
    return tuple((str(f), st.st_mtime_ns, st.st_size) for f in [*files, config] if f.is_file() for st in [f.stat()])


def read_safetensors_dir(path: str | os.PathLike[str]) -> SafetensorsDir:
    """Reads a model directory's config.json and every safetensors header (cached).

    Args:
        path: A directory with ``*.safetensors`` files (and, for anything but the bytes, a
            config.json).

    Returns:
        The directory's config and tensor table.

    Raises:
        ConfigError: Not a directory, no ``*.safetensors`` file, or a malformed one; the
            message names the directory or the file.
    """
    d = Path(path).expanduser()
    if not d.is_dir():
        raise ConfigError(f"{d}: no such directory (a model directory holds config.json and *.safetensors)")
    key = _files_key(d)
    if not any(p.endswith(".safetensors") for p, _, _ in key):
        raise ConfigError(
            f"{d}: no *.safetensors files (a Hugging Face or EXL2 model directory holds its tensors in *.safetensors)"
        )
    return _read_cached(str(d.resolve()), key)


@functools.lru_cache(maxsize=32)
def _read_cached(path: str, key: tuple[tuple[str, int, int], ...]) -> SafetensorsDir:
    tensors: dict[str, SafetensorsTensor] = {}
    files = [p for p, _, _ in key if p.endswith(".safetensors")]
    for file in files:
        tensors.update(read_safetensors_header(file))
    return SafetensorsDir(
        path=Path(path),
        config=types.MappingProxyType(read_config_json(path)),
        tensors=tuple(tensors.values()),
        files=tuple(Path(f).name for f in files),
    )
