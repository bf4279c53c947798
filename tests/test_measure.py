"""Tests of the benchmark protocol: deterministic samples, fake clocks, fake NVML."""

from __future__ import annotations

import statistics

import itertools
import json
import sys
import threading
import time

import pytest

from autotune.errors import ConfigError, MeasurementError
from autotune.measure import (
    CONCURRENT_UNITS,
    ConcurrentResult,
    GpuSampler,
    GpuTelemetry,
    Protocol,
    Stat,
    measure_with_telemetry,
    StreamResult,
    event_data,
    relative_spread,
    repeat_until_stable_many,
    run_streams_threaded,
    throttle_reason_names,
)

# Generous: only reached when something is broken (e.g. streams not overlapping).
BARRIER_TIMEOUT_S = 5.0


def seq(*values):
    """A sample function returning ``values`` in order, recording how often it ran."""
    it = iter(values)

    def sample():
        sample.calls += 1
        return next(it)

    sample.calls = 0
    return sample


def repeat_one(sample, protocol, unit="tok/s", **kwargs):
    """The protocol on a single quantity: ``sample`` returns a bare number each run."""
    return repeat_until_stable_many(lambda: {"v": sample()}, protocol, {"v": unit}, key="v", **kwargs)["v"]


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start_s: float = 1000.0):
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


# --- Protocol ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_runs": 0}, "measure.min_runs = 0: must be an integer >= 1"),
        ({"warmup_runs": -1}, "measure.warmup_runs = -1: must be an integer >= 0"),
        ({"min_runs": 5, "max_runs": 4}, "measure.max_runs = 4: must be an integer >= measure.min_runs (5)"),
        ({"rel_spread_tol": -0.1}, "measure.rel_spread_tol = -0.1: must be a finite number >= 0"),
        ({"rel_spread_tol": float("nan")}, "measure.rel_spread_tol = nan"),
        ({"max_seconds": 0}, "measure.max_seconds = 0: must be a finite number of seconds > 0"),
        ({"min_runs": True}, "measure.min_runs = True"),
        ({"max_runs": 2.5}, "measure.max_runs = 2.5"),
    ],
)
def test_protocol_rejects_bad_fields_naming_field_value_and_rule(kwargs, message):
    with pytest.raises(ConfigError) as info:
        Protocol(**kwargs)
    assert message in str(info.value)


def test_protocol_accepts_edges_and_is_frozen():
    p = Protocol(warmup_runs=0, min_runs=1, max_runs=1, rel_spread_tol=0, max_seconds=0.5)
    assert p.max_runs == 1
    with pytest.raises(AttributeError):
        p.min_runs = 2  # type: ignore[misc]


# --- Stat ---------------------------------------------------------------------


def test_stat_statistics():
    s = Stat(values=[100.0, 110.0, 90.0, 100.0, 300.0], warmups=[5.0], unit="tok/s")
    assert s.values == (100.0, 110.0, 90.0, 100.0, 300.0)  # list became a tuple
    assert s.n == 5
    assert s.median == 100.0
    assert s.mean == pytest.approx(140.0)
    assert s.stdev == pytest.approx(89.7218, rel=1e-4)
    # Deviations 0, 10, 10, 0, 200 -> MAD 10: the one 300 outlier does not count.
    assert s.mad == 10.0
    assert s.rel_spread == pytest.approx(0.10)
    assert (s.min, s.max) == (90.0, 300.0)
    assert not s.stable
    assert "spread 10% of median over 5 runs" in s.warning
    assert "raise measure.max_runs" in s.warning


def test_stat_single_run_and_hashable():
    s = Stat(values=(42,), unit="ms")
    assert (s.n, s.median, s.stdev, s.rel_spread, s.stable, s.warning) == (1, 42.0, 0.0, 0.0, True, None)
    assert hash(s) == hash(Stat(values=(42.0,), unit="ms"))


def test_stat_rejects_empty_and_nonsense():
    with pytest.raises(MeasurementError, match="at least one run"):
        Stat(values=(), warmups=(1.0,), unit="tok/s")
    with pytest.raises(MeasurementError, match="non-finite"):
        Stat(values=(1.0, float("nan")), unit="tok/s")
    with pytest.raises(MeasurementError, match="not all numbers"):
        Stat(values=("fast",), unit="tok/s")


def test_stat_to_dict_is_json_and_complete():
    s = Stat(
        values=(10.0, 11.0, 10.0), warmups=(3.0,), unit="tok/s", rel_spread_tol=0.05, min_runs=3, stop_reason="stable"
    )
    d = json.loads(json.dumps(s.to_dict()))
    assert d["median"] == 10.0
    assert d["spread"] == 0.0
    assert d["n"] == 3
    assert d["values"] == [10.0, 11.0, 10.0]
    assert d["warmups"] == [3.0]
    assert d["unit"] == "tok/s"
    assert d["stable"] is True
    assert d["warning"] is None


def test_stat_zero_median_spread_is_undefined_not_stable():
    s = Stat(values=(-1.0, 0.0, 1.0), unit="x")
    assert s.rel_spread == float("inf")
    assert not s.stable
    assert s.to_dict()["spread"] is None
    json.dumps(s.to_dict(), allow_nan=False)


def test_relative_spread_empty_raises():
    with pytest.raises(MeasurementError):
        relative_spread([])


# --- repetition ---------------------------------------------------------------


def test_stops_early_when_stable_and_keeps_warmups_apart():
    sample = seq(1.0, 100.0, 101.0, 99.0, 500.0, 7.0)
    stat = repeat_one(sample, Protocol(warmup_runs=1, min_runs=3, max_runs=10), "tok/s")
    assert sample.calls == 4  # one warm-up + min_runs, then stable
    assert stat.warmups == (1.0,)
    assert stat.values == (100.0, 101.0, 99.0)
    assert 1.0 not in stat.values
    assert stat.stable and stat.warning is None
    assert stat.stop_reason == "stable"
    assert stat.unit == "tok/s"


def test_noisy_samples_run_to_max_runs_and_warn():
    noisy = [100.0, 150.0, 60.0, 130.0, 80.0, 140.0]
    sample = seq(0.0, *noisy)
    stat = repeat_one(sample, Protocol(warmup_runs=1, min_runs=3, max_runs=6), "tok/s")
    assert sample.calls == 7
    assert stat.values == tuple(noisy)
    assert stat.n == 6
    assert stat.stop_reason == "max_runs"
    assert not stat.stable
    assert stat.warning.startswith(f"spread {stat.rel_spread:.0%} of median over 6 runs")
    assert "let the GPU cool" in stat.warning


def test_max_seconds_keeps_what_was_measured_with_fake_clock():
    clock = FakeClock()
    values = itertools.cycle([100.0, 150.0, 200.0])  # never stable

    def sample():
        clock.advance(1.0)  # each run "takes" one second
        return next(values)

    stat = repeat_one(sample, Protocol(warmup_runs=1, min_runs=3, max_runs=10, max_seconds=4.5), "tok/s", clock=clock)
    # Warm-up ends at 1 s, runs 1-3 at 2, 3, 4 s (min_runs), run 4 at 5 s >= 4.5 s: stop there.
    assert stat.warmups == (100.0,)
    assert stat.values == (150.0, 200.0, 100.0, 150.0)
    assert stat.stop_reason == "max_seconds"
    assert not stat.stable
    assert "raise measure.max_seconds" in stat.warning


@pytest.mark.parametrize("seconds_per_run", [0.1, 1.0, 10.0, 1000.0])
def test_min_runs_are_taken_however_slow_the_runs(seconds_per_run):
    """A loaded machine makes every run slower: the time budget then ends the extra runs the
    spread asks for, never the min_runs the study asked for (on main, 10 s runs under a 2.5 s
    budget gave a one-run median and the CPU study's test n = 1 under load)."""
    clock = FakeClock()
    values = itertools.cycle([100.0, 150.0, 200.0])  # never stable

    def sample():
        clock.advance(seconds_per_run)
        return next(values)

    stat = repeat_one(sample, Protocol(warmup_runs=1, min_runs=3, max_runs=6, max_seconds=2.5), "tok/s", clock=clock)
    assert 3 <= stat.n <= 6 and stat.n == (3 if seconds_per_run >= 1.0 else 6)
    assert stat.stop_reason == ("max_seconds" if seconds_per_run >= 1.0 else "max_runs")


def test_max_seconds_still_takes_one_run_after_long_warmups():
    clock = FakeClock()

    def sample():
        clock.advance(10.0)
        return 5.0

    stat = repeat_one(sample, Protocol(warmup_runs=2, min_runs=1, max_seconds=1.0), "ms", clock=clock)
    assert stat.n == 1 and stat.warmups == (5.0, 5.0)


def test_sample_exception_propagates_unchanged():
    class EngineDied(RuntimeError):
        pass

    def sample():
        raise EngineDied("server exited with code 139")

    with pytest.raises(EngineDied, match="139"):
        repeat_one(sample, Protocol(), "tok/s")


def test_nonsense_sample_value_raises_measurement_error():
    with pytest.raises(MeasurementError, match="sample call 2 key 'v' returned nan"):
        repeat_one(seq(1.0, float("nan")), Protocol(warmup_runs=1), "tok/s")
    with pytest.raises(MeasurementError, match="None"):
        repeat_one(seq(None), Protocol(warmup_runs=0), "tok/s")


def test_many_judges_stability_on_key_and_collects_every_value():
    runs = [
        {"aggregate_tok_s": 1.0, "ttft_ms": 999.0},  # warm-up
        {"aggregate_tok_s": 100.0, "ttft_ms": 50.0},
        {"aggregate_tok_s": 101.0, "ttft_ms": 90.0},  # ttft noisy, does not matter
        {"aggregate_tok_s": 100.0, "ttft_ms": 20.0},
        {"aggregate_tok_s": 100.0, "ttft_ms": 20.0},
    ]
    sample = seq(*runs)
    stats = repeat_until_stable_many(
        sample, Protocol(), {"aggregate_tok_s": "tok/s", "ttft_ms": "ms"}, key="aggregate_tok_s"
    )
    assert sample.calls == 4
    agg, ttft = stats["aggregate_tok_s"], stats["ttft_ms"]
    assert agg.values == (100.0, 101.0, 100.0) and agg.warmups == (1.0,) and agg.stable
    assert ttft.values == (50.0, 90.0, 20.0) and ttft.warmups == (999.0,) and ttft.unit == "ms"
    assert not ttft.stable  # its own spread is reported honestly
    assert agg.stop_reason == ttft.stop_reason == "stable"


def test_many_validates_key_and_run_contents():
    units = {"a": "x", "b": "y"}
    with pytest.raises(ConfigError, match="'c'"):
        repeat_until_stable_many(seq(), Protocol(), units, key="c")
    with pytest.raises(MeasurementError, match=r"lacks \['b'\]"):
        repeat_until_stable_many(seq({"a": 1.0}), Protocol(), units, key="a")
    with pytest.raises(MeasurementError, match=r"\['z'\], which have no unit"):
        repeat_until_stable_many(seq({"a": 1.0, "b": 2.0, "z": 3.0}), Protocol(), units, key="a")


def test_many_noisy_key_runs_to_max_runs():
    values = itertools.cycle([10.0, 20.0, 30.0])
    stats = repeat_until_stable_many(
        lambda: {"k": next(values), "o": 1.0},
        Protocol(warmup_runs=0, min_runs=2, max_runs=5),
        {"k": "tok/s", "o": "ms"},
        key="k",
    )
    assert stats["k"].n == stats["o"].n == 5
    assert stats["k"].stop_reason == "max_runs" and stats["k"].warning is not None
    assert stats["o"].stable


# --- StreamResult / ConcurrentResult ------------------------------------------------------


def test_stream_result_from_timestamps():
    s = StreamResult.from_timestamps(
        prompt_tokens=500, output_tokens=101, start_s=10.0, first_token_s=10.25, end_s=12.25
    )
    assert s.ttft_ms == pytest.approx(250.0)
    assert s.prefill_tok_s == pytest.approx(2000.0)
    assert s.decode_tok_s == pytest.approx(50.0)  # 100 tokens after the first over 2 s
    with pytest.raises(MeasurementError, match="out of order"):
        StreamResult.from_timestamps(1, 1, start_s=2.0, first_token_s=1.0, end_s=3.0)
    with pytest.raises(MeasurementError, match="output_tokens = -1"):
        StreamResult(1, -1, 1.0, 1.0, 1.0, 0.0, 1.0)


def test_concurrent_result_properties():
    streams = (
        StreamResult(10, 100, ttft_ms=100.0, decode_tok_s=40.0, prefill_tok_s=1.0, start_s=100.0, end_s=102.0),
        StreamResult(10, 200, ttft_ms=300.0, decode_tok_s=60.0, prefill_tok_s=1.0, start_s=100.5, end_s=104.0),
        StreamResult(10, 100, ttft_ms=200.0, decode_tok_s=50.0, prefill_tok_s=1.0, start_s=101.0, end_s=103.0),
    )
    r = ConcurrentResult(streams=streams, wall_s=4.2)
    assert r.n_streams == 3
    assert r.span_s == pytest.approx(4.0)
    assert r.aggregate_tok_s == pytest.approx(100.0)  # 400 tokens over 100.0 -> 104.0
    # the median stream's decode speed counting its wait: its first token came 100 ms after the
    # quickest stream's (decode 99 tokens at 50 tok/s, plus 0.1 s)
    assert r.per_user_tok_s == pytest.approx(99 / (99 / 50 + 0.1))
    assert r.ttft_ms == 200.0
    assert set(r.metrics()) == set(CONCURRENT_UNITS)
    json.dumps(r.to_dict())
    with pytest.raises(MeasurementError):
        ConcurrentResult(streams=(), wall_s=1.0)


def _stream(i: int, start_s: float, end_s: float, tokens: int) -> StreamResult:
    return StreamResult(
        prompt_tokens=8,
        output_tokens=tokens,
        ttft_ms=10.0 * (i + 1),
        decode_tok_s=10.0 * (i + 1),
        prefill_tok_s=80.0,
        start_s=start_s,
        end_s=end_s,
    )


# --- threaded driver -------------------------------------------------------------


def test_threaded_streams_really_overlap_and_aggregate_over_wall():
    n = 4
    # Every stream waits for all the others inside its own run: if the driver
    # ran them one after another, this barrier would time out and the test fail.
    inside = threading.Barrier(n, timeout=BARRIER_TIMEOUT_S)
    seen_threads = set()

    def stream_fn(i: int) -> StreamResult:
        seen_threads.add(threading.get_ident())
        inside.wait()
        # Fixed timestamps so the aggregate is exact: first start 50.0, last end 55.0.
        return _stream(i, start_s=50.0 + 0.5 * i, end_s=55.0 - 0.5 * i, tokens=100 * (i + 1))

    result = run_streams_threaded(stream_fn, n_streams=n, timeout_s=30.0)
    assert len(seen_threads) == n
    assert result.n_streams == n
    assert [s.output_tokens for s in result.streams] == [100, 200, 300, 400]  # index order
    assert result.span_s == pytest.approx(5.0)
    assert result.aggregate_tok_s == pytest.approx(1000 / 5.0)
    # decode 20 and 30 tok/s the middle two, each counting its first token's 10 and 20 ms behind the first's
    assert result.per_user_tok_s == pytest.approx((199 / (199 / 20 + 0.01) + 299 / (299 / 30 + 0.02)) / 2)
    assert result.ttft_ms == pytest.approx(25.0)
    assert result.wall_s >= 0


def test_threaded_failure_reraised_after_all_streams_end():
    finished = []
    release = threading.Event()

    class StreamBroke(RuntimeError):
        pass

    def stream_fn(i: int) -> StreamResult:
        if i == 1:
            release.set()
            raise StreamBroke("connection reset")
        # The others end only after stream 1 failed: the driver must wait for them.
        assert release.wait(BARRIER_TIMEOUT_S)
        time.sleep(0.05)
        finished.append(i)
        return _stream(i, 0.0, 1.0, 10)

    with pytest.raises(StreamBroke, match="connection reset") as info:
        run_streams_threaded(stream_fn, n_streams=3, timeout_s=30.0)
    assert sorted(finished) == [0, 2]
    assert any("stream 1 of 3 failed" in note for note in info.value.__notes__)


def test_threaded_first_failure_by_index_wins():
    def stream_fn(i: int) -> StreamResult:
        raise ValueError(f"stream {i}")

    with pytest.raises(ValueError, match="stream 0") as info:
        run_streams_threaded(stream_fn, n_streams=3, timeout_s=30.0)
    assert any("streams [1, 2] failed too" in note for note in info.value.__notes__)


def test_threaded_timeout_raises_measurement_error():
    never = threading.Event()

    def stream_fn(i: int) -> StreamResult:
        if i == 0:
            never.wait(BARRIER_TIMEOUT_S)  # hangs past the driver's timeout
        return _stream(i, 0.0, 1.0, 10)

    try:
        with pytest.raises(MeasurementError, match=r"1 of 2 streams still running after 0.2s"):
            run_streams_threaded(stream_fn, n_streams=2, timeout_s=0.2)
    finally:
        never.set()  # let the daemon thread end


def test_threaded_bad_return_and_bad_args():
    with pytest.raises(MeasurementError, match="expected a StreamResult"):
        run_streams_threaded(lambda i: 42, n_streams=1, timeout_s=5.0)
    with pytest.raises(ConfigError, match="n_streams = 0"):
        run_streams_threaded(lambda i: None, n_streams=0, timeout_s=5.0)
    with pytest.raises(ConfigError, match="timeout_s = 0"):
        run_streams_threaded(lambda i: None, n_streams=1, timeout_s=0)


# --- GPU sampler -------------------------------------------------------------------


class FakeReader:
    """Fake NVML readings: each metric walks its list, then repeats the last value."""

    def __init__(self, used, temps, clocks, powers, masks, process=None, fail=()):
        self.series = {
            "used": used,
            "temp": temps,
            "clock": clocks,
            "power": powers,
            "mask": masks,
            "process": process or [None],
        }
        self.pos = dict.fromkeys(self.series, 0)
        self.fail = set(fail)
        self.closed = False
        self.pids = []

    def _next(self, name):
        if name in self.fail:
            raise RuntimeError(f"{name} not supported")
        values = self.series[name]
        value = values[min(self.pos[name], len(values) - 1)]
        self.pos[name] += 1
        return value

    def name(self):
        return "NVIDIA Fake 80GB"

    def memory_used_bytes(self):
        return self._next("used")

    def temperature_c(self):
        return self._next("temp")

    def sm_clock_mhz(self):
        return self._next("clock")

    def power_w(self):
        return self._next("power")

    def throttle_mask(self):
        return self._next("mask")

    def process_used_bytes(self, pid):
        self.pids.append(pid)
        return self._next("process")

    def close(self):
        self.closed = True


GiB = 1024**3


def test_sampler_aggregates_fake_readings():
    reader = FakeReader(
        used=[1 * GiB, 5 * GiB, 9 * GiB, 7 * GiB],
        temps=[40.0, 71.0, 83.0, 80.0],
        clocks=[1980.0, 1755.0, 1410.0, 1800.0],
        powers=[60.0, 690.0, 700.0, 650.0],
        # gpu_idle, then sw_power_cap, then hw_thermal + sw_thermal, then nothing.
        masks=[0x1, 0x4, 0x40 | 0x20, 0x0],
        process=[None, 4 * GiB, 8 * GiB, 6 * GiB],
    )
    # A huge interval: the thread takes no sample of its own, so the count is exact.
    with GpuSampler(index=3, interval_s=3600, pid=4242, reader_factory=lambda i: reader) as gpu:
        gpu.sample_now()
        gpu.sample_now()
    t = gpu.result()  # entry + 2 + exit samples
    assert reader.closed
    assert reader.pids == [4242] * 4
    assert t.available and t.reason is None
    assert t.gpu_name == "NVIDIA Fake 80GB"
    assert t.n_samples == 4
    assert t.baseline_used_bytes == 1 * GiB
    assert t.peak_used_bytes == 9 * GiB
    assert t.peak_delta_bytes == 8 * GiB
    assert t.peak_process_bytes == 8 * GiB
    assert t.max_temp_c == 83.0
    assert t.min_sm_clock_mhz == 1410.0
    assert t.median_sm_clock_mhz == pytest.approx((1755.0 + 1800.0) / 2)
    assert t.max_power_w == 700.0
    assert t.throttle_reasons == ("gpu_idle", "sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown")
    assert t.slowdowns == ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown")
    d = json.loads(json.dumps(t.to_dict()))
    assert d["throttle_reasons"] == list(t.throttle_reasons)


def test_sampler_thread_samples_in_background():
    reader = FakeReader(used=[1, 2, 3], temps=[50.0], clocks=[1500.0], powers=[100.0], masks=[0])
    with GpuSampler(interval_s=0.001, reader_factory=lambda i: reader) as gpu:
        deadline = time.monotonic() + BARRIER_TIMEOUT_S
        while gpu.result().n_samples < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
    t = gpu.result()
    assert t.n_samples >= 5
    assert t.peak_used_bytes == 3
    assert t.peak_process_bytes is None  # no pid asked


def test_sampler_tolerates_unsupported_readings():
    reader = FakeReader(used=[10], temps=[50.0], clocks=[1500.0], powers=[0.0], masks=[0], fail={"power", "mask"})
    with GpuSampler(interval_s=3600, reader_factory=lambda i: reader) as gpu:
        pass
    t = gpu.result()
    assert t.available and t.n_samples == 2
    assert t.max_power_w is None and t.throttle_reasons == ()
    assert t.max_temp_c == 50.0
    assert "power" in t.reason and "throttle_reasons" in t.reason


def test_sampler_without_nvml_is_a_clean_no_gpu(monkeypatch):
    # The default reader, with pynvml made unimportable: the no-driver path.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with GpuSampler(index=0) as gpu:
        pass
    t = gpu.result()
    assert t == GpuTelemetry(available=False, reason=t.reason)
    assert "nvidia-ml-py" in t.reason
    assert t.n_samples == 0 and t.peak_used_bytes is None
    json.dumps(t.to_dict())


def test_sampler_factory_failure_is_a_clean_no_gpu():
    def factory(index):
        raise RuntimeError(f"GPU index {index} not found: 1 GPU(s) visible")

    with GpuSampler(index=7, reader_factory=factory) as gpu:
        pass
    t = gpu.result()
    assert not t.available
    assert "GPU index 7 not found" in t.reason


def test_measure_with_telemetry_takes_the_engines_own_peak_else_the_cards_rise():
    units = {"v": "tok/s"}
    protocol = Protocol(warmup_runs=0, min_runs=1)
    # No GPU: the protocol alone, no telemetry, no peak.
    stats, telemetry, peak = measure_with_telemetry(
        lambda: {"v": 5.0},
        protocol,
        units,
        "v",
        gpu=False,
        reader_factory=lambda i: pytest.fail("NVML opened without a GPU"),
    )
    assert stats["v"].values == (5.0,) and telemetry is None and peak is None
    # NVML lists the engine's process: its own peak, not the card's (other work shares the card).
    reader = FakeReader(
        used=[10 * GiB, 30 * GiB], temps=[50.0], clocks=[1500.0], powers=[100.0], masks=[0], process=[2 * GiB, 7 * GiB]
    )
    _, telemetry, peak = measure_with_telemetry(
        lambda: {"v": 5.0}, protocol, units, "v", gpu=True, gpu_index=2, pid=99, reader_factory=lambda i: reader
    )
    assert telemetry.available and reader.pids and set(reader.pids) == {99}
    assert peak == 7 * GiB
    # The driver hides per-process memory: the rise of the card's memory while measuring.
    hidden = FakeReader(used=[10 * GiB, 16 * GiB], temps=[50.0], clocks=[1500.0], powers=[100.0], masks=[0])
    _, _, peak = measure_with_telemetry(
        lambda: {"v": 5.0}, protocol, units, "v", gpu=True, pid=99, reader_factory=lambda i: hidden
    )
    assert peak == 6 * GiB

    # No NVML after all: the stats still come back, with the reason instead of a peak.
    def no_nvml(index):
        raise RuntimeError("NVML could not start")

    stats, telemetry, peak = measure_with_telemetry(
        lambda: {"v": 5.0}, protocol, units, "v", gpu=True, reader_factory=no_nvml
    )
    assert stats["v"].n == 1 and not telemetry.available and "NVML could not start" in telemetry.reason
    assert peak is None


def test_throttle_reason_names_keeps_unknown_bits():
    assert throttle_reason_names(0) == ()
    assert throttle_reason_names(0x8 | 0x800) == ("hw_slowdown", "unknown_0x800")


def test_one_outlier_in_three_runs_does_not_force_more_runs():
    # The documented choice of MAD: a single hiccup (page fault, log flush)
    # leaves the median and the spread of the other runs untouched.
    sample = seq(100.0, 180.0, 101.0, 500.0)
    stat = repeat_one(sample, Protocol(warmup_runs=0, min_runs=3))
    assert stat.values == (100.0, 180.0, 101.0)
    assert stat.median == 101.0 and stat.stable


def test_event_data_keeps_a_token_holding_a_unicode_line_separator_whole():
    """JSON leaves U+2028 and U+0085 unescaped inside strings; an SSE event ends at CR/LF only.
    A line reader that splits like str.splitlines() cut such an event in two."""
    events = ['{"content": "a\u2028b\x85c"}', '{"stop": true}']
    wire = "".join(f"data: {e}\r\n\r\n" if i else f"data: {e}\n\n" for i, e in enumerate(events)).encode()
    chunks = [wire[i : i + 7] for i in range(0, len(wire), 7)]  # boundaries inside characters and lines
    assert list(event_data(chunks)) == events
    assert [json.loads(p)["content"] for p in list(event_data(chunks))[:1]] == ["a\u2028b\x85c"]
    assert list(event_data([b": comment\nevent: x\ndata: 1\n", b"data: 2"])) == ["1", "2"]


def test_per_user_speed_counts_the_wait_of_requests_served_one_at_a_time():
    # Four requests sent together to an engine that serves one at a time: each decodes 101 tokens
    # at 50 tok/s (2 s) once the ones before it are done. The user queued third reads its text at
    # 50 tok/s, but 4 s later than the first: from its request on, it saw 100 tokens in 6 s.
    serial = [
        StreamResult(
            10,
            101,
            ttft_ms=100.0 + 2000.0 * i,
            decode_tok_s=50.0,
            prefill_tok_s=100.0,
            start_s=0.0,
            end_s=0.1 + 2.0 * (i + 1),
        )
        for i in range(4)
    ]
    together = [
        StreamResult(10, 101, ttft_ms=100.0, decode_tok_s=50.0, prefill_tok_s=100.0, start_s=0.0, end_s=2.1)
        for _ in range(4)
    ]
    assert ConcurrentResult(streams=tuple(together), wall_s=2.1).per_user_tok_s == pytest.approx(50.0)
    assert ConcurrentResult(streams=tuple(serial), wall_s=8.1).per_user_tok_s == pytest.approx(
        statistics.median([50.0, 100 / 4.0, 100 / 6.0, 100 / 8.0])
    )


def test_no_two_requests_of_a_launch_share_a_prompts_first_tokens():
    # Real text repeats its tokens: a first token picked by position gave some requests the same
    # prompt as an earlier one, which llama-server answered from its cache (found by the aiperf
    # peer check, bench/results/peer_aiperf_cpu.md).
    from autotune.measure.prompts import prompt_of, varied

    base = [5, 9, 5, 7, 9, 5, 11, 13, 5, 9] * 3  # five distinct tokens, much repeated
    prompt = prompt_of(base, 24)
    prompts = [varied(prompt, i) for i in range(5**3)]  # 5**3 first-token triples
    assert len({tuple(p[:3]) for p in prompts}) == len(prompts)
    assert all(len(p) == 24 and p[3:] == prompt[3:] for p in prompts)
    assert varied([4], 7) == [4] and varied([4, 4], 3) == [4, 4]
