"""Which NVML card a CUDA device number is (CUDA_VISIBLE_DEVICES, by UUID), with a fake NVML.

NVML numbers every card in the machine; CUDA numbers only those CUDA_VISIBLE_DEVICES shows.
One worker per GPU (``CUDA_VISIBLE_DEVICES=N autotune study ...``) must read the memory and
telemetry of card N, not of NVML's card 0.
"""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import pytest

from autotune.hardware import cuda_devices
from autotune.hardware import gpus as hardware
from autotune.hardware import nvml as nvml_mod
from autotune.errors import ConfigError
from autotune.hardware.cuda_devices import cuda_visible_entry, resolve_cuda_device
from autotune.measure.gpu_telemetry import GpuSampler
from tests.test_hardware import V100, _FakeNvml

H200 = {
    "name": "NVIDIA H200",
    "total": 150_754_820_096,
    "cc": (9, 0),
    "mem_clock": 3201,
    "sm_clock": 1980,
    "pcie_gen": 5,
}
UUID_A = "GPU-8f2c1e2a-0001-4a1b-9c3d-111111111111"
UUID_B = "GPU-8f2c77b0-0002-4a1b-9c3d-222222222222"
UUID_C = "GPU-d41d8cd9-0003-4a1b-9c3d-333333333333"
# NVML's own order is not assumed to be PCI bus order: card B (NVML 1) has the lowest bus id.
CARDS = [
    {**H200, "uuid": UUID_A, "bus": "00000000:41:00.0", "used": 1 * 2**30},
    {**H200, "uuid": UUID_B, "bus": "00000000:18:00.0", "used": 2 * 2**30},
    {
        **H200,
        "uuid": UUID_C,
        "bus": "00000000:9A:00.0",
        "used": 3 * 2**30,
        "migs": [None, {"uuid": "MIG-5e3a0c11-aaaa-bbbb-cccc-444444444444"}],
    },
]


class _MappingNvml(_FakeNvml):
    """The fake NVML of test_hardware, with UUIDs, PCI bus ids, MIG instances and the readings
    the telemetry sampler takes."""

    NVML_TEMPERATURE_GPU = 0

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"].encode()  # old bindings return bytes

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=h["bus"].encode())

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return len(h.get("migs", []))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        if h["migs"][i] is None:
            raise self.NVMLError("Not Found")  # an empty MIG slot
        return h["migs"][i]

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 40

    def nvmlDeviceGetClockInfo(self, h, clock):
        return h["sm_clock"]

    def nvmlDeviceGetPowerUsage(self, h):
        return 100_000

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return 0

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return []


@pytest.fixture
def nvml(monkeypatch):
    """Three H200s behind a fake NVML; the CUDA driver absent, so the variable is read."""
    fake = _MappingNvml(CARDS)
    monkeypatch.setattr(nvml_mod, "load", lambda: fake)
    monkeypatch.setattr(cuda_devices, "_cuda_driver_uuid", lambda index: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    return fake


def resolve(visible: str | None, cuda_index: int = 0, **env: str):
    environ = dict(env) if visible is None else {"CUDA_VISIBLE_DEVICES": visible, **env}
    return resolve_cuda_device(cuda_index, environ=environ)


def test_unset_counts_cards_in_pci_bus_order(nvml):
    assert [resolve(None, i).nvml_index for i in range(3)] == [1, 0, 2]
    d = resolve(None, 0)
    assert d.uuid == UUID_B and d.how == "index in PCI bus order"
    assert d.note is None  # identical cards: FASTEST_FIRST has nothing to reorder
    assert nvml.shutdown_called


def test_an_index_is_the_nth_card_by_pci_bus_id(nvml):
    assert resolve("1").nvml_index == 0
    assert resolve("2").uuid == UUID_C
    # gpu_index counts the cards the variable shows.
    assert resolve("2,0", 1).nvml_index == 1


@pytest.mark.parametrize("entry", [UUID_A, UUID_A.lower(), UUID_A.upper(), "GPU-8f2c1e"])
def test_a_uuid_or_a_unique_prefix_of_one(nvml, entry):
    d = resolve(entry)
    assert (d.nvml_index, d.uuid, d.how) == (0, UUID_A, "UUID")


def test_a_mig_instance_is_read_on_its_card(nvml):
    d = resolve("MIG-5e3a0c11-aaaa")
    assert (d.nvml_index, d.how) == (2, "MIG UUID") and d.uuid.startswith("MIG-5e3a0c11")
    assert resolve(f"MIG-{UUID_C}/1/0").nvml_index == 2  # the old MIG-GPU-<uuid>/<gi>/<ci> form


@pytest.mark.parametrize(
    "visible, cuda_index, why",
    [
        ("GPU-dead", 0, r"is 'GPU-dead', which no card's UUID starts with"),
        ("GPU-8f2c", 0, r"which more than one card's UUID starts with"),
        ("3", 0, r"is index 3, but NVML sees 3 GPU\(s\)"),
        ("1", 1, r"shows 1 GPU\(s\) but \[hardware\] gpu_index is 1"),
        ("", 0, r"shows 0 GPU\(s\)"),
        ("nvidia0", 0, r"not an index, a GPU-<uuid> or a MIG-<uuid>"),
    ],
)
def test_no_match_names_the_variable_and_what_was_found(nvml, visible, cuda_index, why):
    with pytest.raises(ConfigError, match=why) as err:
        resolve(visible, cuda_index)
    message = str(err.value)
    assert f"CUDA_VISIBLE_DEVICES={visible!r}" in message
    if "NVML sees" in message:
        assert f"1: NVIDIA H200 {UUID_B} (PCI 00000000:18:00.0)" in message


def test_mixed_cards_by_index_under_cuda_s_default_order_carry_a_note(monkeypatch):
    mixed = [{**V100, "uuid": UUID_A, "bus": "00000000:3b:00.0"}, {**CARDS[1]}]
    monkeypatch.setattr(nvml_mod, "load", lambda: _MappingNvml(mixed))
    monkeypatch.setattr(cuda_devices, "_cuda_driver_uuid", lambda index: None)
    with pytest.warns(UserWarning, match="CUDA_DEVICE_ORDER is not PCI_BUS_ID"):
        d = resolve("0")
    assert d.nvml_index == 1 and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in d.note
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve("0", CUDA_DEVICE_ORDER="PCI_BUS_ID").note is None
        assert resolve(UUID_A).note is None  # a UUID is certain whatever the order


def test_the_cuda_driver_s_own_answer_wins(nvml, monkeypatch):
    # The driver applies CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER itself: its UUID is certain.
    monkeypatch.setattr(cuda_devices, "_cuda_driver_uuid", lambda index: UUID_C[len("GPU-") :])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    d = resolve_cuda_device(0)
    assert (d.nvml_index, d.how, d.note) == (2, "CUDA driver", None)


def test_the_engine_is_shown_the_user_s_own_entry():
    assert cuda_visible_entry(2, {}) == "2"
    assert cuda_visible_entry(0, {"CUDA_VISIBLE_DEVICES": "GPU-8f2c"}) == "GPU-8f2c"
    assert cuda_visible_entry(1, {"CUDA_VISIBLE_DEVICES": "3, GPU-8f2c"}) == "GPU-8f2c"


def test_auto_gpu_is_the_card_cuda_visible_devices_shows(monkeypatch):
    cards = [{**V100, "uuid": UUID_A, "bus": "00000000:3b:00.0"}, {**CARDS[1], "bus": "00000000:5e:00.0"}]
    monkeypatch.setattr(nvml_mod, "load", lambda: _MappingNvml(cards))
    monkeypatch.setattr(cuda_devices, "_cuda_driver_uuid", lambda index: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", UUID_B)
    assert hardware.resolve_gpu("auto", 0).key == "h200"  # not the V100, NVML's card 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-dead")
    with pytest.raises(ConfigError, match=r"^s\.toml: \[hardware\] gpu = 'auto': CUDA_VISIBLE_DEVICES='GPU-dead'"):
        hardware.resolve_gpu("auto", 0, source="s.toml: [hardware] gpu")


def test_telemetry_reads_the_card_the_engine_runs_on(nvml, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # what PynvmlReader imports
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with GpuSampler(index=0) as gpu:
        pass
    t = gpu.result()
    assert t.available, t.reason
    assert t.gpu_uuid == UUID_C and t.baseline_used_bytes == 3 * 2**30  # not NVML's card 0 (1 GiB used)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-dead")
    with GpuSampler(index=0) as gpu:
        pass
    assert not gpu.result().available and "CUDA_VISIBLE_DEVICES='GPU-dead'" in gpu.result().reason


class _FakeLibcuda:
    """libcuda's four calls as ctypes makes them: CUresult 0 is success."""

    def __init__(self, uuid: str, init_result: int = 0):
        self.raw = bytes.fromhex(uuid.replace("-", ""))
        self.init_result = init_result

    def cuInit(self, flags):
        return self.init_result

    def cuDeviceGet(self, device, ordinal):
        device._obj.value = ordinal
        return 0 if ordinal < 2 else 101  # CUDA_ERROR_INVALID_DEVICE past the cards it shows

    def cuDeviceGetUuid_v2(self, raw, device):
        raw[:] = list(self.raw)
        return 0


def test_the_cuda_driver_is_asked_through_ctypes(monkeypatch):
    bare = UUID_B[len("GPU-") :]
    monkeypatch.setattr(cuda_devices.ctypes, "CDLL", lambda name: _FakeLibcuda(bare))
    assert cuda_devices._cuda_driver_uuid(0) == bare
    assert cuda_devices._cuda_driver_uuid(2) is None
    monkeypatch.setattr(cuda_devices.ctypes, "CDLL", lambda name: _FakeLibcuda(bare, init_result=100))
    assert cuda_devices._cuda_driver_uuid(0) is None  # CUDA_ERROR_NO_DEVICE: the variable hides every card

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cuda_devices.ctypes, "CDLL", no_driver)
    assert cuda_devices._cuda_driver_uuid(0) is None
