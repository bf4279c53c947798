"""NVML, which may be missing: pynvml imported on demand, its strings, its optional queries.

``autotune.hardware.gpus`` (the cards of this machine) and ``autotune.hardware.cuda_devices`` (which of them is
this process's CUDA device N) both read NVML through these three functions; tests replace
:func:`load` to put a fake NVML behind both.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load", "optional", "text"]


def load() -> Any:
    """Imports pynvml (package nvidia-ml-py); here, not at the top: a machine without it still
    runs the twin, and tests replace this function."""
    import pynvml

    return pynvml


def text(value: Any) -> str:
    # nvidia-ml-py returned bytes before 11.515; str since.
    return value.decode() if isinstance(value, bytes) else str(value)


def optional(call: Any, *args: Any) -> Any:
    """Calls an NVML query that old drivers or some cards do not support; None on any failure."""
    try:
        return call(*args)
    except Exception:  # NVMLError_NotSupported, FunctionNotFound, AttributeError on old bindings
        return None
