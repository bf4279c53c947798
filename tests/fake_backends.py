"""Test doubles: backends whose behaviour a test controls, and study files that use them.

A fake backend measures instantly; its speed is a pure function of the configuration, so a
test can tell which configuration is best without running anything. ``FaultyBackend`` fails
on chosen weights, ``BlockingBackend`` stalls on a chosen launch until a signal ends it, and
``RealExl2Backend`` stands for a real ExLlamaV2 backend (no ``predict``) whose prior comes from
the twin. Every backend can log the configurations it launched, one JSON line per launch, so
a test can prove that nothing was measured twice.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from autotune import hookimpl, plugins
from autotune.engine.backend import BaseBackend, Measurement, MemoryEstimate, Param, StudyContext, TrialConfig
from autotune.engine.parts import ArtifactMaker, Predictor, Scoring, Splitting, part
from autotune.errors import BackendError
from autotune.measure import Stat

GIB = 2**30
REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def stats_for(aggregate_tok_s: float, parallel: int) -> dict[str, Stat]:
    """The metrics every backend must provide, consistent with one aggregate figure."""
    per_user = aggregate_tok_s / parallel
    return {
        "decode_tok_s": Stat((per_user * 1.1,), unit="tok/s"),
        "aggregate_tok_s": Stat((aggregate_tok_s,), unit="tok/s"),
        "per_user_tok_s": Stat((per_user,), unit="tok/s"),
    }


class FakeBackend(BaseBackend):
    """Instant, deterministic backend: 1 GiB of weights, speed grows with parallel and weights.

    Args:
        log_path: File that gets one JSON line ``{"pid", "key"}`` per launch (None: no log).
    """

    name = "fake"
    engine = "fake-engine"
    weight_families = ("fake",)
    description = "test double that measures instantly"

    def __init__(self, log_path: str | Path | None = None):
        self.log_path = Path(log_path) if log_path else None
        self.calls: list[TrialConfig] = []

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        return [Param("mode", tuple(space.get("mode", ("plain",))), "a flag the fake ignores")]

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        return MemoryEstimate(
            weights_bytes=GIB,
            kv_bytes=config.ctx * config.parallel * 1024,
            buffers_bytes=64 * 2**20,
            overhead_bytes=256 * 2**20,
        )

    def speed(self, config: TrialConfig) -> float:
        """Aggregate tok/s: higher parallel and later weights in the list are faster."""
        return 10.0 * config.parallel + len(config.weights) + config.ctx / 4096

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        return f"fake-serve --weights {config.weights} --ctx {config.ctx} --parallel {config.parallel}"

    def engine_build(self, ctx: StudyContext | None = None) -> str:
        return "fake-1.0"

    def _log(self, config: TrialConfig) -> None:
        self.calls.append(config)
        if self.log_path is not None:
            with self.log_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"pid": os.getpid(), "key": config.key}) + "\n")

    def measure(self, config: TrialConfig) -> Measurement:
        return Measurement(metrics=stats_for(self.speed(config), config.parallel))

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)
        return self.measure(config)


class FaultyBackend(FakeBackend):
    """Fails by weights: ``backend-error`` (BackendError), ``bug`` (RuntimeError), ``crash``
    (its engine child process is killed and the backend reports it); other weights work."""

    name = "fake-faulty"

    def __init__(self, log_path: str | Path | None = None):
        super().__init__(log_path)
        self.child_pids: list[int] = []

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)
        if config.weights == "backend-error":
            raise BackendError("engine refused to load: unsupported tensor type", log_tail="load_tensors: failed\n")
        if config.weights == "bug":
            raise RuntimeError("plugin bug: list index out of range")
        if config.weights == "crash":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            self.child_pids.append(child.pid)
            os.kill(child.pid, signal.SIGKILL)  # the engine dies mid-measurement (OOM killer, segfault)
            rc = child.wait(timeout=30)
            raise BackendError(
                f"engine process {child.pid} exited with status {rc} during measurement",
                log_tail=f"killed by signal {-rc}\n",
            )
        return self.measure(config)


class BlockingBackend(FakeBackend):
    """Measures instantly until launch number ``block_on`` (1-based), which writes
    ``marker_path`` (with the configuration key) and then sleeps until a signal ends it."""

    name = "fake-blocking"

    def __init__(
        self,
        log_path: str | Path | None = None,
        block_on: int | None = None,
        marker_path: str | Path | None = None,
        raise_interrupt_on: int | None = None,
    ):
        super().__init__(log_path)
        self.block_on = block_on
        self.marker_path = Path(marker_path) if marker_path else None
        self.raise_interrupt_on = raise_interrupt_on

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)
        n = len(self.calls)
        if self.raise_interrupt_on is not None and n == self.raise_interrupt_on:
            raise KeyboardInterrupt  # what Ctrl-C raises inside an engine client's wait
        if self.block_on is not None and n == self.block_on:
            assert self.marker_path is not None
            tmp = self.marker_path.with_suffix(".tmp")
            tmp.write_text(config.key, encoding="utf-8")
            tmp.rename(self.marker_path)  # atomic: the test never reads a half-written marker
            time.sleep(600)
            raise AssertionError("the blocked launch was never interrupted")
        return self.measure(config)


class RealExl2Backend(FakeBackend):
    """Stands for a real ExLlamaV2 backend: same engine as the twin, no ``predict``.

    Memory and options come from the twin's model of ExLlamaV2; "measurements" are 90% of the
    twin's prediction.
    """

    name = "fake-exl2"
    engine = "exllamav2"
    weight_families = ("exl2",)

    def __init__(self, log_path: str | Path | None = None):
        super().__init__(log_path)
        from autotune_plugins.twin import TwinExllamaV2

        self.twin = TwinExllamaV2()

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        return self.twin.parameters(space)

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        return self.twin.estimate_memory(config, ctx)

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)
        predicted = self.twin.predictor.predict(replace(config, backend=self.twin.name), ctx)
        assert predicted is not None
        return Measurement(metrics=stats_for(0.9 * predicted["aggregate_tok_s"], config.parallel))


class ForwardingPredictor(Predictor):
    """A test double's predictor: its backend's own ``predict``, ``calibrate`` and
    ``repeats_exactly`` methods, so that each double overrides them in one class, as it did."""

    @property
    def learns(self) -> bool:  # type: ignore[override]
        return hasattr(self.backend, "calibrate")

    def predict(self, config: TrialConfig, ctx: StudyContext) -> Mapping[str, float] | None:
        predict = getattr(self.backend, "predict", None)
        return None if predict is None else predict(config, ctx)

    def calibrate(
        self, measured: Sequence[tuple[TrialConfig, Mapping[str, float]]], ctx: StudyContext
    ) -> Mapping[str, Any] | None:
        return self.backend.calibrate(measured, ctx) if self.learns else None

    def repeats_exactly(self, ctx: StudyContext) -> bool:
        repeats = getattr(self.backend, "repeats_exactly", None)
        return bool(repeats is not None and repeats(ctx))


class ForwardingArtifacts(ArtifactMaker):
    """A test double's artifact maker: its backend's own ``artifact_recipe`` method."""

    def recipe(self, fmt: str, source: Path, ctx: StudyContext) -> Any:
        return self.backend.artifact_recipe(fmt, source, ctx)


class ForwardingSplitting(Splitting):
    """A test double's splitting: its backend's own ``offload_space`` method."""

    def offload_space(self, weights: str, ctx: StudyContext) -> dict[str, list[Any]]:
        return self.backend.offload_space(weights, ctx)


class ForwardingScoring(Scoring):
    """A test double's scoring: its backend's own ``scorer`` method."""

    def scorer(self, weights: str, cache_type: str | None, ctx: StudyContext) -> Any:
        return self.backend.scorer(weights, cache_type, ctx)


class FakeModelBackend(FakeBackend):
    """A model backend of ``FakeBackend``'s engine: it predicts half of what the fake measures,
    times its calibration's ``factor``, and calibrates that factor to the measured aggregate.
    It records every ``calibrate`` call and the calibration each ``predict`` was given."""

    name = "fake-model"
    description = "test double of a model backend (predict and calibrate)"
    predictor = part(ForwardingPredictor)

    def __init__(self, log_path: str | Path | None = None):
        super().__init__(log_path)
        self.calibrated: list[list[tuple[TrialConfig, Mapping[str, float]]]] = []
        self.seen_calibrations: list[Mapping[str, Any] | None] = []

    def predict(self, config: TrialConfig, ctx: StudyContext) -> Mapping[str, float] | None:
        self.seen_calibrations.append(ctx.calibration)
        factor = ctx.calibration["after"]["factor"] if ctx.calibration else 1.0
        aggregate = 0.5 * self.speed(config) * factor
        return {"aggregate_tok_s": aggregate, "per_user_tok_s": aggregate / config.parallel}

    def calibrate(
        self, measured: Sequence[tuple[TrialConfig, Mapping[str, float]]], ctx: StudyContext
    ) -> Mapping[str, Any] | None:
        self.calibrated.append(list(measured))
        ratios = sorted(m["aggregate_tok_s"] / (0.5 * self.speed(c)) for c, m in measured)
        factor = ratios[len(ratios) // 2]
        return {
            "gpu": ctx.gpu.key,
            "n": len(measured),
            "before": {"factor": 1.0},
            "after": {"factor": factor},
            "median_abs_error_before": abs(1.0 / factor - 1.0),
            "median_abs_error_after": 0.0,
        }


class BackendsPlugin:
    """A plugin object that registers the given backend instances."""

    def __init__(self, *backends: BaseBackend):
        self.backends = backends

    @hookimpl
    def register_backends(self, register):
        for backend in self.backends:
            register(backend)


class registered:
    """Context manager: register backends as plugin ``name``; always unregister."""

    def __init__(self, *backends: BaseBackend, name: str = "fakes"):
        self.backends = backends
        self.name = name

    def __enter__(self):
        plugins.register_plugin(BackendsPlugin(*self.backends), name=self.name)
        return self.backends

    def __exit__(self, *exc):
        plugins.unregister_plugin(self.name)
        return False


def memory_dir(fallback: Path) -> Iterator[Path]:
    """A scratch directory in memory (/dev/shm) when there is room, else ``fallback``.

    SQLite storages commit some 40 times per trial; on a busy disk each commit's fsync costs
    more than the trial itself (the study tests ran 3x slower on a loaded machine). Nothing
    here tests durability, so the storages may live in memory. Removed afterwards.
    """
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 256 * 2**20):
        yield fallback
        return
    path = Path(tempfile.mkdtemp(prefix="autotune-test-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_study(
    path: Path,
    backend: str,
    weights: Sequence[str],
    *,
    name: str = "fake-study",
    ctx: Sequence[int] = (4096,),
    parallel: Sequence[int] = (1, 2, 4),
    extra_space: str = "",
    study_extra: str = "",
    sampler: str = "random",
) -> Path:
    """A study file over one fake backend on the catalog V100 and the article's model."""
    weights_toml = ", ".join(json.dumps(w) for w in weights)
    path.write_text(
        f"""[study]
name = "{name}"
seed = 0
sampler = "{sampler}"
{study_extra}

[hardware]
gpu = "v100-16gb"
safety_margin_mib = 1792

[model]
ref = "qwen2.5-27b-article"

[workload]
prompt_tokens = 1500
output_tokens = 800

[[candidates]]
backend = "{backend}"
weights = [{weights_toml}]

[space]
ctx = [{", ".join(map(str, ctx))}]
parallel = [{", ".join(map(str, parallel))}]
{extra_space}

[objective]
metric = "aggregate_tok_s"
""",
        encoding="utf-8",
    )
    return path


def read_log(path: Path) -> list[dict[str, Any]]:
    """The launches a backend logged (empty when it launched nothing)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# A script for a child process: register a BlockingBackend, then run the real CLI (`autotune
# study ...`), so that a test can interrupt or kill a study the way a user or the OS does.
# With a hostname, the child passes for a worker on another machine.
CHILD_SCRIPT = """
import socket
import sys
if {hostname!r}:
    socket.gethostname = lambda: {hostname!r}
sys.path.insert(0, {tests!r})
from fake_backends import BlockingBackend, BackendsPlugin
from autotune import plugins
backend = BlockingBackend({log!r}, block_on={block_on}, marker_path={marker!r})
plugins.register_plugin(BackendsPlugin(backend), name="fakes")
from autotune.cli import main
sys.argv = ["autotune"] + {argv!r}
main()
"""


def child_script(log: Path, marker: Path, block_on: int, argv: list[str], hostname: str = "") -> str:
    return CHILD_SCRIPT.format(
        tests=str(TESTS), log=str(log), marker=str(marker), block_on=block_on, argv=argv, hostname=hostname
    )


def interleave_two_workers(storage: str, study_path: Path, backend: "FakeBackend"):
    """Two workers on one study, interleaved the way the race between them happens.

    The same configuration X is queued twice. Worker B takes the first trial (number 0) and,
    before it has looked at its configuration, worker A takes the second (number 1) and runs
    it to the end; then B goes on. This is what happens when B is descheduled (or its sampler
    is slow) between ``ask`` and ``suggest``. Returns (X, the study as stored).
    """
    import optuna

    from autotune.config import load_study_config
    from autotune.study import StudyRunner, prepare_study
    from autotune.study.storage import Heartbeat

    with registered(backend):
        cfg = load_study_config(study_path)
        a = StudyRunner(prepare_study(cfg, storage=storage), seed=1)
        b = StudyRunner(prepare_study(cfg, storage=storage), seed=2)
        x = next(iter(a.prepared.space.enumerate()))
        for _ in range(2):
            a.study.enqueue_trial(a.prepared.space.params_of(x))
        beat_a, beat_b = Heartbeat(a.study), Heartbeat(b.study)
        real = b.sampler.before_trial

        def before_trial(study, trial):
            b.sampler.before_trial = real
            a._one_trial(beat_a, time.monotonic())  # A: trial 1, start to finish
            real(study, trial)

        b.sampler.before_trial = before_trial
        try:
            b._one_trial(beat_b, time.monotonic())  # B: trial 0
        finally:
            beat_a.stop.set()
            beat_b.stop.set()
        return x, optuna.load_study(study_name=cfg.name, storage=storage)


class BrokenBackend(FakeBackend):
    """Every launch fails: with one cause in every launch (``cause``; its port number differs
    launch to launch, as a real engine's message would), or out of memory (``oom=True``: a
    property of each configuration), or ``works_first`` launches measure before it breaks."""

    name = "fake-broken"

    def __init__(
        self,
        log_path: str | Path | None = None,
        cause: str = "unknown model architecture 'qwen3next'",
        oom: bool = False,
        works_first: int = 0,
    ):
        super().__init__(log_path)
        self.cause, self.oom, self.works_first = cause, oom, works_first

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)
        if len(self.calls) <= self.works_first:
            return self.measure(config)
        if self.oom:
            raise BackendError(f"CUDA error: out of memory allocating {config.ctx * config.parallel} MiB of KV cache")
        raise BackendError(f"engine on port {8000 + len(self.calls)} exited with code 1: {self.cause}")
