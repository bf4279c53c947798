"""autotune.modelfiles.gguf_file: the one reader of GGUF files, cached by path, mtime and size."""

from __future__ import annotations

import os
import shutil

import pytest

from autotune.errors import ConfigError
from autotune.modelfiles.gguf_file import MAX_DECODED_ARRAY, read_gguf, read_gguf_key_values
from tests.conftest import shared_file


def test_header_and_tensor_table_of_a_real_file():
    path = shared_file("models/stories260K.gguf")
    header = read_gguf(path)
    assert header.architecture == "llama"
    assert header.get("llama.block_count") == 5
    assert header.array_lengths["tokenizer.ggml.tokens"] == 512
    assert header.size == path.stat().st_size
    assert header.file_type is None  # this file's header names no file type
    q = header.tensor("blk.3.attn_q.weight")
    assert q is not None and q.layer == 3 and q.ggml_type == "F32" and q.shape == (64, 64) and q.n_bytes == 64 * 64 * 4
    assert header.tensor("token_embd.weight").layer is None
    assert header.tensor("no.such.tensor") is None


def test_a_file_is_parsed_once_until_it_changes(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    shutil.copy(shared_file("models/stories260K.gguf"), path)
    first = read_gguf(path)
    assert read_gguf(str(path)) is first  # the same version of the file: not parsed again

    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a coarse clock must not hide the change
    second = read_gguf(path)
    assert second.architecture == "qwen2" and second.get("qwen2.block_count") == 2 and not second.tensors


def test_long_arrays_keep_only_their_length(tmp_path):
    import gguf

    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_token_list([f"t{i}" for i in range(MAX_DECODED_ARRAY + 1)])
    w.add_array("llama.attention.head_count_kv", [4, 4, 8])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = read_gguf(path)
    assert "tokenizer.ggml.tokens" not in header.metadata
    assert header.array_lengths["tokenizer.ggml.tokens"] == MAX_DECODED_ARRAY + 1
    assert header.get("llama.attention.head_count_kv") == [4, 4, 8]


def test_errors_name_the_file_and_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.gguf: no such file"):
        read_gguf(tmp_path / "missing.gguf")
    foreign = tmp_path / "model.safetensors"
    foreign.write_bytes(b"\x08\x00\x00\x00{}")
    with pytest.raises(ConfigError, match=r"model\.safetensors: not a GGUF file \(starts with b'\\x08"):
        read_gguf(foreign)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(shared_file("models/stories260K.gguf").read_bytes()[:5000])
    with pytest.raises(ConfigError, match=r"cut\.gguf: damaged or truncated GGUF file"):
        read_gguf(truncated)


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_agrees_with_the_gguf_packages_reader(tmp_path, endian):
    import gguf
    import numpy as np

    path = tmp_path / f"{endian}.gguf"
    w = gguf.GGUFWriter(path, "llama", endianess=getattr(gguf.GGUFEndian, endian))
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_uint64("t.u64", 2**40)
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", 1.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.strs", ["a", "bc"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tensor("blk.0.attn_q.weight", np.ones((4, 32), dtype=np.float32))
    w.add_tensor("output.weight", np.ones((2, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    header = read_gguf(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert dict(header.metadata) == expected
    assert [(t.name, t.ggml_type, t.shape, t.n_elements, t.n_bytes) for t in header.tensors] == [
        (t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.n_elements), int(t.n_bytes))
        for t in reader.tensors
    ]
    assert header.file_type == "Q8_0"


def test_key_values_copy_into_a_new_file_unchanged(tmp_path):
    import gguf

    src = shared_file("models/stories260K.gguf")
    pairs = read_gguf_key_values(src, "tokenizer.")
    assert [k for k, *_ in pairs] == [k for k in gguf.GGUFReader(src).fields if k.startswith("tokenizer.")]
    tokens = next(v for k, v, *_ in pairs if k == "tokenizer.ggml.tokens")
    assert len(tokens) == 512 and all(isinstance(t, bytes) for t in tokens)  # raw bytes: no re-encoding
    copy = tmp_path / "copy.gguf"
    w = gguf.GGUFWriter(copy, "llama")
    for key, value, vtype, sub in pairs:
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_gguf_key_values(copy, "tokenizer.") == pairs


def _header(n_tensors: int, n_kv: int, body: bytes = b"") -> bytes:
    import struct

    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body


def _key(name: str) -> bytes:
    import struct

    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize(
    "data, expected",
    [
        # A count the file cannot hold is refused before it is looped over or allocated.
        (_header(2**63, 0), "tensor count = 9223372036854775808 at byte 8: the 8 bytes after it hold at most 0"),
        (_header(0, 2**64 - 1), "key-value count = 18446744073709551615 at byte 16"),
        (
            _header(
                0,
                1,
                _key("tokenizer.ggml.tokens")
                + (9).to_bytes(4, "little")
                + (8).to_bytes(4, "little")
                + (2**62).to_bytes(8, "little"),
            ),
            "array 'tokenizer.ggml.tokens': length = 4611686018427387904",
        ),
        (
            _header(0, 1, _key("general.name") + (8).to_bytes(4, "little") + (2**40).to_bytes(8, "little") + b"x" * 16),
            "key 'general.name': a length of 1099511627776 bytes at byte",
        ),
        (
            _header(1, 0, _key("t") + (2**32 - 1).to_bytes(4, "little") + b"\0" * 32),
            "tensor 't' has 4294967295 dimensions; ggml's tensors have at most 4",
        ),
    ],
    ids=["tensor-count", "kv-count", "array-length", "string-length", "n-dims"],
)
def test_counts_and_lengths_beyond_the_file_are_refused(tmp_path, data, expected):
    path = tmp_path / "crafted.gguf"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as err:
        read_gguf(path)
    assert str(err.value).startswith(f"{path.resolve()}: damaged or truncated GGUF file (") and expected in str(
        err.value
    )
