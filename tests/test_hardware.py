"""Tests for autotune.hardware.gpus: the GPU catalog and the NVML probe (with a fake NVML)."""

from __future__ import annotations

from types import SimpleNamespace

import tomllib

import pytest

from tests.conftest import REPO

from autotune.hardware import gpus as hardware
from autotune.hardware import nvml as nvml_mod
from autotune.errors import ConfigError, UnknownNameError
from autotune.hardware.gpus import (
    DetectedGpu,
    GpuSpec,
    detect_gpus,
    get_gpu,
    load_gpu_catalog,
    match_catalog,
    nvml_unavailable_reason,
    spec_for_detected,
)


@pytest.fixture
def reference() -> dict:
    """The article's measured rows and figures (shared/reference/)."""
    return tomllib.loads((REPO / "reference" / "article_v100_qwen27b.toml").read_text())


REQUIRED_KEYS = [
    "v100-16gb",
    "v100-32gb",
    "p40",
    "t4",
    "rtx3060-12gb",
    "rtx3090",
    "rtx4090",
    "a10",
    "l4",
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h200",
]


# ------------------------------------------------------------------------------------- catalog


def test_catalog_has_every_required_card():
    catalog = load_gpu_catalog()
    missing = [k for k in REQUIRED_KEYS if k not in catalog]
    assert not missing, f"catalog lacks {missing}"


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_every_entry_is_complete_and_sane(key):
    spec = get_gpu(key)
    assert spec.key == key
    assert spec.source.strip(), "every entry names its source"
    assert spec.name and spec.nvml_names and all(spec.nvml_names)
    assert 8 * 2**30 < spec.vram_bytes <= 160 * 2**30
    assert 100 < spec.mem_bandwidth_gb_s < 10_000
    assert spec.fp32_tflops > 1 and spec.fp16_tensor_tflops > 0
    assert spec.pcie_gb_s == {3: 16, 4: 32, 5: 64}[spec.pcie_gen]
    assert spec.host_mem_gb_s > 0
    # BF16 arrives with sm_80 (Ampere); sm_61/70/75 lack it.
    assert spec.bf16 == (spec.compute_capability_tuple >= (8, 0))


def test_nvml_names_are_unique_across_the_catalog():
    seen: dict[str, str] = {}
    for key, spec in load_gpu_catalog().items():
        for name in spec.nvml_names:
            assert name.casefold() not in seen, f"{name!r} in both {seen.get(name.casefold())} and {key}"
            seen[name.casefold()] = key


def test_v100_matches_the_article():
    v100 = get_gpu("v100-16gb")
    # seed/ARTICLE.md: HBM2 ~900 GB/s, sm_70, no BF16, PCIe 3.0 x16 ~16 GB/s, DDR4 40-50 GB/s.
    assert (v100.mem_bandwidth_gb_s, v100.compute_capability, v100.bf16) == (900, "7.0", False)
    assert (v100.pcie_gen, v100.pcie_gb_s, v100.host_mem_gb_s) == (3, 16, 45)


def test_v100_matches_the_article_reference_file(reference):
    ref = reference["gpu"]
    v100 = get_gpu("v100-16gb")
    assert v100.mem_bandwidth_gb_s == ref["hbm_gb_s"] == 900
    assert v100.pcie_gb_s == ref["pcie_gb_s"] == 16
    assert v100.host_mem_gb_s == ref["host_mem_gb_s"] == 45
    assert v100.compute_capability == ref["compute_capability"] == "7.0"
    assert v100.bf16 is ref["bf16"] is False
    assert v100.vram_bytes == 16945512448  # NVML's total for a 16 GB V100
    assert round(v100.vram_bytes / 2**30) == ref["vram_gib"]


def test_known_datasheet_figures():
    assert get_gpu("h200").mem_bandwidth_gb_s == 4800
    assert get_gpu("h100-sxm").mem_bandwidth_gb_s == 3350
    assert get_gpu("a100-80gb").fp16_tensor_tflops == 312
    assert get_gpu("t4").compute_capability == "7.5"
    assert get_gpu("p40").compute_capability == "6.1"


def test_get_gpu_unknown_lists_known_keys():
    with pytest.raises(UnknownNameError) as err:
        get_gpu("v100")
    msg = str(err.value)
    assert msg.startswith("unknown GPU 'v100' (known: v100-16gb, v100-32gb, ")
    assert msg.endswith(")")
    assert isinstance(err.value, ConfigError)


def test_catalog_is_cached_but_callers_get_their_own_dict():
    a = load_gpu_catalog()
    a.pop("t4")
    b = load_gpu_catalog()
    assert "t4" in b
    assert b["v100-16gb"] is get_gpu("v100-16gb")


def test_specs_are_immutable():
    with pytest.raises(AttributeError):
        get_gpu("t4").vram_bytes = 1  # type: ignore[misc]


def test_match_catalog_is_case_insensitive_and_checks_memory():
    assert match_catalog("tesla v100-sxm2-16gb").key == "v100-16gb"
    assert match_catalog("NVIDIA H200").key == "h200"
    assert match_catalog("NVIDIA GeForce RTX 3060", 12 * 2**30).key == "rtx3060-12gb"
    # The 8 GB RTX 3060 has the same NVML name; it is not the catalog's 12 GB card.
    assert match_catalog("NVIDIA GeForce RTX 3060", 8 * 2**30) is None
    # ECC off moves an A10's total by ~6%: still the A10.
    assert match_catalog("NVIDIA A10", 24564 * 2**20).key == "a10"
    assert match_catalog("NVIDIA B200") is None


# ----------------------------------------------------------------------------------------- NVML


class _FakeNvml:
    """Just enough of pynvml for detect_gpus, with per-device answers."""

    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    class NVMLError(Exception):
        pass

    def __init__(self, devices, init_error=None):
        self.devices = devices
        self.init_error = init_error
        self.shutdown_called = False

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdown_called = True

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlSystemGetDriverVersion(self):
        return b"550.54.15"  # old bindings return bytes

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.devices[i]

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetMemoryInfo(self, h):
        if h.get("broken"):
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(total=h["total"], used=h["used"], free=h["total"] - h["used"])

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return h["cc"]

    def nvmlDeviceGetMemoryBusWidth(self, h):
        if "bus" not in h:
            raise self.NVMLError("Not Supported")
        return h["bus"]

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        return h["mem_clock"] if clock == self.NVML_CLOCK_MEM else h["sm_clock"]

    def nvmlDeviceGetNumGpuCores(self, h):
        if "cores" not in h:
            raise self.NVMLError("Function Not Found")
        return h["cores"]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return h["pcie_gen"]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return 16


V100 = {
    "name": "Tesla V100-PCIE-16GB",
    "total": 16945512448,
    "used": 300 * 2**20,
    "cc": (7, 0),
    "bus": 4096,
    "mem_clock": 877,
    "sm_clock": 1380,
    "cores": 5120,
    "pcie_gen": 3,
}
UNKNOWN = {
    "name": "NVIDIA RTX 6000 Ada Generation",
    "total": 51527024640,
    "used": 0,
    "cc": (8, 9),
    "bus": 384,
    "mem_clock": 10001,
    "sm_clock": 2505,
    "cores": 18176,
    "pcie_gen": 4,
}


def _use_fake(monkeypatch, fake):
    monkeypatch.setattr(nvml_mod, "load", lambda: fake)


def test_detect_gpus_without_pynvml_returns_empty(monkeypatch):
    def missing():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(nvml_mod, "load", missing)
    assert detect_gpus() == []
    assert "nvidia-ml-py" in nvml_unavailable_reason()


def test_detect_gpus_without_driver_returns_empty(monkeypatch):
    fake = _FakeNvml([], init_error=_FakeNvml.NVMLError("NVML Shared Library Not Found"))
    _use_fake(monkeypatch, fake)
    assert detect_gpus() == []
    assert nvml_unavailable_reason() == "NVML could not start: NVML Shared Library Not Found"


def test_detect_gpus_without_gpu_returns_empty(monkeypatch):
    fake = _FakeNvml([])
    _use_fake(monkeypatch, fake)
    assert detect_gpus() == []
    assert nvml_unavailable_reason() == "NVML found no GPU"
    assert fake.shutdown_called


def test_detect_gpus_on_this_machine_never_raises():
    # Whatever this machine has: a list, and a reason exactly when it is empty.
    gpus = detect_gpus()
    assert isinstance(gpus, list)
    assert (nvml_unavailable_reason() is None) == bool(gpus)


def test_detect_gpus_reads_and_matches(monkeypatch):
    fake = _FakeNvml([V100, UNKNOWN, {**V100, "broken": True}])
    _use_fake(monkeypatch, fake)
    gpus = detect_gpus()
    assert [g.index for g in gpus] == [0, 1]  # the lost GPU is skipped, not fatal
    v100, other = gpus
    assert v100.nvml_name == "Tesla V100-PCIE-16GB"
    assert v100.total_bytes == 16945512448
    assert v100.used_bytes + v100.free_bytes == v100.total_bytes
    assert v100.driver_version == "550.54.15"
    assert v100.compute_capability == "7.0"
    assert v100.spec is get_gpu("v100-16gb")
    assert other.spec is None
    assert nvml_unavailable_reason() is None
    assert fake.shutdown_called


def test_spec_for_known_card_keeps_catalog_but_live_memory():
    d = DetectedGpu(0, "Tesla V100-SXM2-16GB", 16945000000, 0, 16945000000, "535", "7.0", get_gpu("v100-16gb"))
    spec = spec_for_detected(d)
    assert spec.key == "v100-16gb"
    assert spec.mem_bandwidth_gb_s == 900
    assert spec.vram_bytes == 16945000000


def test_spec_for_unknown_card_from_nvml(monkeypatch):
    _use_fake(monkeypatch, _FakeNvml([UNKNOWN]))
    (d,) = detect_gpus()
    spec = spec_for_detected(d)
    assert isinstance(spec, GpuSpec)
    assert spec.key == "nvml:nvidia-rtx-6000-ada-generation"
    assert spec.vram_bytes == UNKNOWN["total"]
    # 384 bit x 10001 MHz x 2 / 8 = 960 GB/s (the card's datasheet says 960 GB/s).
    assert spec.mem_bandwidth_gb_s == pytest.approx(960.1, abs=0.1)
    # 18176 cores x 2 x 2.505 GHz = 91.1 TFLOPS (datasheet: 91.1).
    assert spec.fp32_tflops == pytest.approx(91.06, abs=0.01)
    assert spec.fp16_tensor_tflops > spec.fp32_tflops
    assert spec.compute_capability == "8.9"
    assert spec.bf16 is True
    assert spec.pcie_gen == 4 and spec.pcie_gb_s == 32
    assert spec.host_mem_gb_s > 0
    assert "NVML" in spec.source


def test_spec_for_unknown_card_with_a_poor_nvml():
    d = DetectedGpu(0, "Some GPU", 8 * 2**30, 0, 8 * 2**30, "470", "7.5", None)
    spec = spec_for_detected(d)
    assert spec.mem_bandwidth_gb_s == 0.0  # unknown, said as zero rather than guessed
    assert spec.bf16 is False
    assert spec.pcie_gb_s == 16  # gen3 x16 assumed


def test_v100_bandwidth_formula_matches_datasheet(monkeypatch):
    # Bus width x memory clock x 2 / 8 on a V100 gives its 900 GB/s datasheet figure (898).
    d = DetectedGpu(0, "Tesla V100-PCIE-16GB", 16945512448, 0, 0, "535", "7.0", None, 4096, 877, 1380, 5120, 3, 16)
    assert spec_for_detected(d).mem_bandwidth_gb_s == pytest.approx(898, abs=1)


def test_resolve_gpu_names_the_setting_in_its_errors(monkeypatch):
    from autotune.hardware import gpus as hardware
    from autotune.errors import ConfigError

    assert hardware.resolve_gpu("v100-16gb").key == "v100-16gb"
    with pytest.raises(ConfigError, match=r"^--gpu = 'v101': "):
        hardware.resolve_gpu("v101")
    monkeypatch.setattr(hardware, "detect_gpus", lambda: [])
    with pytest.raises(ConfigError, match=r"^s\.toml: \[hardware\] gpu = 'auto': no GPU detected .*v100-16gb"):
        hardware.resolve_gpu("auto", source="s.toml: [hardware] gpu")


def test_cpu_is_the_host_with_its_memory():
    spec = hardware.resolve_gpu("cpu", source="[hardware] gpu")
    assert spec.is_cpu and spec.key == "cpu" and spec.nvml_names == ()
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert spec.vram_bytes == total_kib * 1024
    assert not hardware.get_gpu("t4").is_cpu
