"""The one reader of GGUF files: header metadata and tensor table, parsed once per file version.

Everything autotune learns from a GGUF file comes through :func:`read_gguf`: the model's shape
(:func:`autotune.models.model_from_gguf`), the exact bytes of its tensors
(:func:`autotune.formats.gguf_file_weights`) and its file type (``autotune estimate``). The
result is cached by (path, mtime, size): a study asks about the same file at every proposal and
parses it once, and a file rewritten in place is parsed again.

Only the header is parsed; ``gguf.GGUFReader`` memory-maps the file and the tensor data is never
touched, so reading a 20 GB file costs what its header costs. Nothing of the reader (its memory
map included) outlives :func:`read_gguf`: the result holds plain Python values.
"""

from __future__ import annotations

import functools
import os
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError

__all__ = ["GGUF_MAGIC", "GgufFile", "GgufTensor", "read_gguf"]

GGUF_MAGIC = b"GGUF"
# Arrays longer than this keep only their length: a tokenizer's 150k-entry vocabulary would
# cost a second to decode and nobody reads its entries, while per-layer arrays (head counts of
# hybrid models) are short and needed.
MAX_DECODED_ARRAY = 4096
_LAYER_RX = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class GgufTensor:
    """One entry of a GGUF file's tensor table.

    Attributes:
        name: llama.cpp's tensor name (``blk.3.ffn_down.weight``).
        ggml_type: The ggml type's name (``F32``, ``Q4_K``, ...).
        shape: GGUF dimensions, ``ne[0]`` (the row length) first.
        n_elements: Number of elements.
        n_bytes: Data size in bytes.
    """

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int

    @property
    def layer(self) -> int | None:
        """The decoder layer a ``blk.N.`` tensor belongs to; None for the others."""
        m = _LAYER_RX.match(self.name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class GgufFile:
    """What a GGUF file's header says.

    Attributes:
        path: The file, resolved.
        size: Its size on disk in bytes.
        metadata: Every key-value pair, except that arrays longer than
            :data:`MAX_DECODED_ARRAY` are left out (their lengths are in ``array_lengths``).
        array_lengths: Element count of every array-valued key.
        tensors: The tensor table, in file order.
        file_type: ``general.file_type`` as llama.cpp names it (``Q4_K_M``, ``F16``), or None
            when the header has none or a number the ``gguf`` package does not know.
    """

    path: Path
    size: int
    metadata: Mapping[str, Any] = field(hash=False)
    array_lengths: Mapping[str, int] = field(hash=False)
    tensors: tuple[GgufTensor, ...]
    file_type: str | None

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` ("llama", "qwen2", ...)."""
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def tensor(self, name: str) -> GgufTensor | None:
        """The tensor of that name, or None."""
        for t in self.tensors:
            if t.name == name:
                return t
        return None


def read_gguf(path: str | os.PathLike[str]) -> GgufFile:
    """Parses a GGUF file's header: metadata and tensor table (cached by path, mtime and size).

    Args:
        path: A ``.gguf`` file.

    Returns:
        The header, as plain values.

    Raises:
        ConfigError: The file is missing or unreadable, is not a GGUF file, or its header is
            damaged or truncated; the message names the file.
    """
    p = Path(path).expanduser()
    try:
        with p.open("rb") as f:
            magic = f.read(4)
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the file ({exc.strerror or exc})") from None
    if magic != GGUF_MAGIC:
        raise ConfigError(f"{p}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    return _read_cached(str(p.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _read_cached(path: str, mtime_ns: int, size: int) -> GgufFile:
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
        metadata: dict[str, Any] = {}
        lengths: dict[str, int] = {}
        for key, f in reader.fields.items():
            if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
                lengths[key] = len(f.data)
                if len(f.data) > MAX_DECODED_ARRAY:
                    continue
            metadata[key] = f.contents()
        tensors = tuple(
            GgufTensor(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.n_elements), int(t.n_bytes))
            for t in reader.tensors
        )
    except (ValueError, KeyError, IndexError, OSError) as exc:
        # The gguf package raises these on a truncated file or a damaged table.
        raise ConfigError(f"{path}: damaged or truncated GGUF file ({exc})") from None
    return GgufFile(
        path=Path(path),
        size=size,
        metadata=types.MappingProxyType(metadata),
        array_lengths=types.MappingProxyType(lengths),
        tensors=tensors,
        file_type=_file_type_name(metadata.get("general.file_type")),
    )


def _file_type_name(value: Any) -> str | None:
    """``general.file_type`` (a llama_ftype number) as llama.cpp names the type: Q4_K_M, F16."""
    import gguf

    if value is None:
        return None
    try:
        name = gguf.LlamaFileType(int(value)).name  # e.g. MOSTLY_Q4_K_M, ALL_F32
    except (ValueError, TypeError):
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")
