"""GPUs: the catalog of known cards, an NVML probe of the cards in this machine, and which of
them is this process's CUDA device N (:func:`resolve_cuda_device`).

The catalog (``autotune/data/gpus.toml``) gives the numbers a memory or speed model needs for a
card that is not in front of us (the digital twin answering "how would this run on a V100?").
:func:`detect_gpus` asks NVML about the cards that are, matches them to the catalog by the name
NVML reports, and :func:`spec_for_detected` turns any detected card, known or not, into a
``GpuSpec``.

NVML is optional: on a machine without the driver or without a GPU, :func:`detect_gpus` returns
an empty list and :func:`nvml_unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from autotune._catalog import read_catalog
from autotune.errors import ConfigError, UnknownNameError

__all__ = [
    "CudaDevice",
    "DetectedGpu",
    "GpuSpec",
    "cuda_visible_entry",
    "detect_gpus",
    "get_gpu",
    "load_gpu_catalog",
    "match_catalog",
    "nvml_unavailable_reason",
    "resolve_cuda_device",
    "resolve_gpu",
    "spec_for_detected",
]

_CATALOG_FILE = "gpus.toml"

# Practical one-direction x16 throughput per PCIe generation, GB/s: 8/16/32 GT/s per lane with
# 128b/130b encoding gives 15.75/31.5/63 GB/s for x16, rounded as in the catalog's comments.
_PCIE_X16_GB_S = {1: 4, 2: 8, 3: 16, 4: 32, 5: 64, 6: 128}

# host_mem_gb_s for a card that is not in the catalog: an ASSUMPTION keyed on the PCIe
# generation as a proxy for the host's age (see gpus.toml's header for the reasoning behind
# each figure). gen3 is the article's DDR4 host (seed/ARTICLE.md, 40-50 GB/s).
_HOST_MEM_GB_S_BY_PCIE_GEN = {1: 20, 2: 30, 3: 45, 4: 80, 5: 250, 6: 250}

# Dense FP16 tensor FLOPs per FP32 FLOP, by compute capability, for estimating an unknown card's
# fp16_tensor_tflops from its FP32 rate. Ratios of the catalog's own datasheet figures:
# sm_70 V100 125/15.7 = 8.0; sm_75 T4 65/8.1 = 8.0; sm_80 A100 312/19.5 = 16; sm_86 GeForce
# 3090 71/35.6 = 2.0 (A10 is 4.0: the lower, GeForce ratio is the safe guess); sm_89 4090
# 165.2/82.6 = 2.0 (L4 4.0); sm_90 H100 989/67 = 14.8. Pascal (sm_6x) has no tensor cores and
# FP16 at 1/64 rate on GP102/GP104.
_FP16_TENSOR_PER_FP32 = {"6": 1 / 64, "7.0": 8.0, "7.2": 8.0, "7.5": 8.0, "8.0": 16.0, "8.6": 2.0,
                         "8.7": 2.0, "8.9": 2.0, "9.0": 14.8}


@dataclass(frozen=True)
class GpuSpec:
    """What the memory and speed models know about one kind of GPU.

    Attributes:
        key: Catalog key (``v100-16gb``), or ``nvml:<name>`` for a card built from NVML.
        name: Marketing name.
        nvml_names: Names ``nvmlDeviceGetName`` returns for this card.
        vram_bytes: Total device memory as NVML reports it (after ECC/firmware reservations).
        mem_bandwidth_gb_s: Peak DRAM bandwidth, GB/s (1e9 B/s).
        fp16_tensor_tflops: Dense FP16 tensor-core throughput, TFLOPS (no sparsity).
        fp32_tflops: FP32 throughput, TFLOPS.
        boost_clock_mhz: Boost clock of the SMs, MHz.
        compute_capability: CUDA compute capability, "major.minor".
        bf16: Whether the card supports BF16 natively (sm_80 and later).
        pcie_gen: Host-link PCIe generation.
        pcie_gb_s: Practical one-direction host-link throughput, GB/s.
        host_mem_gb_s: Assumed host memory bandwidth of a typical machine with this card, GB/s.
        source: Where the numbers come from.
    """

    key: str
    name: str
    nvml_names: tuple[str, ...]
    vram_bytes: int
    mem_bandwidth_gb_s: float
    fp16_tensor_tflops: float
    fp32_tflops: float
    boost_clock_mhz: float
    compute_capability: str
    bf16: bool
    pcie_gen: int
    pcie_gb_s: float
    host_mem_gb_s: float
    source: str

    @property
    def compute_capability_tuple(self) -> tuple[int, int]:
        """The compute capability as ``(major, minor)``, for comparisons like ``>= (8, 0)``."""
        major, _, minor = self.compute_capability.partition(".")
        return int(major), int(minor or 0)


@dataclass(frozen=True)
class DetectedGpu:
    """One GPU as NVML sees it now.

    Attributes:
        index: NVML device index, over every card in the machine (:func:`resolve_cuda_device`
            says which one a CUDA device number is).
        nvml_name: ``nvmlDeviceGetName``.
        total_bytes: Total device memory.
        used_bytes: Memory in use, by any process, at detection time.
        free_bytes: Memory free at detection time.
        driver_version: ``nvmlSystemGetDriverVersion``.
        compute_capability: "major.minor".
        spec: The catalog entry whose ``nvml_names`` match, or None for an unknown card.
        memory_bus_width_bits: ``nvmlDeviceGetMemoryBusWidth``, or None if NVML lacks it.
        max_memory_clock_mhz: ``nvmlDeviceGetMaxClockInfo(NVML_CLOCK_MEM)``, or None.
        max_sm_clock_mhz: ``nvmlDeviceGetMaxClockInfo(NVML_CLOCK_SM)``, or None.
        n_cuda_cores: ``nvmlDeviceGetNumGpuCores`` (newer drivers), or None.
        pcie_gen: Maximum PCIe link generation of the slot and card, or None.
        pcie_width: Maximum PCIe link width, or None.
    """

    index: int
    nvml_name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    driver_version: str
    compute_capability: str
    spec: GpuSpec | None
    memory_bus_width_bits: int | None = None
    max_memory_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    n_cuda_cores: int | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None


# ---------------------------------------------------------------------------------------------
# The catalog
# ---------------------------------------------------------------------------------------------

_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "nvml_names": (list,),
    "vram_bytes": (int,),
    "mem_bandwidth_gb_s": (int, float),
    "fp16_tensor_tflops": (int, float),
    "fp32_tflops": (int, float),
    "boost_clock_mhz": (int, float),
    "compute_capability": (str,),
    "bf16": (bool,),
    "pcie_gen": (int,),
    "pcie_gb_s": (int, float),
    "host_mem_gb_s": (int, float),
    "source": (str,),
}


def _spec_from_table(key: str, table: Mapping[str, Any], where: str) -> GpuSpec:
    problems = []
    for name, kinds in _FIELD_TYPES.items():
        value = table.get(name)
        if value is None:
            problems.append(f"field '{name}' missing")
        elif not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            problems.append(f"field '{name}' = {value!r}: wrong type")
    if not problems and not re.fullmatch(r"\d+\.\d+", table["compute_capability"]):
        problems.append(f"field 'compute_capability' = {table['compute_capability']!r}: use 'major.minor'")
    if problems:
        raise ConfigError(f"{where}: [{key}] " + "; ".join(problems))
    values = {name: table[name] for name in _FIELD_TYPES}
    values["nvml_names"] = tuple(str(n) for n in values["nvml_names"])
    for name in ("mem_bandwidth_gb_s", "fp16_tensor_tflops", "fp32_tflops", "boost_clock_mhz", "pcie_gb_s",
                 "host_mem_gb_s"):
        values[name] = float(values[name])
    return GpuSpec(key=key, **values)


@functools.lru_cache(maxsize=1)
def _catalog() -> Mapping[str, GpuSpec]:
    return read_catalog(_CATALOG_FILE, _spec_from_table)


def load_gpu_catalog() -> dict[str, GpuSpec]:
    """Returns the GPU catalog shipped in ``autotune/data/gpus.toml``.

    The file is parsed once; every call returns a fresh dict of the same (immutable) specs.

    Returns:
        Catalog key -> GpuSpec, in file order.

    Raises:
        ConfigError: The shipped file is malformed (a packaging bug).
    """
    return dict(_catalog())


def get_gpu(key: str) -> GpuSpec:
    """Looks a GPU up in the catalog.

    Args:
        key: A catalog key such as ``v100-16gb``.

    Returns:
        The catalog's GpuSpec.

    Raises:
        UnknownNameError: ``key`` is not in the catalog; the message lists the known keys.
    """
    catalog = _catalog()
    try:
        return catalog[key]
    except KeyError:
        raise UnknownNameError(f"unknown GPU '{key}' (known: {', '.join(catalog)})") from None


def match_catalog(nvml_name: str, total_bytes: int | None = None) -> GpuSpec | None:
    """Finds the catalog entry for a name NVML returned.

    Names are compared case-insensitively. NVML's name does not always pin the memory size
    (an "NVIDIA GeForce RTX 3060" has 12 GB or 8 GB), so when ``total_bytes`` is given the entry
    whose ``vram_bytes`` is nearest wins, and an entry more than 10% off is no match.

    Args:
        nvml_name: ``nvmlDeviceGetName``'s answer.
        total_bytes: The card's total memory, when known.

    Returns:
        The matching GpuSpec, or None.
    """
    wanted = nvml_name.strip().casefold()
    candidates = [s for s in _catalog().values() if any(n.casefold() == wanted for n in s.nvml_names)]
    if not candidates:
        return None
    if total_bytes is None:
        return candidates[0]
    best = min(candidates, key=lambda s: abs(s.vram_bytes - total_bytes))
    # 10%: ECC on/off moves the total by ~6% (A10: 23028 vs 24564 MiB); a different memory
    # size moves it by 33% or more (RTX 3060: 8 vs 12 GB).
    return best if abs(best.vram_bytes - total_bytes) <= 0.10 * best.vram_bytes else None


# ---------------------------------------------------------------------------------------------
# NVML
# ---------------------------------------------------------------------------------------------

_nvml_reason: str | None = None
_nvml_probed = False


def _import_pynvml() -> Any:
    """Imports pynvml (package nvidia-ml-py); a function so tests can replace it."""
    import pynvml

    return pynvml


def _as_str(value: Any) -> str:
    # nvidia-ml-py returned bytes before 11.515; str since.
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(call: Any, *args: Any) -> Any:
    """Calls an NVML query that old drivers or some cards do not support; None on any failure."""
    try:
        return call(*args)
    except Exception:  # NVMLError_NotSupported, FunctionNotFound, AttributeError on old bindings
        return None


def has_gpu() -> bool:
    """Whether NVML sees at least one GPU here (False without a driver)."""
    try:
        return bool(detect_gpus())
    except Exception:  # noqa: BLE001 - no NVML: no GPU
        return False


def detect_gpus() -> list[DetectedGpu]:
    """Lists the GPUs NVML can see, matched against the catalog.

    Never raises because NVML or a GPU is missing: it returns ``[]`` and records the reason for
    :func:`nvml_unavailable_reason`.

    Returns:
        One DetectedGpu per device, in NVML index order.
    """
    global _nvml_reason, _nvml_probed
    _nvml_probed = True
    try:
        nvml = _import_pynvml()
    except ImportError as exc:
        _nvml_reason = f"pynvml is not installed ({exc}); install nvidia-ml-py"
        return []
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded / NoPermission ...
        _nvml_reason = f"NVML could not start: {exc}"
        return []
    try:
        try:
            count = int(nvml.nvmlDeviceGetCount())
            driver = _as_str(nvml.nvmlSystemGetDriverVersion())
        except Exception as exc:
            _nvml_reason = f"NVML query failed: {exc}"
            return []
        found: list[DetectedGpu] = []
        errors: list[str] = []
        for index in range(count):
            try:
                found.append(_probe(nvml, index, driver))
            except Exception as exc:  # one broken device (e.g. fallen off the bus) must not hide the rest
                errors.append(f"GPU {index}: {exc}")
        if found:
            _nvml_reason = None
        elif errors:
            _nvml_reason = "NVML could not read any GPU: " + "; ".join(errors)
        else:
            _nvml_reason = "NVML found no GPU"
        return found
    finally:
        _optional(nvml.nvmlShutdown)


def _probe(nvml: Any, index: int, driver: str) -> DetectedGpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _as_str(nvml.nvmlDeviceGetName(handle))
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    cc = _optional(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    compute_capability = f"{cc[0]}.{cc[1]}" if cc else "0.0"
    clock_mem = getattr(nvml, "NVML_CLOCK_MEM", 2)
    clock_sm = getattr(nvml, "NVML_CLOCK_SM", 1)
    total = int(mem.total)
    return DetectedGpu(
        index=index,
        nvml_name=name,
        total_bytes=total,
        used_bytes=int(mem.used),
        free_bytes=int(mem.free),
        driver_version=driver,
        compute_capability=compute_capability,
        spec=match_catalog(name, total),
        memory_bus_width_bits=_optional(getattr(nvml, "nvmlDeviceGetMemoryBusWidth", None), handle),
        max_memory_clock_mhz=_optional(nvml.nvmlDeviceGetMaxClockInfo, handle, clock_mem),
        max_sm_clock_mhz=_optional(nvml.nvmlDeviceGetMaxClockInfo, handle, clock_sm),
        n_cuda_cores=_optional(getattr(nvml, "nvmlDeviceGetNumGpuCores", None), handle),
        pcie_gen=_optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        pcie_width=_optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
    )


# ---------------------------------------------------------------------------------------------
# Which card CUDA device N of this process is
# ---------------------------------------------------------------------------------------------

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
        raise ConfigError(f"{_VISIBLE}={env[_VISIBLE]!r} shows {len(entries)} GPU(s) but [hardware] gpu_index is "
                          f"{cuda_index}: gpu_index counts the GPUs {_VISIBLE} shows, from 0")
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
            uuid, name = _as_str(nvml.nvmlDeviceGetUUID(handle)), _as_str(nvml.nvmlDeviceGetName(handle))
        except Exception:  # noqa: BLE001 - NVMLError_GpuIsLost and the like
            continue
        pci = _optional(nvml.nvmlDeviceGetPciInfo, handle)
        migs = []
        for slot in range(_optional(getattr(nvml, "nvmlDeviceGetMaxMigDeviceCount", None), handle) or 0):
            mig = _optional(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)  # empty slots raise
            mig_uuid = _optional(nvml.nvmlDeviceGetUUID, mig) if mig is not None else None
            if mig_uuid is not None:
                migs.append(_as_str(mig_uuid))
        bus = _as_str(pci.busId).lower() if pci is not None else f"nvml-{index:04d}"
        cards.append((index, uuid, bus, name, migs))
    return cards


def resolve_cuda_device(cuda_index: int = 0, *, environ: Mapping[str, str] | None = None,
                        nvml: Any = None) -> CudaDevice:
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
            nvml = _import_pynvml()
            nvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound / DriverNotLoaded ...
            raise ConfigError(f"cannot tell which GPU CUDA device {cuda_index} is: NVML is not usable ({exc})") from None
    try:
        cards = _nvml_cards(nvml)
    except Exception as exc:  # nvmlDeviceGetCount failed: NVML is there but answers nothing
        raise ConfigError(f"cannot tell which GPU CUDA device {cuda_index} is: NVML query failed ({exc})") from None
    finally:
        if own:
            _optional(nvml.nvmlShutdown)
    setting = f"{_VISIBLE}={env[_VISIBLE]!r}" if _VISIBLE in env else f"{_VISIBLE} unset"
    found = "; ".join(f"{i}: {name} {uuid} (PCI {bus})" for i, uuid, bus, name, _ in cards) or "none"

    def nothing(why: str) -> ConfigError:
        return ConfigError(f"{setting}: CUDA device {cuda_index} ([hardware] gpu_index) {why}; NVML sees {found}")

    driver_uuid = _cuda_driver_uuid(cuda_index) if environ is None else None
    if driver_uuid is not None:
        for index, uuid, _, _, migs in cards:
            for candidate in (uuid, *migs):
                if candidate.lower()[len("GPU-"):] == driver_uuid:
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
        note = (f"CUDA device {cuda_index} taken as the card at index {entry} in PCI bus order ({name}, {uuid}); "
                f"CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA may number these mixed cards otherwise: set "
                f"CUDA_DEVICE_ORDER=PCI_BUS_ID or name the card by UUID in {_VISIBLE} (nvidia-smi -L)")
        if note not in _warned:
            _warned.add(note)
            warnings.warn(note, stacklevel=2)
    return CudaDevice(index, uuid, "index in PCI bus order", note)


def nvml_unavailable_reason() -> str | None:
    """Says why the last :func:`detect_gpus` found nothing.

    Probes once if :func:`detect_gpus` has not run yet.

    Returns:
        A one-line reason ("NVML could not start: ..."), or None when GPUs were found.
    """
    if not _nvml_probed:
        detect_gpus()
    return _nvml_reason


def spec_for_detected(d: DetectedGpu) -> GpuSpec:
    """Builds the GpuSpec for a detected card.

    A card the catalog knows gets the catalog's spec, with ``vram_bytes`` replaced by NVML's
    live total (ECC mode and driver reservations move it; the card in hand is the authority).
    An unknown card gets a spec from NVML alone:

    * bandwidth = bus width (bits) x max memory clock x 2 (double data rate) / 8, which gives
      898 GB/s for a V100 (4096 bit, 877 MHz) and 1008 GB/s for an RTX 4090 (384 bit, 10501 MHz
      as NVML reports GDDR6X); 0.0 when NVML lacks either number;
    * FP32 = CUDA cores x 2 FLOP x max SM clock, when NVML reports the core count; FP16 tensor
      from it by a per-architecture ratio of the catalog's own datasheet figures;
    * BF16 from compute capability >= 8.0; PCIe throughput from the link generation and width;
    * host memory bandwidth: an assumption by PCIe generation (see ``gpus.toml``).

    Args:
        d: A card from :func:`detect_gpus`.

    Returns:
        The GpuSpec to model this card with.
    """
    if d.spec is not None:
        return replace(d.spec, vram_bytes=d.total_bytes)

    bandwidth_gb_s = 0.0
    if d.memory_bus_width_bits and d.max_memory_clock_mhz:
        bandwidth_gb_s = d.memory_bus_width_bits * d.max_memory_clock_mhz * 1e6 * 2 / 8 / 1e9
    fp32_tflops = 0.0
    if d.n_cuda_cores and d.max_sm_clock_mhz:
        fp32_tflops = d.n_cuda_cores * 2 * d.max_sm_clock_mhz * 1e6 / 1e12
    major, _, minor = d.compute_capability.partition(".")
    ratio = _FP16_TENSOR_PER_FP32.get(d.compute_capability, _FP16_TENSOR_PER_FP32.get(major))
    if ratio is None:
        # Newer than this table: assume at least the Hopper ratio rather than nothing.
        ratio = 14.8 if major.isdigit() and int(major) > 9 else 1.0
    gen = d.pcie_gen or 3
    width = d.pcie_width or 16
    pcie_gb_s = _PCIE_X16_GB_S.get(gen, 16) * width / 16
    slug = re.sub(r"[^a-z0-9]+", "-", d.nvml_name.casefold()).strip("-")
    bf16 = major.isdigit() and int(major) >= 8
    return GpuSpec(
        key=f"nvml:{slug}",
        name=d.nvml_name,
        nvml_names=(d.nvml_name,),
        vram_bytes=d.total_bytes,
        mem_bandwidth_gb_s=round(bandwidth_gb_s, 1),
        fp16_tensor_tflops=round(fp32_tflops * ratio, 2),
        fp32_tflops=round(fp32_tflops, 2),
        # A card NVML cannot give a clock for gets a middling one (Volta/Ampere datacenter).
        boost_clock_mhz=float(d.max_sm_clock_mhz or 1500),
        compute_capability=d.compute_capability if minor else f"{major}.0",
        bf16=bf16,
        pcie_gen=gen,
        pcie_gb_s=float(pcie_gb_s),
        host_mem_gb_s=float(_HOST_MEM_GB_S_BY_PCIE_GEN.get(gen, 45)),
        source=(
            f"NVML on this machine (driver {d.driver_version}): memory, compute capability, "
            "bus width x memory clock; TFLOPS estimated from core count and clock; host_mem_gb_s assumed"
        ),
    )


def resolve_gpu(key: str, index: int = 0, *, source: str = "--gpu") -> GpuSpec:
    """The card a study or an estimate is for: a catalog key, or the one NVML finds for ``auto``.

    Args:
        key: A catalog key or ``auto``.
        index: For ``auto``, which card: CUDA's number for it in this process (the study's
            ``gpu_index``, counted among the cards CUDA_VISIBLE_DEVICES shows).
        source: How to name the setting in errors (``path: [hardware] gpu``, ``--gpu``).

    Raises:
        ConfigError: No GPU for ``auto``, none that CUDA_VISIBLE_DEVICES and ``index`` name,
            or an unknown key.
    """
    if key == "auto":
        found = detect_gpus()
        if not found:
            reason = nvml_unavailable_reason() or "no GPU found"
            raise ConfigError(f"{source} = 'auto': no GPU detected ({reason}); name a catalog GPU such as v100-16gb")
        try:
            nvml_index = resolve_cuda_device(index).nvml_index
        except ConfigError as exc:
            raise ConfigError(f"{source} = 'auto': {exc}") from None
        d = next((d for d in found if d.index == nvml_index), None)
        if d is None:
            raise ConfigError(f"{source} = 'auto': NVML could not read GPU {nvml_index}, CUDA device {index}")
        return d.spec if d.spec is not None else spec_for_detected(d)
    try:
        return get_gpu(key)
    except ConfigError as exc:
        raise ConfigError(f"{source} = {key!r}: {exc}") from None
