"""The weight formats and artifacts the twins know, as the engine models declare them
(``EngineModel.weight_formats``, ``artifact_words``, ``directory_format``); and a model
directory or a GGUF file as a format.

The twins' functions that take any format (the quality model, the evidence and the fit) use
:func:`twin_formats`, every engine model's formats, so that they work with no backend
registered, as in a replay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from autotune.api import WeightFormats
from autotune.api import WeightsBreakdown
from autotune._builtin import ConfigError, engine_models
from autotune._builtin import read_gguf
from autotune._builtin import SafetensorsDir, read_safetensors_dir

__all__ = [
    "artifact_kind",
    "artifact_words",
    "directory_as_format",
    "directory_format",
    "file_format",
    "file_weights",
    "twin_formats",
]

# config.json's torch_dtype (transformers 5 writes "dtype") -> the unquantized format of that
# element type. The twins name unquantized weights by their GGUF file type.
_UNQUANTIZED_FORMATS = {"float16": "gguf:F16", "bfloat16": "gguf:BF16", "float32": "gguf:F32"}
_TENSOR_FORMATS = {"F16": "gguf:F16", "BF16": "gguf:BF16", "F32": "gguf:F32"}


def twin_formats() -> tuple[WeightFormats, ...]:
    """Every engine model's weight formats, each family once."""
    found: dict[str, WeightFormats] = {}
    for m in engine_models().values():
        for f in m.weight_formats:
            found.setdefault(f.name, f)
    return tuple(found.values())


def artifact_words() -> Mapping[str, tuple[str, str]]:
    """The artifacts on disk a twin can read, as its messages name them (one, many)."""
    return {k: v for m in engine_models().values() for k, v in m.artifact_words.items()}


def _engine_format(directory: SafetensorsDir, check: bool = False) -> tuple[str, str] | None:
    """(artifact kind, format) of a directory an engine model reads as one of its formats."""
    for m in engine_models().values():
        spec = m.directory_format(directory, check)
        if spec is not None:
            return m.artifacts[0], spec
    return None


def directory_format(directory: SafetensorsDir) -> str | None:
    """The weights as a format the speed and quality models know: an engine model's
    (``exl2:<bits>`` for an EXL2 directory); for an unquantized one the unquantized format of its
    element type (``gguf:BF16``: config.json's torch_dtype, else the type most of its layers'
    matrices have); None for another quantization or an element type of no format."""
    found = _engine_format(directory)
    if found is not None:
        return found[1]
    if directory.quant_method is not None:
        return None
    dtype = directory.config.get("torch_dtype", directory.config.get("dtype"))
    if isinstance(dtype, str) and dtype in _UNQUANTIZED_FORMATS:
        return _UNQUANTIZED_FORMATS[dtype]
    kinds = [t.dtype for t in directory.tensors if t.layer is not None and len(t.shape) > 1]
    common = max(set(kinds), key=kinds.count) if kinds else None
    return _TENSOR_FORMATS.get(common) if common else None


def artifact_kind(path: Path) -> str:
    """``gguf`` (a GGUF file), the kind of an engine's directory (``exl2``) or ``hf`` (any other
    model directory).

    Raises:
        ConfigError: A file that is not GGUF, or a directory without config.json or safetensors.
    """
    if path.is_file():
        read_gguf(path)
        return "gguf"
    directory = read_safetensors_dir(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path}: no config.json (a model directory holds config.json and *.safetensors)")
    found = _engine_format(directory)
    return "hf" if found is None else found[0]


def directory_as_format(path: Path) -> str:
    """A model directory as a format (``exl2:4.0``, ``gguf:BF16``); see ``TwinBackend.as_format``."""
    artifact_kind(path)  # its config.json and safetensors are there
    directory = read_safetensors_dir(path)
    found = _engine_format(directory, check=True)
    spec = found[1] if found is not None else directory_format(directory)
    if spec is not None:
        return spec
    if directory.quant_method is not None:
        raise ConfigError(
            f"{path / 'config.json'}: quantization_config.quant_method {directory.quant_method!r}: "
            f'the twin predicts EXL2 and EXL3 directories (quant_method "exl2", "exl3") '
            f"and unquantized ones "
            f"(F16, BF16 or F32)"
        )
    raise ConfigError(
        f"{path}: neither config.json's torch_dtype nor its layers' tensors are F16, BF16 or F32, "
        f"the unquantized types the twin predicts"
    )


def file_format(path: Path) -> str | None:
    """A weights file as the format an engine model reads in it (``gguf:Q8_0``), or None."""
    for m in engine_models().values():
        spec = m.file_format(path)
        if spec is not None:
            return spec
    return None


def file_weights(path: Path) -> WeightsBreakdown:
    """The exact weight bytes of a weights file, as the engine model that reads it counts them.

    Raises:
        ConfigError: No engine model reads the file; the message names it.
    """
    for m in engine_models().values():
        weights = m.file_weights(path)
        if weights is not None:
            return weights
    raise ConfigError(f"{path}: no engine model reads this file's weights")
