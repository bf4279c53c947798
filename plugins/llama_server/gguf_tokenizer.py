"""The ``tokenizer.*`` keys of a GGUF file, read without loading its tensors.

``autotune synth`` copies them verbatim into the models it writes: a real tokenizer is what
llama.cpp's loader needs, and its size is most of a synthetic file's header.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from autotune._builtin import ConfigError

__all__ = ["read_tokenizer"]


def _gguf_metadata(path: Path) -> Iterator[tuple[str, Any, Any, Any]]:
    """Yields a GGUF file's metadata as ``(key, value, type, array sub-type)``, strings as bytes.

    A direct parse of the key/value section (GGUF v2/v3, little-endian), over a memory map:
    ``gguf.GGUFReader`` builds one numpy array per array element, which for a 151,936-token
    vocabulary costs about 550 MB and 12 s; this costs the size of the values and well
    under a second, and never touches the tensor data of a full model given as --vocab-from.
    """
    from gguf import GGUFValueType as T

    scalars = {
        T.UINT8: "B",
        T.INT8: "b",
        T.UINT16: "H",
        T.INT16: "h",
        T.UINT32: "I",
        T.INT32: "i",
        T.FLOAT32: "f",
        T.UINT64: "Q",
        T.INT64: "q",
        T.FLOAT64: "d",
        T.BOOL: "?",
    }
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"not a little-endian GGUF v2/v3 file (magic {magic!r}, version {version})")
        pos = 24

        def string() -> bytes:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", buf, pos)
            pos += 8 + n
            return bytes(buf[pos - n : pos])

        for _ in range(n_kv):
            key = string().decode("utf-8")
            vtype = T(struct.unpack_from("<I", buf, pos)[0])
            pos += 4
            if vtype == T.STRING:
                yield key, string(), vtype, None
            elif vtype == T.ARRAY:
                sub, count = struct.unpack_from("<IQ", buf, pos)
                sub = T(sub)
                pos += 12
                if sub == T.STRING:
                    yield key, [string() for _ in range(count)], vtype, sub
                elif sub in scalars:
                    fmt = scalars[sub]
                    values = list(struct.unpack_from(f"<{count}{fmt}", buf, pos))
                    pos += count * struct.calcsize(fmt)
                    yield key, values, vtype, sub
                else:
                    raise ValueError(f"key {key}: nested arrays are not supported")
            else:
                fmt = scalars[vtype]
                (value,) = struct.unpack_from(f"<{fmt}", buf, pos)
                pos += struct.calcsize(fmt)
                yield key, value, vtype, None


def read_tokenizer(path: str | os.PathLike[str]) -> tuple[list[tuple[str, Any, Any, Any]], int]:
    """Reads every ``tokenizer.*`` key of a GGUF file, ready for ``GGUFWriter.add_key_value``.

    Strings are kept as raw bytes: a token need not be valid UTF-8 (byte-fallback pieces),
    and re-encoding could change it.

    Args:
        path: A GGUF file with a tokenizer (a vocab-only one from llama.cpp's ``models/`` or any
            model).

    Returns:
        ``([(key, value, type, sub_type), ...], n_tokens)``.

    Raises:
        ConfigError: Not a GGUF file, or no ``tokenizer.ggml.tokens``.
    """
    p = Path(path)
    try:
        out = [kv for kv in _gguf_metadata(p) if kv[0].startswith("tokenizer.")]
    except (OSError, ValueError, struct.error) as exc:  # struct.error: a truncated file
        raise ConfigError(f"--vocab-from {p}: not a readable GGUF file ({exc})") from None
    # GGUF forbids empty arrays, and GGUFWriter refuses to write one.
    out = [kv for kv in out if not (isinstance(kv[1], list) and not kv[1])]
    tokens = next((kv[1] for kv in out if kv[0] == "tokenizer.ggml.tokens"), None)
    if not tokens:
        raise ConfigError(f"--vocab-from {p}: no tokenizer.ggml.tokens in it")
    return out, len(tokens)
