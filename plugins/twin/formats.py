"""The weight formats the twins know, as the plugins of their engines declare them: llama.cpp's
GGUF (``gguf:<TYPE>``), ExLlamaV2's EXL2 (``exl2:<bpw>``) and exllamav3's EXL3 (``exl3:<bpw>``); and
a model directory as one.

The twins' functions that take any format (the quality model, the evidence and the fit) look in
:data:`FORMATS` first, so that they work with no backend registered, as in a replay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from autotune.errors import ConfigError
from autotune.gguf_file import read_gguf
from autotune.safetensors_dir import SafetensorsDir, read_safetensors_dir
from autotune_plugins.exllamav2.declarations import EXL2
from autotune_plugins.exllamav2.formats import EXL2_BPW_MAX, EXL2_BPW_MIN, exl2_quantization
from autotune_plugins.exllamav3.declarations import EXL3
from autotune_plugins.exllamav3.formats import exl3_quantization
from autotune_plugins.llama_server.declarations import GGUF

__all__ = ["FORMATS", "ARTIFACT_WORDS", "artifact_kind", "directory_as_format", "directory_format"]

FORMATS = (GGUF, EXL2, EXL3)

# config.json's torch_dtype (transformers 5 writes "dtype") -> the unquantized format of that
# element type. The twins name unquantized weights by their GGUF file type.
_UNQUANTIZED_FORMATS = {"float16": "gguf:F16", "bfloat16": "gguf:BF16", "float32": "gguf:F32"}
_TENSOR_FORMATS = {"F16": "gguf:F16", "BF16": "gguf:BF16", "F32": "gguf:F32"}


def directory_format(directory: SafetensorsDir) -> str | None:
    """The weights as a format the speed and quality models know: ``exl2:<bits>`` for an EXL2
    directory; for an unquantized one the unquantized format of its element type
    (``gguf:BF16``: config.json's torch_dtype, else the type most of its layers' matrices
    have); None for another quantization or an element type of no format."""
    exl2 = exl2_quantization(directory.config, directory.path / "config.json")
    if exl2 is not None:
        return f"exl2:{round(exl2.bits, 2)}"
    exl3 = exl3_quantization(directory.config, directory.path / "config.json")
    if exl3 is not None:
        return f"exl3:{round(exl3.bits, 2)}"
    if directory.quant_method is not None:
        return None
    dtype = directory.config.get("torch_dtype", directory.config.get("dtype"))
    if isinstance(dtype, str) and dtype in _UNQUANTIZED_FORMATS:
        return _UNQUANTIZED_FORMATS[dtype]
    kinds = [t.dtype for t in directory.tensors if t.layer is not None and len(t.shape) > 1]
    common = max(set(kinds), key=kinds.count) if kinds else None
    return _TENSOR_FORMATS.get(common) if common else None


#: The artifacts on disk a twin can read, as its messages name them (one, many).
ARTIFACT_WORDS: Mapping[str, tuple[str, str]] = {
    "gguf": ("a GGUF file", "GGUF files"),
    "exl2": ("an EXL2 directory", "EXL2 directories (config.json with quantization_config.quant_method \"exl2\")"),
    "exl3": ("an EXL3 directory", "EXL3 directories (config.json with quantization_config.quant_method \"exl3\")"),
    "hf": ("a Hugging Face directory", "Hugging Face directories (config.json and *.safetensors)"),
}


def artifact_kind(path: Path) -> str:
    """``gguf`` (a GGUF file), ``exl2`` (an EXL2 directory) or ``hf`` (any other model directory).

    Raises:
        ConfigError: A file that is not GGUF, or a directory without config.json or safetensors.
    """
    if path.is_file():
        read_gguf(path)
        return "gguf"
    directory = read_safetensors_dir(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path}: no config.json (a model directory holds config.json and *.safetensors)")
    config = directory.path / "config.json"
    if exl2_quantization(directory.config, config) is not None:
        return "exl2"
    return "exl3" if exl3_quantization(directory.config, config) is not None else "hf"


def directory_as_format(path: Path) -> str:
    """A model directory as a format (``exl2:4.0``, ``gguf:BF16``); see ``TwinBackend.as_format``."""
    artifact_kind(path)  # its config.json and safetensors are there
    directory = read_safetensors_dir(path)
    exl2 = exl2_quantization(directory.config, directory.path / "config.json")
    if exl2 is not None and not EXL2_BPW_MIN <= exl2.bits <= EXL2_BPW_MAX:
        raise ConfigError(f"{path / 'config.json'}: quantization_config.bits = {exl2.bits}: the twin knows EXL2 "
                          f"at {EXL2_BPW_MIN}-{EXL2_BPW_MAX} bits per weight")
    spec = directory_format(directory)
    if spec is not None:
        return spec
    if directory.quant_method is not None:
        raise ConfigError(f"{path / 'config.json'}: quantization_config.quant_method {directory.quant_method!r}: "
                          f"the twin predicts EXL2 and EXL3 directories (quant_method \"exl2\", \"exl3\") "
                          f"and unquantized ones "
                          f"(F16, BF16 or F32)")
    raise ConfigError(f"{path}: neither config.json's torch_dtype nor its layers' tensors are F16, BF16 or F32, "
                      f"the unquantized types the twin predicts")
