"""What the two exllama formats (EXL2, EXL3) read alike from a model directory: the
``quantization_config`` their converters write in config.json, a directory quoted as the
``family:bpw`` format it is in, and a bits per weight as written. Shared by the exllamav2 and
exllamav3 plugins (neither owns it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from autotune._builtin import read_config_json

__all__ = ["bpw_within", "quantization_config", "quote_directory", "spell"]


def quantization_config(cfg: Mapping[str, Any], method: str) -> Mapping[str, Any] | None:
    """A config.json's ``quantization_config`` when its ``quant_method`` is ``method`` and it
    states numeric ``bits`` (EXL2's and EXL3's converters both write it so), else None."""
    q = cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == method and isinstance(q.get("bits"), (int, float)):
        return q
    return None


def quote_directory(
    source: Path, family: str, quantization: Callable[[Mapping[str, Any], Path], Any]
) -> tuple[str, int] | None:
    """A model directory (or its config.json) as the ``family:bpw`` format ``quantization`` reads
    from its config.json (an object with ``bits``, or None) and its bytes on disk, or None."""
    directory = source.parent if source.name == "config.json" else source
    quant = quantization(read_config_json(directory), directory / "config.json") if directory.is_dir() else None
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors")) if quant is not None else 0
    return (f"{family}:{spell(quant.bits)}", size) if quant is not None and size else None


def bpw_within(variant: str, low: float, high: float) -> float:
    """A written bits per weight -> the number, if from ``low`` to ``high``.

    Raises:
        ValueError: Not a number, or outside the range.
    """
    bpw = float(variant)  # ValueError for "four"
    if not low <= bpw <= high:  # NaN fails this too
        raise ValueError(variant)
    return bpw


def spell(bpw: float) -> str:
    """The canonical spelling of a bpw, to two decimals (``4`` -> ``4.0``, ``3.254`` -> ``3.25``)."""
    return str(round(float(bpw), 2))
