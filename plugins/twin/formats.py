"""The weight formats the twins know, as the plugins of their engines declare them: llama.cpp's
GGUF (``gguf:<TYPE>``) and ExLlamaV2's EXL2 (``exl2:<bpw>``); and a model directory as one.

The twins' functions that take any format (the quality model, the evidence and the fit) look in
:data:`FORMATS` first, so that they work with no backend registered, as in a replay.
"""

from __future__ import annotations

from autotune.safetensors_dir import SafetensorsDir
from autotune_plugins.exllamav2.declarations import EXL2
from autotune_plugins.exllamav2.formats import exl2_quantization
from autotune_plugins.llama_server.declarations import GGUF

__all__ = ["FORMATS", "directory_format"]

FORMATS = (GGUF, EXL2)

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
    if directory.quant_method is not None:
        return None
    dtype = directory.config.get("torch_dtype", directory.config.get("dtype"))
    if isinstance(dtype, str) and dtype in _UNQUANTIZED_FORMATS:
        return _UNQUANTIZED_FORMATS[dtype]
    kinds = [t.dtype for t in directory.tensors if t.layer is not None and len(t.shape) > 1]
    common = max(set(kinds), key=kinds.count) if kinds else None
    return _TENSOR_FORMATS.get(common) if common else None
