"""The one reader of GGUF files: header metadata and tensor table, parsed once per file version.

Everything autotune learns from a GGUF file comes through :func:`read_gguf`: the model's shape
(:func:`autotune.modelfiles.models.model_from_gguf`), the exact bytes of its tensors
(:func:`autotune_plugins.llama_server.formats.gguf_file_weights`, for the plugin that declares
the ``gguf:`` formats) and its file type. The
result is cached by (path, mtime, size): a study asks about the same file at every proposal and
parses it once, and a file rewritten in place is parsed again.

Only the header is parsed (the tensor data is never touched), so a 20 GB file costs what its
header costs; the result holds plain Python values, no memory map of the file.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import re
import struct
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.errors import ConfigError
from autotune.toolkit.paths import path_problem

__all__ = ["GGUF_MAGIC", "GgufFile", "GgufTensor", "read_gguf", "read_gguf_key_values"]

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
    problem = path_problem(p, "file")
    if problem:  # a FIFO or a device would block or never end
        raise ConfigError(f"{p}: {problem}")
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


def read_gguf_key_values(path: str | os.PathLike[str], prefix: str = "") -> list[tuple[str, Any, Any, Any]]:
    """Key-value pairs of a GGUF file exactly as stored, to copy them into another file.

    For writing a new GGUF file with some of this one's metadata (``autotune synth`` copies a
    tokenizer): every array is decoded whole, strings are kept as raw bytes (a token need not
    be valid UTF-8, and re-encoding could change it), and each value comes with its types, as
    ``gguf.GGUFWriter.add_key_value`` takes them. Not cached: it is read once per use.

    Args:
        path: A ``.gguf`` file.
        prefix: Only keys starting with it (``tokenizer.``).

    Returns:
        ``[(key, value, gguf.GGUFValueType, element type for arrays else None), ...]`` in file order.

    Raises:
        ConfigError: As :func:`read_gguf`.
    """
    import gguf

    p = Path(path).expanduser()
    read_gguf(p)  # the same checks and messages, and the file is known to parse
    out = []
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, _byte_order(buf))
        cur.pos = 16
        for _ in range(cur.take("Q")):
            key = cur.raw_string().decode("utf-8", errors="replace")
            vtype = cur.take("I")
            value, sub = cur.typed_value(vtype, key)
            if key.startswith(prefix):
                out.append(
                    (key, value, gguf.GGUFValueType(vtype), gguf.GGUFValueType(sub) if sub is not None else None)
                )
    return out


@functools.lru_cache(maxsize=64)
def _read_cached(path: str, mtime_ns: int, size: int) -> GgufFile:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            metadata, lengths, tensors = _parse(buf)
    except _Damaged as exc:
        raise ConfigError(f"{path}: damaged or truncated GGUF file ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the file ({exc.strerror or exc})") from None
    return GgufFile(
        path=Path(path),
        size=size,
        metadata=types.MappingProxyType(metadata),
        array_lengths=types.MappingProxyType(lengths),
        tensors=tensors,
        file_type=_file_type_name(metadata.get("general.file_type")),
    )


# ----------------------------------------------------------------------------- the format
#
# GGUF v2/v3 (ggml/docs/gguf.md; gguf-py's GGUFReader reads the same): magic, u32 version,
# u64 tensor count, u64 key-value count; each key-value pair is a string key, a u32 value type
# and the value (an array: u32 element type, u64 count, the elements); each tensor info is a
# string name, u32 n_dims, n_dims u64 dimensions, u32 ggml type, u64 offset into the data,
# which starts at the next multiple of general.alignment (32 by default). Strings are a u64
# length and UTF-8 bytes. We parse it ourselves rather than with gguf.GGUFReader, which builds
# a numpy array per element of every array: 4 s for a 49k-token vocabulary, where this takes
# a few tens of milliseconds.

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
# ggml's GGML_MAX_DIMS: a tensor has at most 4 dimensions.
_MAX_DIMS = 4
# The fewest bytes one entry can take, to refuse a count the file cannot hold before looping
# over it: a key-value pair is a key (u64 length), a u32 type and a value of at least one byte;
# a tensor info is a name (u64 length), u32 n_dims, u32 type, u64 offset; a string is its u64 length.
_MIN_KV_BYTES, _MIN_TENSOR_INFO_BYTES, _MIN_STRING_BYTES = 13, 24, 8


class _Damaged(Exception):
    """The bytes do not follow the format (a truncated file, a wrong count, an unknown type)."""


class _Cursor:
    def __init__(self, buf: Any, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def take(self, fmt: str) -> Any:
        st = struct.Struct(self.order + fmt)
        if self.pos + st.size > len(self.buf):
            raise _Damaged(f"ends inside the header at byte {self.pos}")
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def count(self, what: str, min_bytes: int) -> int:
        """A u64 count of entries of at least ``min_bytes`` each, refused when the rest of the
        file cannot hold them (a crafted count would otherwise be looped over, or allocated)."""
        at = self.pos
        n = self.take("Q")
        if n * min_bytes > len(self.buf) - self.pos:
            raise _Damaged(
                f"{what} = {n} at byte {at}: the {len(self.buf) - self.pos} bytes after it hold "
                f"at most {(len(self.buf) - self.pos) // min_bytes}"
            )
        return n

    def raw_string(self, what: str = "a string") -> bytes:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise _Damaged(
                f"{what}: a length of {n} bytes at byte {self.pos - 8} runs past the end "
                f"of the file ({len(self.buf)} bytes)"
            )
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw

    def string(self, what: str = "a string") -> str:
        return self.raw_string(what).decode("utf-8", errors="replace")

    def typed_value(self, vtype: int, key: str) -> tuple[Any, int | None]:
        """(the value with strings as bytes and arrays whole, the element type of an array)."""
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype]), None
        if vtype == _STRING:
            return self.raw_string(f"key {key!r}"), None
        if vtype != _ARRAY:
            raise _Damaged(f"key {key!r} has value type {vtype}, which GGUF does not define")
        etype = self.take("I")
        count = self.count(f"array {key!r}: length", _element_bytes(etype, self.order))
        if etype == _STRING:
            return [self.raw_string(f"array {key!r}") for _ in range(count)], etype
        if etype not in _SCALARS:
            raise _Damaged(f"array {key!r} has element type {etype}; nested arrays are not supported")
        st = struct.Struct(f"{self.order}{count}{_SCALARS[etype]}")
        if self.pos + st.size > len(self.buf):
            raise _Damaged(f"array {key!r} of {count} elements runs past the end")
        values = list(st.unpack_from(self.buf, self.pos))
        self.pos += st.size
        return values, etype

    def skip_string(self) -> None:
        n = self.take("Q")
        self.pos += n

    def value(self, vtype: int, key: str, lengths: dict[str, int]) -> tuple[bool, Any]:
        """(whether it was decoded, the value)."""
        if vtype in _SCALARS:
            return True, self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return True, self.string(f"key {key!r}")
        if vtype != _ARRAY:
            raise _Damaged(f"key {key!r} has value type {vtype}, which GGUF does not define")
        etype = self.take("I")
        count = self.count(f"array {key!r}: length", _element_bytes(etype, self.order))
        lengths[key] = count
        if count > MAX_DECODED_ARRAY:
            if etype in _SCALARS:
                self.pos += count * struct.calcsize(self.order + _SCALARS[etype])
            elif etype == _STRING:
                for _ in range(count):
                    self.skip_string()
            else:
                raise _Damaged(f"array {key!r} of element type {etype} is not skippable")
            if self.pos > len(self.buf):
                raise _Damaged(f"array {key!r} of {count} elements runs past the end")
            return False, None
        return True, [self.value(etype, key, {})[1] for _ in range(count)]


def _element_bytes(etype: int, order: str) -> int:
    """The fewest bytes one array element of type ``etype`` takes (an unknown type: 1, so that
    the count check passes and the type's own error names it)."""
    if etype in _SCALARS:
        return struct.calcsize(order + _SCALARS[etype])
    return _MIN_STRING_BYTES if etype == _STRING else 1


def _byte_order(buf: Any) -> str:
    # A file written on a machine of the other byte order has its version byte-swapped.
    return "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"


def _parse(buf: Any) -> tuple[dict[str, Any], dict[str, int], tuple[GgufTensor, ...]]:
    import gguf

    if len(buf) < 24:
        raise _Damaged(f"{len(buf)} bytes, shorter than a GGUF header")
    cur = _Cursor(buf, _byte_order(buf))
    cur.pos = 4
    version = cur.take("I")
    if version not in (2, 3):
        raise _Damaged(f"GGUF version {version}; autotune reads versions 2 and 3")
    n_tensors = cur.count("tensor count", _MIN_TENSOR_INFO_BYTES)
    n_kv = cur.count("key-value count", _MIN_KV_BYTES)
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string("a key")
        decoded, value = cur.value(cur.take("I"), key, lengths)
        if decoded:
            metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string("a tensor name")
        n_dims = cur.take("I")
        if n_dims > _MAX_DIMS:
            raise _Damaged(f"tensor {name!r} has {n_dims} dimensions; ggml's tensors have at most {_MAX_DIMS}")
        shape = tuple(cur.take("Q") for _ in range(n_dims))
        infos.append((name, shape, cur.take("I"), cur.take("Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Damaged(f"general.alignment = {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, type_id, offset in infos:
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
            block, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise _Damaged(f"tensor {name!r} has ggml type {type_id}, unknown to the gguf package") from None
        n_elements = math.prod(shape)
        n_bytes = n_elements // block * block_bytes
        if data_start + offset + n_bytes > len(buf):
            raise _Damaged(f"tensor {name!r} ends at byte {data_start + offset + n_bytes} of {len(buf)}")
        tensors.append(GgufTensor(name, ggml_type.name, shape, n_elements, n_bytes))
    return metadata, lengths, tuple(tensors)


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
