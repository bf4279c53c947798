"""Which card CUDA device N of this process is, in NVML's numbering, by UUID.

CUDA numbers the cards ``CUDA_VISIBLE_DEVICES`` shows (in ``CUDA_DEVICE_ORDER``); NVML numbers
every card of the machine in PCI bus order. A worker started with ``CUDA_VISIBLE_DEVICES=1``
runs its engine on card 1 and must read memory and telemetry from card 1 too:
:func:`resolve_cuda_device` asks the CUDA driver for the card's UUID (through ctypes: no
torch, no context), else reads the variable's entry, and finds that UUID in NVML.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autotune.hardware import nvml as _nvml
from autotune.errors import ConfigError

__all__ = ["CudaDevice", "cuda_visible_entry", "resolve_cuda_device"]


_VISIBLE = "CUDA_VISIBLE_DEVICES"
_warned: set[str] = set()


@dataclass(frozen=True)
class CudaDevice:
    """The NVML device behind one CUDA device number of this process.

    Attributes:
        nvml_index: NVML's index of the card (of the parent card, for a MIG instance).
        uuid: NVML's UUID of the card (``GPU-...``), or of the MIG instance (``MIG-...``).
        how: How it was matched ("CUDA driver", "UUID", "MIG UUID", "index in PCI bus order").
        note: Why the match may be wrong, or None when it is certain.
    """

    nvml_index: int
    uuid: str
    how: str
    note: str | None = None


def cuda_visible_entry(cuda_index: int = 0, environ: Mapping[str, str] | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows a child process exactly this process's
    CUDA device ``cuda_index``: the user's own entry for it, as written (so that the engine
    resolves it as this process does), or the index itself when the variable is unset.

    Raises:
        ConfigError: the variable has fewer entries than ``cuda_index + 1``.
    """
    env = os.environ if environ is None else environ
    if _VISIBLE not in env:
        return str(cuda_index)
    entries = [e.strip() for e in env[_VISIBLE].split(",") if e.strip()]
    if cuda_index >= len(entries):
        raise ConfigError(
            f"{_VISIBLE}={env[_VISIBLE]!r} shows {len(entries)} GPU(s) but [hardware] gpu_index is "
            f"{cuda_index}: gpu_index counts the GPUs {_VISIBLE} shows, from 0"
        )
    return entries[cuda_index]


def _cuda_driver_uuid(cuda_index: int) -> str | None:
    """The UUID (hex digits and dashes) of CUDA device ``cuda_index`` as the CUDA driver itself
    numbers it for this process, CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER applied; None when
    there is no usable driver. Through libcuda and ctypes: no torch, no context, no memory."""
    try:
        lib = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
        device = ctypes.c_int()
        raw = (ctypes.c_ubyte * 16)()
        get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid  # _v2: a MIG instance's own
        if lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(device), cuda_index) or get_uuid(raw, device):
            return None
    except (OSError, AttributeError):
        return None
    h = bytes(raw).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _nvml_cards(nvml: Any) -> list[tuple[int, str, str, str, list[str]]]:
    """(NVML index, UUID, PCI bus id, name, its MIG instances' UUIDs) of every card NVML can
    read; as in :func:`detect_gpus`, a card fallen off the bus does not hide the rest."""
    cards = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid, name = _nvml.text(nvml.nvmlDeviceGetUUID(handle)), _nvml.text(nvml.nvmlDeviceGetName(handle))
        except Exception:  # noqa: BLE001 - NVMLError_GpuIsLost and the like
            continue
        pci = _nvml.optional(nvml.nvmlDeviceGetPciInfo, handle)
        migs = []
        for slot in range(_nvml.optional(getattr(nvml, "nvmlDeviceGetMaxMigDeviceCount", None), handle) or 0):
            mig = _nvml.optional(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)  # empty slots raise
            mig_uuid = _nvml.optional(nvml.nvmlDeviceGetUUID, mig) if mig is not None else None
            if mig_uuid is not None:
                migs.append(_nvml.text(mig_uuid))
        bus = _nvml.text(pci.busId).lower() if pci is not None else f"nvml-{index:04d}"
        cards.append((index, uuid, bus, name, migs))
    return cards


def resolve_cuda_device(
    cuda_index: int = 0, *, environ: Mapping[str, str] | None = None, nvml: Any = None
) -> CudaDevice:
    """Which NVML device this process's CUDA device ``cuda_index`` is (the study's ``gpu_index``).

    NVML numbers every card in the machine, whatever CUDA_VISIBLE_DEVICES says; CUDA numbers
    only the ones it shows. The CUDA driver's own answer (the card's UUID) is taken when libcuda
    is there and ``environ`` is this process's; otherwise the CUDA_VISIBLE_DEVICES entry is
    read: a UUID or a unique prefix of one (``GPU-8f2c``), a MIG instance (``MIG-...``), or an
    index. An index counts cards in PCI bus order; that is CUDA's order only under
    CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA's default, FASTEST_FIRST, puts faster cards first), so
    otherwise, on a machine of mixed cards, the answer carries a note and a warning.

    Args:
        cuda_index: The CUDA device number, counted among the devices CUDA_VISIBLE_DEVICES shows.
        environ: The environment to read (default: this process's).
        nvml: An initialised pynvml (default: imported, initialised and shut down here).

    Raises:
        ConfigError: NVML is not usable, or CUDA_VISIBLE_DEVICES names no card NVML sees; the
            message gives the variable's value and the cards found.
    """
    env = os.environ if environ is None else environ
    own = nvml is None
    if own:
        try:
            nvml = _nvml.load()
            nvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound / DriverNotLoaded ...
            raise ConfigError(
                f"cannot tell which GPU CUDA device {cuda_index} is: NVML is not usable ({exc})"
            ) from None
    try:
        cards = _nvml_cards(nvml)
    except Exception as exc:  # nvmlDeviceGetCount failed: NVML is there but answers nothing
        raise ConfigError(f"cannot tell which GPU CUDA device {cuda_index} is: NVML query failed ({exc})") from None
    finally:
        if own:
            _nvml.optional(nvml.nvmlShutdown)
    setting = f"{_VISIBLE}={env[_VISIBLE]!r}" if _VISIBLE in env else f"{_VISIBLE} unset"
    found = "; ".join(f"{i}: {name} {uuid} (PCI {bus})" for i, uuid, bus, name, _ in cards) or "none"

    def nothing(why: str) -> ConfigError:
        return ConfigError(f"{setting}: CUDA device {cuda_index} ([hardware] gpu_index) {why}; NVML sees {found}")

    driver_uuid = _cuda_driver_uuid(cuda_index) if environ is None else None
    if driver_uuid is not None:
        for index, uuid, _, _, migs in cards:
            for candidate in (uuid, *migs):
                if candidate.lower()[len("GPU-") :] == driver_uuid:
                    return CudaDevice(index, candidate, "CUDA driver")
    entry = cuda_visible_entry(cuda_index, env)
    if entry.upper().startswith(("GPU-", "MIG-")):
        wanted = entry.lower()
        if wanted.startswith("mig-gpu-"):  # the old MIG-GPU-<card uuid>/<gi>/<ci> form names its card
            wanted = wanted[4:].split("/")[0]
        hits = [(index, c) for index, uuid, _, _, migs in cards for c in (uuid, *migs) if c.lower().startswith(wanted)]
        if len(hits) != 1:
            raise nothing(f"is {entry!r}, which {'no' if not hits else 'more than one'} card's UUID starts with")
        index, uuid = hits[0]
        return CudaDevice(index, uuid, "MIG UUID" if uuid.upper().startswith("MIG-") else "UUID")
    if not entry.isdigit():
        raise nothing(f"is {entry!r}: not an index, a GPU-<uuid> or a MIG-<uuid>")
    by_bus = sorted(cards, key=lambda c: c[2])
    if int(entry) >= len(by_bus):
        raise nothing(f"is index {entry}, but NVML sees {len(by_bus)} GPU(s)")
    index, uuid, _, name, _ = by_bus[int(entry)]
    note = None
    # FASTEST_FIRST ranks cards by kind; identical cards tie and keep PCI bus order, so only a
    # machine of mixed cards can be numbered otherwise.
    if env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID" and len({c[3] for c in cards}) > 1:
        note = (
            f"CUDA device {cuda_index} taken as the card at index {entry} in PCI bus order ({name}, {uuid}); "
            f"CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA may number these mixed cards otherwise: set "
            f"CUDA_DEVICE_ORDER=PCI_BUS_ID or name the card by UUID in {_VISIBLE} (nvidia-smi -L)"
        )
        if note not in _warned:
            _warned.add(note)
            warnings.warn(note, stacklevel=2)
    return CudaDevice(index, uuid, "index in PCI bus order", note)
