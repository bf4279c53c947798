"""A recorded exhaustive grid, and a backend that answers a study's trials from it.

``RecordedGrid`` reads the storages of one grid study (``autotune study`` with ``sampler =
"grid"``, run once or several times) through ``TrialRecord``: for each configuration, what
each run recorded (the measurement, the peak VRAM, the seconds the trial took, or why it was
pruned or failed) and the memory prediction the real backend made for it.

``ReplayBackend`` is the backend a replay study names instead of the real one. It touches no
file and launches nothing:

* its weights are the recorded files' formats (``gguf:Q4_K_M``), so that the engine's twin
  predicts for them in a ``prior = true`` study without reading the files; each format maps
  back to the one recorded file of that format;
* ``check`` gives the reason the grid recorded for a configuration the rules refused;
* ``estimate_memory`` gives the real backend's own prediction, recorded with every trial the
  judge weighed, with what the grid's study had learned by then taken back off (the replay's
  judge learns its own correction from the replayed peaks, as the real runner does);
* ``run`` answers from one recorded run of the configuration, drawn at random per trial (the
  noise of a replay is the recorded between-run spread), and adds that run's seconds to
  ``spent_s``; a configuration that failed in the drawn run fails again with its recorded
  reason.

Nothing here is shipped in ``autotune/``: it exists to benchmark search strategies.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import optuna

from autotune import hookimpl
from autotune.engine import vram
from autotune.engine.backend import (
    BaseBackend,
    Measurement,
    MemoryEstimate,
    Param,
    StudyContext,
    TrialConfig,
    Workload,
    same_value,
)
from autotune.errors import AutotuneError, BackendError, ConfigError
from autotune.engine.formats import normalize_format
from autotune.measure import PROBE_STOP, Stat
from autotune.study import records
from autotune.study.records import TrialRecord, TrialState

REPLAY_BACKEND = "replay"


@dataclass(frozen=True)
class RecordedTrial:
    """What one run of the grid recorded for one configuration."""

    run: int
    record: TrialRecord
    seconds: float

    @property
    def launched(self) -> bool:
        """Whether this run has the configuration's own outcome: measured, or failed for a reason
        that would repeat. A trial stopped from outside (the study interrupted, its worker dead:
        ``retry``) says nothing about its configuration and is left out, as the runner itself
        measures such a configuration again."""
        return (
            self.record.launched
            and not self.record.retry
            and self.record.state in (TrialState.COMPLETE, TrialState.FAIL)
        )


def trial_seconds(t: optuna.trial.FrozenTrial) -> float:
    """What a trial cost: from its start to its end, as the storage recorded them."""
    if t.datetime_start is None or t.datetime_complete is None:
        return 0.0
    return (t.datetime_complete - t.datetime_start).total_seconds()


def raw_predictions(study: optuna.Study) -> dict[str, MemoryEstimate]:
    """The real backend's own memory prediction for each configuration the judge weighed.

    A trial stores the judge's estimate, which includes the correction the study had learned
    by then (the median of measured - predicted peaks of the trials measured before it, added
    to the overhead); that correction is recomputed the way the judge computed it and taken
    off, so that a replay's judge does not count it twice.
    """
    found: dict[str, MemoryEstimate] = {}
    residuals: list[int] = []
    for r in sorted(records.records(study), key=lambda r: r.number):
        p = r.predicted_vram
        if p is not None and r.config_key and not r.answered:
            correction = vram.learned_correction(residuals) or 0
            found.setdefault(
                r.config_key,
                MemoryEstimate(
                    weights_bytes=int(p["weights_bytes"]),
                    kv_bytes=int(p["kv_bytes"]),
                    buffers_bytes=int(p["buffers_bytes"]),
                    overhead_bytes=int(p["overhead_bytes"]) - correction,
                    host_bytes=int(p.get("host_bytes", 0)),
                    notes=tuple(n for n in p.get("notes", ()) if " learned from " not in n),
                ),
            )
        if r.state == TrialState.COMPLETE and r.vram_residual_bytes is not None and not r.answered:
            residuals.append(int(r.vram_residual_bytes))
    return found


def format_of(path: str) -> str:
    """The GGUF type a quantized file's name ends with (``q7b-Q4_K_M.gguf``: ``gguf:Q4_K_M``),
    as llama-quantize's usual naming (and bench/h200_grids.sh) gives it."""
    stem = Path(path).stem
    try:
        return normalize_format("gguf:" + stem.rsplit("-", 1)[-1])
    except AutotuneError:
        raise ConfigError(
            f"recorded weights {path}: its name does not end with a GGUF type (-Q4_K_M, -Q8_0...); "
            "the replay names weights by format so that the twin can predict for them"
        ) from None


class RecordedGrid:
    """One grid study as recorded in one or more storages (runs of the same grid).

    Args:
        storages: Storage URLs, one per run.
        study_name: The study to read (None: the storages' only study).
    """

    def __init__(self, storages: Sequence[str], study_name: str | None = None):
        if not storages:
            raise ConfigError("--grid: give at least one storage of a recorded grid")
        self.storages = list(storages)
        self.runs: list[optuna.Study] = [self._load(url, study_name) for url in self.storages]
        self.name = self.runs[0].study_name
        self.header = dict(self.runs[0].user_attrs)
        self.by_key: dict[str, list[RecordedTrial]] = {}
        self.predicted: dict[str, MemoryEstimate] = {}
        for i, study in enumerate(self.runs):
            for t in study.get_trials(deepcopy=False):
                r = TrialRecord.of(t)
                if r.config_key and r.config and not r.answered:
                    self.by_key.setdefault(r.config_key, []).append(RecordedTrial(i, r, trial_seconds(t)))
            for key, estimate in raw_predictions(study).items():
                self.predicted.setdefault(key, estimate)
        self.configs: dict[str, TrialConfig] = {
            key: TrialConfig.from_dict(trials[0].record.config)  # type: ignore[arg-type]
            for key, trials in self.by_key.items()
        }
        backends = {c.backend for c in self.configs.values()}
        if len(backends) != 1:
            raise ConfigError(
                f"grid '{self.name}': the replay takes a grid of one backend, this one has "
                f"{', '.join(sorted(backends)) or 'no trial'}"
            )
        self.backend = backends.pop()
        engines = {t.record.engine.get("engine") for ts in self.by_key.values() for t in ts if t.record.engine}
        self.engine = str(next(iter(engines))) if len(engines) == 1 else ""
        self.format_of = {w: format_of(w) for w in sorted({c.weights for c in self.configs.values()})}
        seen: dict[str, str] = {}
        for path, fmt in self.format_of.items():
            if fmt in seen:
                raise ConfigError(
                    f"grid '{self.name}': {seen[fmt]} and {path} are both {fmt}; the replay names "
                    "weights by format and needs one file per format"
                )
            seen[fmt] = path

    def _load(self, url: str, study_name: str | None) -> optuna.Study:
        from autotune.report.text import load_study  # opens for reading only, picks the one study, checks the schema

        return load_study(url, study_name)

    # ------------------------------------------------------------------ what the grid knows

    def measured(self, key: str) -> list[RecordedTrial]:
        """The runs that measured ``key`` (COMPLETE)."""
        return [t for t in self.by_key.get(key, []) if t.record.state == TrialState.COMPLETE]

    def launched(self, key: str) -> list[RecordedTrial]:
        """The runs that launched ``key`` (measured it, or failed while measuring)."""
        return [t for t in self.by_key.get(key, []) if t.launched]

    def unsettled(self) -> list[str]:
        """Configurations some run launched but none settled: every launch was interrupted."""
        return [
            key
            for key, trials in self.by_key.items()
            if not self.launched(key) and any(t.record.launched and t.record.retry for t in trials)
        ]

    def measuring_seconds(self) -> float:
        """Seconds one run of the whole grid spends launching configurations: for each
        configuration some run launched, the mean of its runs' seconds. The mean of the runs'
        sums when every run launched every configuration; a run cut short (its budget or the
        machine's time ran out) neither shortens the grid nor counts its interrupted launch."""
        return sum(
            statistics.fmean(t.seconds for t in launched) for key in self.by_key if (launched := self.launched(key))
        )

    def replay_key(self, key: str) -> str:
        """The configuration as a replay study names it (replay backend, weights as a format)."""
        c = self.configs[key]
        return replace(c, backend=REPLAY_BACKEND, weights=self.format_of[c.weights]).key

    def recorded_key(self, config: TrialConfig) -> str:
        """The recorded configuration a replay configuration stands for."""
        path = {fmt: p for p, fmt in self.format_of.items()}.get(config.weights)
        if path is None:
            raise ConfigError(
                f"replay of '{self.name}': weights {config.weights!r} were not recorded "
                f"(recorded: {', '.join(self.format_of.values())})"
            )
        return replace(config, backend=self.backend, weights=path).key


@dataclass
class ReplayLog:
    """What a replay cost and what it asked that the grid cannot answer."""

    spent_s: float = 0.0
    launches: list[str] = field(default_factory=list)  # recorded keys, in order
    unrecorded: list[str] = field(default_factory=list)  # launched, but the grid never did
    probe_stops: int = 0  # launches the probe ended after one run
    unsettled: list[str] = field(default_factory=list)  # launched, but the grid's launches were all cut short


def run_seconds(r: TrialRecord, workload: Workload) -> float:
    """Seconds one run of a recorded llama-server trial took, from its own figures (the grid
    stored per-trial seconds, not per-run ones): one request alone (prefill, then the output at
    the single-stream decode rate), then ``parallel`` streams together (their output at the
    aggregate rate, after the first token)."""
    assert r.config is not None
    med = r.median
    single = workload.prompt_tokens / (med("prefill_tok_s") or float("inf")) + workload.output_tokens / (
        med("decode_tok_s") or float("inf")
    )
    together = int(r.config["parallel"]) * workload.output_tokens / (med("aggregate_tok_s") or float("inf"))
    return single + together + (med("ttft_ms") or 0.0) / 1000


def _stat(d: Mapping[str, Any]) -> Stat:
    return Stat(
        values=tuple(d["values"]),
        warmups=tuple(d.get("warmups", ())),
        unit=d.get("unit", ""),
        rel_spread_tol=d.get("rel_spread_tol", 0.05),
        stop_reason=d.get("stop_reason"),
    )


class ReplayBackend(BaseBackend):
    """Answers trials from a ``RecordedGrid`` (see the module docstring).

    The engine is the recorded one, so that the engine's twin is this backend's prior.
    """

    name = REPLAY_BACKEND
    description = "answers trials from a recorded grid (bench/replay.py)"

    def __init__(self, grid: RecordedGrid):
        self.grid = grid
        self.engine = grid.engine  # type: ignore[misc]  # the recorded engine: its twin predicts for us
        self.options: dict[str, list[Any]] = {}
        for c in grid.configs.values():
            for name, value in c.options:
                if not any(same_value(value, v) for v in self.options.setdefault(name, [])):
                    self.options[name].append(value)
        self.reset(0)

    def reset(self, seed: int) -> None:
        """Start a new replay: nothing spent, draws seeded by ``seed``."""
        self.rng = random.Random(seed)
        self.log = ReplayLog()

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        return [
            Param(
                name,
                tuple(v for v in space.get(name, ()) if any(same_value(v, r) for r in recorded)),
                f"as recorded: {', '.join(map(str, recorded))}",
                accepted=tuple(recorded),
            )
            for name, recorded in self.options.items()
        ]

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        for t in self.grid.by_key.get(self.grid.recorded_key(config), []):
            reason = t.record.prune_reason or ""
            if t.record.state == TrialState.PRUNED and reason.startswith("invalid: "):
                return [reason[len("invalid: ") :]]
        return []

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        key = self.grid.recorded_key(config)
        estimate = self.grid.predicted.get(key)
        if estimate is None:
            raise BackendError(f"replay of '{self.grid.name}': no memory prediction was recorded for {key}")
        return estimate

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        key = self.grid.recorded_key(config)
        launched = self.grid.launched(key)
        if not launched:
            if key in self.grid.unsettled():
                # Every recorded launch of it was cut short (the machine's time ran out): the grid
                # has no outcome to give. A failure at no cost, counted (the report says how many).
                self.log.unsettled.append(key)
                raise BackendError(f"replay: every recorded launch of {key} was interrupted")
            # The grid pruned (or never reached) it: the replay's judge should have too.
            self.log.unrecorded.append(key)
            raise BackendError(f"replay: the grid never launched {key}")
        drawn = self.rng.choice(launched)
        self.log.launches.append(key)
        r = drawn.record
        if r.state != TrialState.COMPLETE:
            self.log.spent_s += drawn.seconds
            raise BackendError(r.fail_reason or "failed in the recorded run", log_tail=r.log_tail)
        metrics = {name: _stat(d) for name, d in r.metrics.items()}
        if ctx.probe is not None and not ctx.probe({name: st.values[0] for name, st in metrics.items()}):
            # The launch stops after its first run: the recorded trial less its later runs.
            later = min(st.n for st in metrics.values()) - 1
            self.log.spent_s += max(drawn.seconds - later * run_seconds(r, ctx.workload), 0.0)
            self.log.probe_stops += 1
            return Measurement(
                metrics={
                    name: replace(st, values=st.values[:1], stop_reason=PROBE_STOP) for name, st in metrics.items()
                },
                peak_vram_bytes=r.measured_vram_bytes,
                attrs=dict(r.engine_facts),
            )
        self.log.spent_s += drawn.seconds
        return Measurement(metrics=metrics, peak_vram_bytes=r.measured_vram_bytes, attrs=dict(r.engine_facts))

    def model_settings(self, ctx: StudyContext) -> dict[str, Any]:
        """What the recorded real backend told its engine's model (``BaseBackend.model_settings``),
        read back from what it launched, since its own answer would be this machine's: llama-server's
        ``-t`` as the twin's ``host_threads`` (the grids ran on 16 cores; replays run here)."""
        for trials in self.grid.by_key.values():
            for t in trials:
                argv = list(t.record.engine_facts.get("argv") or ())
                if "-t" in argv[:-1]:
                    return {"host_threads": int(argv[argv.index("-t") + 1])}
        return {}

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        key = self.grid.recorded_key(config)
        for t in self.grid.by_key.get(key, []):
            if t.record.deploy_command:
                return t.record.deploy_command
        return f"(replay of {key})"

    def engine_build(self, ctx: StudyContext | None = None) -> str:
        return f"replay of {self.grid.name}"


class ReplayPlugin:
    """Registers one ``ReplayBackend`` in-process (``autotune.plugins.register_plugin``)."""

    def __init__(self, backend: ReplayBackend):
        self.backend = backend

    @hookimpl
    def register_backends(self, register):
        register(self.backend)
