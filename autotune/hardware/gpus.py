"""GPUs: the catalog of known cards and an NVML probe of the cards in this machine (which of
them is this process's CUDA device N: ``autotune.hardware.cuda_devices``).

The catalog (``autotune/data/gpus.toml``) gives the numbers a memory or speed model needs for a
card that is not in front of us (the digital twin answering "how would this run on a V100?").
:func:`detect_gpus` asks NVML about the cards that are, matches them to the catalog by the name
NVML reports, and :func:`spec_for_detected` turns any detected card, known or not, into a
``GpuSpec``.

NVML is optional: on a machine without the driver or without a GPU, :func:`detect_gpus` returns
an empty list and :func:`nvml_unavailable_reason` says why.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from autotune.hardware import nvml as _nvml
from autotune._catalog import read_catalog
from autotune.hardware.cuda_devices import resolve_cuda_device
from autotune.errors import ConfigError, UnknownNameError

__all__ = [
    "DetectedGpu",
    "GpuSpec",
    "detect_gpus",
    "get_gpu",
    "load_gpu_catalog",
    "match_catalog",
    "nvml_unavailable_reason",
    "resolve_gpu",
    "spec_for_detected",
    "CPU_KEY",
    "cpu_spec",
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
_FP16_TENSOR_PER_FP32 = {
    "6": 1 / 64,
    "7.0": 8.0,
    "7.2": 8.0,
    "7.5": 8.0,
    "8.0": 16.0,
    "8.6": 2.0,
    "8.7": 2.0,
    "8.9": 2.0,
    "9.0": 14.8,
}


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
    def is_cpu(self) -> bool:
        """The host itself (``[hardware] gpu = "cpu"``): no GPU is used, memory is host memory."""
        return self.key == CPU_KEY

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
    for name in (
        "mem_bandwidth_gb_s",
        "fp16_tensor_tflops",
        "fp32_tflops",
        "boost_clock_mhz",
        "pcie_gb_s",
        "host_mem_gb_s",
    ):
        values[name] = float(values[name])
    return GpuSpec(key=key, **values)


@functools.lru_cache(maxsize=1)
def _catalog() -> Mapping[str, GpuSpec]:
    return read_catalog(_CATALOG_FILE, _spec_from_table, skip=("links",))  # links: autotune/hardware/links.py


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
        nvml = _nvml.load()
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
            driver = _nvml.text(nvml.nvmlSystemGetDriverVersion())
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
        _nvml.optional(nvml.nvmlShutdown)


def _probe(nvml: Any, index: int, driver: str) -> DetectedGpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _nvml.text(nvml.nvmlDeviceGetName(handle))
    mem = nvml.nvmlDeviceGetMemoryInfo(handle)
    cc = _nvml.optional(nvml.nvmlDeviceGetCudaComputeCapability, handle)
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
        memory_bus_width_bits=_nvml.optional(getattr(nvml, "nvmlDeviceGetMemoryBusWidth", None), handle),
        max_memory_clock_mhz=_nvml.optional(nvml.nvmlDeviceGetMaxClockInfo, handle, clock_mem),
        max_sm_clock_mhz=_nvml.optional(nvml.nvmlDeviceGetMaxClockInfo, handle, clock_sm),
        n_cuda_cores=_nvml.optional(getattr(nvml, "nvmlDeviceGetNumGpuCores", None), handle),
        pcie_gen=_nvml.optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        pcie_width=_nvml.optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
    )


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


# [hardware] gpu = "cpu": the study runs on the host, and its memory budget is host memory.
CPU_KEY = "cpu"
# ASSUMPTION for the CPU mode's bandwidth, GB/s: what one process streams from dual-channel
# DDR4/DDR5 on a desktop or a small cloud VM (the gpus.toml header's host_mem_gb_s reasoning).
# Only a model backend's prediction (the twin's prior) reads it; the study measures the truth
# and the online calibration refits the twin to it.
_CPU_MEM_GB_S = 30.0


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_memory_bytes() -> int:
    """This machine's physical memory (``/proc/meminfo`` MemTotal, else sysconf): what a
    configuration's host-resident part (layers or experts left on the host, their KV cache,
    pinned buffers) is checked against, whatever the engine."""
    total = _meminfo_bytes("MemTotal")
    if total is None:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "CPU"


def cpu_spec() -> GpuSpec:
    """This machine's CPU and host memory as the study's device (``[hardware] gpu = "cpu"``).

    Memory is the host's total (``/proc/meminfo``): a configuration's weights, KV cache and
    buffers all live there, and the study's memory budget is checked against it. The speed
    figures are assumptions, as for an unknown card; nothing here pretends to be a GPU model.
    """
    total = host_memory_bytes()
    cores = os.cpu_count() or 1
    return GpuSpec(
        key=CPU_KEY,
        name=f"CPU: {_cpu_name()} ({cores} threads), host memory",
        nvml_names=(),
        vram_bytes=int(total),
        mem_bandwidth_gb_s=_CPU_MEM_GB_S,
        # ~16 FP32 FLOP per cycle per core (one AVX2 FMA port) at ~3 GHz: a rough bound.
        fp16_tensor_tflops=round(cores * 16 * 3e9 / 1e12, 3),
        fp32_tflops=round(cores * 16 * 3e9 / 1e12, 3),
        boost_clock_mhz=3000.0,
        compute_capability="0.0",
        bf16=False,
        pcie_gen=3,
        pcie_gb_s=16.0,
        host_mem_gb_s=_CPU_MEM_GB_S,
        source="this machine's CPU (/proc/cpuinfo, /proc/meminfo); bandwidth and FLOPS assumed",
    )


def resolve_gpu(key: str, index: int = 0, *, source: str = "--gpu") -> GpuSpec:
    """The card a study or an estimate is for: a catalog key, or the one NVML finds for ``auto``.

    Args:
        key: A catalog key, ``auto``, or ``cpu`` (the host: :func:`cpu_spec`).
        index: For ``auto``, which card: CUDA's number for it in this process (the study's
            ``gpu_index``, counted among the cards CUDA_VISIBLE_DEVICES shows).
        source: How to name the setting in errors (``path: [hardware] gpu``, ``--gpu``).

    Raises:
        ConfigError: No GPU for ``auto``, none that CUDA_VISIBLE_DEVICES and ``index`` name,
            or an unknown key.
    """
    if key == CPU_KEY:
        return cpu_spec()
    if key == "auto":
        found = detect_gpus()
        if not found:
            reason = nvml_unavailable_reason() or "no GPU found"
            raise ConfigError(
                f"{source} = 'auto': no GPU detected ({reason}); name a catalog GPU such as v100-16gb, "
                f"or '{CPU_KEY}' to run on this machine's CPU"
            )
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
