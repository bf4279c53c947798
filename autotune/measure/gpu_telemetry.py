"""What the GPU did while a measurement ran, read through NVML, and measuring under it.

* :class:`GpuSampler` samples one GPU in a thread (memory, temperature, clocks, power,
  throttling) as :class:`GpuTelemetry`, or says cleanly that there is no GPU.
* :func:`measure_with_telemetry` is every backend's measuring block: repeat by the protocol
  while the sampler watches the engine, and take the configuration's peak memory.
"""

from __future__ import annotations

import os

import statistics
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol as _TypingProtocol

from autotune.errors import ConfigError
from autotune.hardware.cuda_devices import CudaDevice, resolve_cuda_device
from autotune.measure.protocol import Protocol, Stat, _is_real, repeat_until_stable_many

__all__ = [
    "GpuSampler",
    "GpuTelemetry",
    "NvmlReader",
    "PynvmlReader",
    "SLOWDOWN_REASONS",
    "THROTTLE_REASON_BITS",
    "measure_with_telemetry",
    "throttle_reason_names",
]


#: NVML clock event (formerly "throttle") reason bits, by name. The bit values
#: are the same in the old ...ThrottleReasons and new ...ClocksEventReasons APIs.
THROTTLE_REASON_BITS: Mapping[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
    "board_limit": 0x200,
    "reliability": 0x400,
}

#: Reasons that mean the GPU ran slower than it could because of power or
#: heat; "gpu_idle" and the settings reasons are normal and not listed.
SLOWDOWN_REASONS: frozenset[str] = frozenset(
    {
        "sw_power_cap",
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
    }
)


def throttle_reason_names(mask: int) -> tuple[str, ...]:
    """Returns the names of the bits set in an NVML clock event reason mask.

    Unknown bits (a newer driver) become ``"unknown_0x..."`` rather than vanish.
    """
    names = [name for name, bit in THROTTLE_REASON_BITS.items() if mask & bit]
    known = 0
    for bit in THROTTLE_REASON_BITS.values():
        known |= bit
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"unknown_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return tuple(names)


class NvmlReader(_TypingProtocol):
    """What :class:`GpuSampler` needs from NVML for one GPU; fakes implement it in tests.

    Any method may raise when the GPU does not support that reading; the
    sampler then leaves that field out and keeps the others. A reader of a
    real card also has ``device`` (a :class:`~autotune.hardware.gpus.CudaDevice`):
    which card it reads, recorded with the telemetry.
    """

    def name(self) -> str:
        """Returns the GPU's marketing name."""

    def memory_used_bytes(self) -> int:
        """Returns device memory in use by everyone."""

    def temperature_c(self) -> float:
        """Returns the GPU core temperature."""

    def sm_clock_mhz(self) -> float:
        """Returns the current SM clock."""

    def power_w(self) -> float:
        """Returns the current board power draw."""

    def throttle_mask(self) -> int:
        """Returns the current clock event reason bits."""

    def process_used_bytes(self, pid: int) -> int | None:
        """Returns memory used by compute process ``pid``, None if not listed/unknown."""

    def close(self) -> None:
        """Releases NVML."""


class PynvmlReader:
    """:class:`NvmlReader` over the real NVML via ``pynvml`` (nvidia-ml-py)."""

    def __init__(self, index: int):
        """Initialises NVML and opens the card that is this process's CUDA device ``index``.

        Raises:
            ImportError: nvidia-ml-py is not installed.
            RuntimeError: NVML or the GPU is not there; the message says which.
            ConfigError: CUDA_VISIBLE_DEVICES and ``index`` name no card NVML sees.
        """
        try:
            import pynvml  # Imported here so the module loads on machines without it.
        except ImportError as exc:
            raise ImportError(f"pynvml is missing ({exc}): pip install nvidia-ml-py") from exc

        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise RuntimeError(f"NVML could not start ({exc}): no NVIDIA driver here") from exc
        try:
            # NVML numbers every card in the machine; CUDA, and so the engine, only those
            # CUDA_VISIBLE_DEVICES shows: read the card the engine runs on, not NVML's card N.
            self.device = resolve_cuda_device(index, nvml=pynvml)
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.device.nvml_index)
        except BaseException:
            pynvml.nvmlShutdown()
            raise
        # Newer drivers renamed "throttle reasons" to "clocks event reasons";
        # old bindings only have the old name.
        self._reasons_fn = (
            getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        self._temperature_v = hasattr(pynvml, "nvmlDeviceGetTemperatureV")

    def name(self) -> str:
        name = self._nvml.nvmlDeviceGetName(self._handle)
        return name.decode() if isinstance(name, bytes) else str(name)

    def memory_used_bytes(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def temperature_c(self) -> float:
        nvml = self._nvml
        if self._temperature_v:
            try:
                return float(nvml.nvmlDeviceGetTemperatureV(self._handle, nvml.NVML_TEMPERATURE_GPU))
            except nvml.NVMLError:
                # The versioned call is missing from older drivers; the old one
                # is deprecated but present everywhere so far.
                self._temperature_v = False
        return float(nvml.nvmlDeviceGetTemperature(self._handle, nvml.NVML_TEMPERATURE_GPU))

    def sm_clock_mhz(self) -> float:
        return float(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))

    def power_w(self) -> float:
        return self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0  # mW -> W

    def throttle_mask(self) -> int:
        return int(self._reasons_fn(self._handle))

    def process_used_bytes(self, pid: int) -> int | None:
        # The engine's whole process group: autotune starts each engine as the leader of a
        # session of its own (autotune.toolkit.processes), and servers such as vLLM and SGLang hold
        # the card's memory in worker processes they start, not in the process autotune ran.
        used = [
            p.usedGpuMemory
            for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
            if p.pid == pid or _group_of(p.pid) == pid
        ]
        # usedGpuMemory is None where the driver hides it (WDDM, some containers).
        known = [u for u in used if u is not None]
        return int(sum(known)) if known else None

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def _group_of(pid: int) -> int | None:
    """The process group of ``pid`` (None: gone, or not visible from here)."""
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@dataclass(frozen=True)
class GpuTelemetry:
    """What the GPU did while a measurement ran.

    Fields other than ``available``/``reason``/``throttle_reasons``/
    ``n_samples`` are None when unavailable or never read successfully.

    Attributes:
        available: False when there was no NVML or no such GPU.
        reason: Why not available (or a per-metric failure note), else None.
        gpu_name: NVML's name of the GPU.
        gpu_uuid: NVML's UUID of the card read (which of several identical cards it was).
        device_note: Why that may not be the engine's card (see ``resolve_cuda_device``).
        peak_used_bytes: Highest device memory in use (all processes).
        baseline_used_bytes: Device memory in use when sampling started.
        peak_process_bytes: Highest memory of the watched pid.
        max_temp_c: Highest core temperature.
        min_sm_clock_mhz: Lowest SM clock.
        median_sm_clock_mhz: Median SM clock.
        max_power_w: Highest board power.
        throttle_reasons: Union of the clock event reasons seen, in bit order.
        n_samples: Samples taken.
    """

    available: bool
    reason: str | None = None
    gpu_name: str | None = None
    gpu_uuid: str | None = None
    device_note: str | None = None
    peak_used_bytes: int | None = None
    baseline_used_bytes: int | None = None
    peak_process_bytes: int | None = None
    max_temp_c: float | None = None
    min_sm_clock_mhz: float | None = None
    median_sm_clock_mhz: float | None = None
    max_power_w: float | None = None
    throttle_reasons: tuple[str, ...] = ()
    n_samples: int = 0

    @property
    def peak_delta_bytes(self) -> int | None:
        """Peak minus baseline: the memory the measured work added, when no pid is watched."""
        if self.peak_used_bytes is None or self.baseline_used_bytes is None:
            return None
        return self.peak_used_bytes - self.baseline_used_bytes

    @property
    def slowdowns(self) -> tuple[str, ...]:
        """The throttle reasons that mean power or heat slowed the GPU down."""
        return tuple(r for r in self.throttle_reasons if r in SLOWDOWN_REASONS)

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-ready dict."""
        d = vars(self).copy()
        d["throttle_reasons"] = list(self.throttle_reasons)
        d["peak_delta_bytes"] = self.peak_delta_bytes
        d["slowdowns"] = list(self.slowdowns)
        return d


class GpuSampler:
    """Samples one GPU in a daemon thread while a measurement runs.

    Use as a context manager; read :meth:`result` after (or during) the
    block. One sample is taken on entry (the baseline) and one on exit, so
    even a block shorter than ``interval_s`` has readings. Without NVML or
    without the GPU the sampler does nothing and :meth:`result` says why.

    Example::

        with GpuSampler(index=0, pid=server.pid) as gpu:
            stats = repeat_until_stable_many(run_once, protocol, units, key="aggregate_tok_s")
        telemetry = gpu.result()
    """

    def __init__(
        self,
        index: int = 0,
        interval_s: float = 0.1,
        pid: int | None = None,
        reader_factory: Callable[[int], NvmlReader] | None = None,
    ):
        """Prepares a sampler; nothing is opened before entering the context.

        Args:
            index: The engine's card as CUDA numbers it in this process (the study's
                ``gpu_index``, counted among the cards CUDA_VISIBLE_DEVICES shows);
                the real reader finds NVML's card for it by UUID.
            interval_s: Seconds between samples, > 0.
            pid: Process whose own GPU memory to record too (with its process group, for
                engines whose workers hold the memory), or None.
            reader_factory: Opens a reader for ``index``; defaults to
                :class:`PynvmlReader`. Whatever it raises means "no GPU".
        """
        if not _is_real(interval_s) or interval_s <= 0:
            raise ConfigError(f"GpuSampler interval_s = {interval_s!r}: must be a finite number of seconds > 0")
        self.index = index
        self.interval_s = float(interval_s)
        self.pid = pid
        self._factory = reader_factory or PynvmlReader
        self._reader: NvmlReader | None = None
        self._unavailable: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpu_name: str | None = None
        self._device: CudaDevice | None = None
        self._baseline_used_bytes: int | None = None
        self._used_bytes: list[int] = []
        self._process_bytes: list[int] = []
        self._temps_c: list[float] = []
        self._clocks_mhz: list[float] = []
        self._powers_w: list[float] = []
        self._mask = 0
        self._n_samples = 0
        self._failed: set[str] = set()

    def __enter__(self) -> GpuSampler:
        try:
            self._reader = self._factory(self.index)
        except Exception as exc:  # noqa: BLE001 - any failure here just means "no GPU".
            self._unavailable = f"no GPU telemetry for GPU {self.index}: {exc}"
            return self
        self._device = getattr(self._reader, "device", None)
        try:
            self._gpu_name = self._reader.name()
        except Exception:  # noqa: BLE001 - the name is decoration, not a reason to stop.
            self._failed.add("name")
        self.sample_now()
        self._baseline_used_bytes = self._used_bytes[0] if self._used_bytes else None
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"autotune-gpu-sampler-{self.index}")
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._reader is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
        self.sample_now()
        try:
            self._reader.close()
        except Exception:  # noqa: BLE001 - closing must not mask the block's outcome.
            pass
        self._reader = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample_now()

    def _read(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:  # noqa: BLE001 - one unsupported reading must not stop the rest.
            self._failed.add(what)
            return None

    def sample_now(self) -> None:
        """Takes one sample immediately (e.g. right after a model has loaded)."""
        reader = self._reader
        if reader is None:
            return
        with self._lock:
            used = self._read("memory", reader.memory_used_bytes)
            temp = self._read("temperature", reader.temperature_c)
            clock = self._read("sm_clock", reader.sm_clock_mhz)
            power = self._read("power", reader.power_w)
            mask = self._read("throttle_reasons", reader.throttle_mask)
            proc = None
            if self.pid is not None:
                proc = self._read("process_memory", lambda: reader.process_used_bytes(self.pid))
            if used is not None:
                self._used_bytes.append(int(used))
            if temp is not None:
                self._temps_c.append(float(temp))
            if clock is not None:
                self._clocks_mhz.append(float(clock))
            if power is not None:
                self._powers_w.append(float(power))
            if mask is not None:
                self._mask |= int(mask)
            if proc is not None:
                self._process_bytes.append(int(proc))
            self._n_samples += 1

    def result(self) -> GpuTelemetry:
        """Returns the telemetry so far; available=False with a reason when there is no GPU."""
        if self._unavailable is not None:
            return GpuTelemetry(available=False, reason=self._unavailable)
        if self._n_samples == 0:
            return GpuTelemetry(available=False, reason="GpuSampler was never entered: use it as a context manager")
        with self._lock:
            return GpuTelemetry(
                available=True,
                reason=(
                    f"readings not supported on this GPU: {', '.join(sorted(self._failed))}" if self._failed else None
                ),
                gpu_name=self._gpu_name,
                gpu_uuid=self._device.uuid if self._device is not None else None,
                device_note=self._device.note if self._device is not None else None,
                peak_used_bytes=max(self._used_bytes, default=None),
                baseline_used_bytes=self._baseline_used_bytes,
                peak_process_bytes=max(self._process_bytes, default=None),
                max_temp_c=max(self._temps_c, default=None),
                min_sm_clock_mhz=min(self._clocks_mhz, default=None),
                median_sm_clock_mhz=statistics.median(self._clocks_mhz) if self._clocks_mhz else None,
                max_power_w=max(self._powers_w, default=None),
                throttle_reasons=throttle_reason_names(self._mask),
                n_samples=self._n_samples,
            )


def measure_with_telemetry(
    sample: Callable[[], Mapping[str, float]],
    protocol: Protocol,
    units: Mapping[str, str],
    key: str,
    *,
    gpu: bool,
    gpu_index: int = 0,
    pid: int | None = None,
    reader_factory: Callable[[int], NvmlReader] | None = None,
    probe: Callable[[Mapping[str, float]], bool] | None = None,
) -> tuple[dict[str, Stat], GpuTelemetry | None, int | None]:
    """Every backend's measuring block: repeat ``sample`` by the protocol while NVML watches.

    Args:
        sample, protocol, units, key, probe: As for :func:`repeat_until_stable_many`.
        gpu: Whether the engine runs on a GPU; without one no telemetry is taken.
        gpu_index: The engine's card: the study's ``gpu_index`` (see :class:`GpuSampler`).
        pid: The engine's process, for its own peak memory.
        reader_factory: As for :class:`GpuSampler` (tests pass fake NVML readers).

    Returns:
        The stats; the telemetry (None without a GPU); the peak device memory of the
        configuration: the process's own peak where NVML reports per-process memory, else
        the rise of the card's used memory, None when neither was readable.
    """
    if not gpu:
        return repeat_until_stable_many(sample, protocol, units, key=key, probe=probe), None, None
    with GpuSampler(index=gpu_index, pid=pid, reader_factory=reader_factory) as sampler:
        stats = repeat_until_stable_many(sample, protocol, units, key=key, probe=probe)
    telemetry = sampler.result()
    peak = None
    if telemetry.available:
        peak = telemetry.peak_process_bytes if telemetry.peak_process_bytes is not None else telemetry.peak_delta_bytes
    return stats, telemetry, peak
