"""What a trial and a study store: the one writer and the one reader of their attributes.

Optuna keeps a trial's data as free-form user attributes. autotune's are declared here, once:
``attributes`` (what ``store`` and study/trial_result.commit write) refuses a key that is not a
field of ``TrialRecord``, and ``TrialRecord.of`` is how
everything that reads a stored trial (the runner on resume, the summary, the report, bench/)
sees it. A study records ``SCHEMA_VERSION``; a storage written by a newer autotune, or a study
that autotune did not write, is refused instead of misread.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import optuna

from autotune.engine.acceptance import ACCEPTANCE_ATTR
from autotune.engine.backend import Measurement, TrialConfig
from autotune.errors import StorageError
from autotune.study import schema2_cells

if TYPE_CHECKING:  # pragma: no cover
    from autotune.hardware.gpus import GpuSpec

SCHEMA_VERSION = 3
# 1 -> 2: the knobs every backend shares are stored under one parameter name (``ctx``,
# ``parallel``, ``flash_attn``, ``kv_bits``; space.py) instead of ``<backend>.<name>``; the
# trials' attributes did not change. ``autotune storage upgrade`` renames a version-1 study.
UPGRADABLE = {1}
# 2 -> 3: one attribute per field, its whole value (schema 2 cut long values into 72-column
# parts: study/schema2_cells.py reads them), and flat copies (``FLAT``). A schema-2 study is
# read as it is (every storage under bench/results is one) but takes no new trials:
# ``autotune storage upgrade`` rewrites it (study/upgrade.py).
READ_ONLY = {2}
SCHEMA_ATTR = "autotune_schema_version"
QUALITY_PREFIX = "quality:"
QUALITY_DECISION_PREFIX = QUALITY_PREFIX + "drop:"  # + a hash: one candidate's paired drop and verdict
QUALITY_POWER_ATTR = "quality_power"
# What a run stores beside the trials for the study's summary (study/summary.py, summarize):
LAST_RUN_ATTR = "last_run"  # {"converged": bool}: how the latest run ended
EXCLUDED_ATTR = "excluded_before_search"  # the pre-search screen's lines (also in the header)
WHY_BEST_ATTR = "why_best"  # "why not a neighbour" of the best (study/explain.py)
CALIBRATION_PREFIX = "calibration:"  # + a real backend's name: its model backend's calibration
REMEASURE_PREFIX = "remeasure:"
BASELINE_PREFIX = "baseline:"  # + ``Baseline.key``: one launch a user gets without tuning, measured once
FINISH_PLAN_ATTR = "finish_plan"
TrialState = optuna.trial.TrialState


# The runner reads every trial's record before each trial (what was measured, what stands for
# each configuration): building records again each time (joining schema 2's parts) took 13% of the default study.
# A finished trial never changes, and Optuna's cached storage hands back the same FrozenTrial
# for it, so its record is kept while that object lives (id -> weak reference to it, record).
_FINISHED: dict[int, tuple[weakref.ref, "TrialRecord"]] = {}


@dataclass(frozen=True)
class TrialRecord:
    """One stored trial as autotune reads it. Fields after ``raw`` are the user attributes a
    trial may store, under the same names."""

    number: int
    state: TrialState
    values: tuple[float, ...] | None
    constraints: Mapping[str, float]
    raw: Mapping[str, Any]  # every user attribute as stored, to copy an answer from
    config: Mapping[str, Any] | None = None
    config_key: str | None = None
    worker: str | None = None
    answered_from: int | None = None  # a proposal the storage already answered: not a measurement
    from_prior: bool = False
    explore: bool = False
    probe: bool = False  # multi-fidelity stopped it after its first run (study.probe)
    retry: bool = False  # interrupted or its worker died: measure the configuration again
    deferred: bool = False  # not started: making its weights would overrun the budget (retry too)
    prune_reason: str | None = None
    fail_reason: str | None = None
    log_tail: str | None = None
    predicted_vram: Mapping[str, Any] | None = None
    deploy_command: str | None = None
    engine: Mapping[str, Any] | None = None
    gpu: Mapping[str, Any] | None = None
    metrics: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    measured_vram_bytes: int | None = None
    vram_prediction_error: float | None = None
    vram_residual_bytes: int | None = None
    telemetry: Mapping[str, Any] | None = None
    engine_facts: Mapping[str, Any] = field(default_factory=dict)
    quality: Mapping[str, Any] | None = None
    quality_drop_points: float | None = None
    artifacts: tuple[Mapping[str, Any], ...] | list[Mapping[str, Any]] = ()  # weights made for it or found cached
    score: Mapping[str, Any] | None = None
    # Speculative decoding's drafted/accepted tokens, the engine's own counters summed over the
    # measured requests (autotune/engine/acceptance.py, Acceptance.to_dict); None: no speculation.
    acceptance: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, t: optuna.trial.FrozenTrial) -> "TrialRecord":
        finished = t.state.is_finished()
        if finished:
            hit = _FINISHED.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
        a = t.user_attrs
        stored = {name: field_of(a, name) for name in STORED if name in a}
        record = cls(
            number=t.number,
            state=t.state,
            values=tuple(t.values) if t.values else None,
            constraints=dict(t.constraints),
            raw=a,
            **stored,
        )
        if finished:
            key = id(t)
            _FINISHED[key] = (weakref.ref(t, lambda _, key=key: _FINISHED.pop(key, None)), record)
        return record

    @property
    def trial_config(self) -> TrialConfig | None:
        return TrialConfig.from_dict(self.config) if self.config else None

    @property
    def answered(self) -> bool:
        """Whether the storage answered it from an earlier trial (then it measured nothing)."""
        return self.answered_from is not None

    @property
    def launched(self) -> bool:
        return self.engine is not None

    @property
    def feasible(self) -> bool:
        return all(c <= 0 for c in self.constraints.values())

    @property
    def reason(self) -> str:
        return self.prune_reason or self.fail_reason or self.state.name

    @property
    def stands_for_config(self) -> bool:
        """Whether its outcome answers for its configuration: measured, pruned with a reason,
        running, or failed for a reason that would repeat (not interrupted, not a dead worker)."""
        if self.config_key is None or self.answered:
            return False
        if self.state in (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED):
            return True
        return self.state == TrialState.FAIL and bool(self.fail_reason) and not self.retry

    def median(self, metric: str) -> float | None:
        m = self.metrics.get(metric)
        return None if m is None else m.get("median")


_FROM_OPTUNA = ("number", "state", "values", "constraints", "raw")
STORED = tuple(f.name for f in fields(TrialRecord) if f.name not in _FROM_OPTUNA)
_STORED_SET = frozenset(STORED)


# Schema 3 stores each field above as one user attribute holding its whole value (Optuna keeps
# it as JSON text of any length), so pandas, SQL and optuna-dashboard read a trial as it is:
# ``json.loads`` of one column per field. Beside them, a few flat copies of what a person sorts
# by (the dashboard's columns, ``trials_dataframe``); written from the fields, never read back.
FLAT = ("score_value", "aggregate_tok_s", "per_user_tok_s", "memory_measured_gib", "memory_predicted_gib", "reason")
_GIB = 1024**3


def flat_columns(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The flat copies that ``fields`` (some of a trial's) set."""
    out: dict[str, Any] = {}
    score = fields.get("score")
    if isinstance(score, Mapping) and score.get("values"):
        out["score_value"] = score["values"][0]
    metrics = fields.get("metrics")
    if isinstance(metrics, Mapping):
        for key in ("aggregate_tok_s", "per_user_tok_s"):
            if isinstance(metrics.get(key), Mapping) and metrics[key].get("median") is not None:
                out[key] = metrics[key]["median"]
    if fields.get("measured_vram_bytes") is not None:
        out["memory_measured_gib"] = round(fields["measured_vram_bytes"] / _GIB, 3)
    predicted = fields.get("predicted_vram")
    if isinstance(predicted, Mapping) and predicted.get("total_bytes") is not None:
        out["memory_predicted_gib"] = round(predicted["total_bytes"] / _GIB, 3)
    # An answer (PRUNED) copies the failed trial's fail_reason beside its own prune_reason: the
    # reason of its own state wins.
    for key in ("fail_reason", "prune_reason"):
        if fields.get(key):
            out["reason"] = fields[key]
    return out


def field_of(attrs: Mapping[str, Any], name: str) -> Any:
    """Field ``name`` of a trial's user attributes, in either schema this autotune reads (a
    schema-2 value stored in parts is joined: ``schema2_cells``)."""
    return schema2_cells.joined(attrs, name)


def attributes(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The user attributes that store ``fields`` (of ``TrialRecord``): each whole, and their
    flat copies.

    Raises:
        KeyError: a name that is not a field of ``TrialRecord``.
    """
    for key in fields:
        if key not in _STORED_SET:
            raise KeyError(f"{key!r} is not a TrialRecord field")
    return {**fields, **flat_columns(fields)}


def store(trial: optuna.Trial, fields: Mapping[str, Any]) -> None:
    """Write ``fields`` of a running trial, through Optuna's public ``set_user_attr`` (the
    pipeline's owner calls this at its checkpoints: study/trial_result.py)."""
    for key, value in attributes(fields).items():
        trial.set_user_attr(key, value)


def measurement_fields(m: Measurement, predicted_bytes: int) -> dict[str, Any]:
    """The fields a measurement sets."""
    fields: dict[str, Any] = {"metrics": {k: v.to_dict() for k, v in m.metrics.items()}}
    if m.peak_vram_bytes is not None:
        fields.update(
            measured_vram_bytes=m.peak_vram_bytes,
            vram_prediction_error=(predicted_bytes - m.peak_vram_bytes) / m.peak_vram_bytes,
        )
    if m.telemetry is not None:
        fields["telemetry"] = m.telemetry.to_dict()
    facts = {k: v for k, v in m.attrs.items() if k != ACCEPTANCE_ATTR}
    if facts:
        fields["engine_facts"] = facts
    if m.attrs.get(ACCEPTANCE_ATTR) is not None:
        fields["acceptance"] = dict(m.attrs[ACCEPTANCE_ATTR])
    return fields


def records(study: optuna.Study, states: Iterable[TrialState] | None = None) -> list[TrialRecord]:
    return [TrialRecord.of(t) for t in study.get_trials(deepcopy=False, states=tuple(states) if states else None)]


def measured(study: optuna.Study) -> list[TrialRecord]:
    """Complete trials that measured something themselves (not answers from the storage)."""
    return [r for r in records(study, (TrialState.COMPLETE,)) if not r.answered]


def standing_by_key(
    study: optuna.Study, latest: bool = False, trials: Iterable[optuna.trial.FrozenTrial] | None = None
) -> dict[str, TrialRecord]:
    """The trial whose outcome stands for each configuration: the first one (what the runner
    answers from), or with ``latest`` the newest (what a person wants told after a resume).
    Among ``trials`` where given (already read), else the study's, read now."""
    out: dict[str, TrialRecord] = {}
    for r in records(study) if trials is None else map(TrialRecord.of, trials):
        if r.stands_for_config and (latest or r.config_key not in out):
            out[r.config_key] = r  # type: ignore[index]
    return out


def gpu_attrs(gpu: "GpuSpec") -> dict[str, Any]:
    """The card as a trial and a study record it."""
    return {
        "key": gpu.key,
        "name": gpu.name,
        "vram_bytes": gpu.vram_bytes,
        "mem_bandwidth_gb_s": gpu.mem_bandwidth_gb_s,
        "compute_capability": gpu.compute_capability,
    }


# ------------------------------------------------------------------ the study's own attributes


def write_study_header(study: optuna.Study, header: Mapping[str, Any]) -> None:
    """Record what a new study was run with (once: a resumed study keeps its first header)."""
    if SCHEMA_ATTR in study.user_attrs:
        return
    study.set_user_attr(SCHEMA_ATTR, SCHEMA_VERSION)
    for key, value in header.items():
        study.set_user_attr(key, value)


@dataclass(frozen=True)
class Remeasure:
    """One launch of the noise-aware finish (``StudyRunner.finish``): a trial's configuration
    measured again, stored as the study attribute ``remeasure:<trial number>:<round>``.

    Study attributes, not the trial's own: Optuna refuses to change a finished trial, and
    re-measures stored as trials of their own would enter the sampler's model and the study's
    counts as second copies of a configuration. One attribute per round, so that two workers
    never overwrite each other's rounds and a finish cut short keeps the rounds it stored.
    """

    value: float | None = None  # the first objective, scored as the trial was
    feasible: bool = True  # every constraint held in this run too
    per_user_tok_s: float | None = None
    peak_vram_bytes: int | None = None
    # Each throughput/latency metric's median in this run (aggregate_tok_s, ...): the headline
    # figures are the median over every run, not the first (summary.headline).
    metrics: dict[str, float] | None = None
    error: str | None = None  # the launch failed: the round counts, as a failure
    worker: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


_REMEASURE_FIELDS = frozenset(f.name for f in fields(Remeasure))


def write_remeasure(study: optuna.Study, number: int, round_: int, **attrs: Any) -> None:
    """Store round ``round_`` (0-based) of the finish for trial ``number``."""
    unknown = sorted(set(attrs) - _REMEASURE_FIELDS)
    if unknown:
        raise KeyError(f"{unknown[0]!r} is not a Remeasure field")
    study.set_user_attr(f"{REMEASURE_PREFIX}{number}:{round_}", attrs)


def remeasures(study: optuna.Study) -> dict[int, dict[int, Remeasure]]:
    """Every stored round of the finish: trial number -> round -> what it measured."""
    out: dict[int, dict[int, Remeasure]] = {}
    for key, value in study.user_attrs.items():
        if not key.startswith(REMEASURE_PREFIX) or not isinstance(value, dict):
            continue
        number, _, round_ = key[len(REMEASURE_PREFIX) :].partition(":")
        if number.isdigit() and round_.isdigit():
            known = {k: v for k, v in value.items() if k in _REMEASURE_FIELDS}
            out.setdefault(int(number), {})[int(round_)] = Remeasure(**known)
    return out


@dataclass(frozen=True)
class Baseline:
    """One of a backend's baselines (``BaseBackend.baselines``: its default launch, or another
    choice the engine makes for itself), measured once per study before the search, stored as
    the study attribute ``baseline:<key>``.

    A study attribute, not a trial: a trial would enter the sampler's model, could become the
    best, and its configuration (flags left out) is not a point of the search space. A study
    written before a backend could have several holds its default launch alone, under
    ``baseline:<backend>`` without a name: it reads as the ``default`` one.
    """

    backend: str
    weights: str
    name: str = "default"  # which of the backend's baselines (DefaultLaunch.name)
    title: str = ""  # how the summary names it; empty: the backend's default launch
    weights_why: str = ""  # why these weights: the user's highest-precision candidate
    config: Mapping[str, Any] | None = None
    description: str = ""  # which defaults, and where they come from
    deploy_command: str | None = None  # what the user runs today
    metrics: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # Stat.to_dict() by name
    peak_vram_bytes: int | None = None
    error: str | None = None  # it failed (out of memory, timeout...): why
    log_tail: str | None = None
    seconds: float | None = None
    engine: Mapping[str, Any] | None = None
    worker: str | None = None
    retry: bool = False  # failed for the budget's or the machine's sake: a resume measures it again

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def key(self) -> str:
        return baseline_key(self.backend, self.name)

    def median(self, metric: str) -> float | None:
        m = self.metrics.get(metric)
        return None if m is None else m.get("median")


_BASELINE_FIELDS = frozenset(f.name for f in fields(Baseline))


def baseline_key(backend: str, name: str) -> str:
    """How a study keys one baseline: the backend alone for its default launch (as studies
    written before there were several keyed it), ``<backend>:<name>`` for each other one."""
    return backend if name == "default" else f"{backend}:{name}"


def write_baseline(study: optuna.Study, backend: str, name: str = "default", **attrs: Any) -> None:
    """Store ``backend``'s measured (or failed) baseline ``name``; it is never measured again."""
    unknown = sorted(set(attrs) - _BASELINE_FIELDS)
    if unknown:
        raise KeyError(f"{unknown[0]!r} is not a Baseline field")
    study.set_user_attr(BASELINE_PREFIX + baseline_key(backend, name), {"backend": backend, "name": name, **attrs})


def baselines(study: optuna.Study) -> dict[str, Baseline]:
    """Every stored baseline, by ``Baseline.key`` (``<backend>``, ``<backend>:<name>``)."""
    out = {}
    for key, value in study.user_attrs.items():
        if key.startswith(BASELINE_PREFIX) and isinstance(value, dict):
            known = {k: v for k, v in value.items() if k in _BASELINE_FIELDS}
            known.setdefault("backend", key[len(BASELINE_PREFIX) :])
            if "weights" in known:
                out[key[len(BASELINE_PREFIX) :]] = Baseline(**known)
    return out


def write_finish_plan(study: optuna.Study, trials: Iterable[int], rounds: int) -> None:
    """Which trials the latest finish compares, and in how many rounds (its verdict reads
    only those: rounds of trials an earlier finish compared may be stale)."""
    study.set_user_attr(FINISH_PLAN_ATTR, {"trials": list(trials), "rounds": rounds})


def finish_plan(study: optuna.Study) -> tuple[list[int], int] | None:
    plan = study.user_attrs.get(FINISH_PLAN_ATTR)
    if not isinstance(plan, dict):
        return None
    return [int(n) for n in plan.get("trials", [])], int(plan.get("rounds", 0))


def study_header(study: optuna.Study) -> dict[str, Any]:
    """What a study was run with, as ``write_study_header`` recorded it (``gpu``, ``model``,
    ``study_file``, ...; empty for a study autotune did not write)."""
    attrs = study.user_attrs
    return (
        {
            key: value
            for key, value in attrs.items()
            if key not in (SCHEMA_ATTR, FINISH_PLAN_ATTR)
            and not key.startswith((QUALITY_PREFIX, CALIBRATION_PREFIX, REMEASURE_PREFIX, BASELINE_PREFIX))
        }
        if SCHEMA_ATTR in attrs
        else {}
    )


def check_schema(study: optuna.Study, shown_storage: str, writing: bool = False) -> None:
    """Refuse a study this autotune would misread, or, ``writing``, one it would write in a
    layout its readers do not expect (schema 2: read, never written).

    Raises:
        StorageError: written by a newer autotune, trials that autotune did not write, or a
            schema-2 study to write into.
    """
    version = study.user_attrs.get(SCHEMA_ATTR)
    if version is None:
        if study.get_trials(deepcopy=False):
            raise StorageError(
                f"study '{study.study_name}' in {shown_storage} was not written by autotune "
                "(no schema version); use another study name or storage"
            )
        return
    if version in UPGRADABLE:
        raise StorageError(
            f"study '{study.study_name}' in {shown_storage} has schema version {version}: its parameters are named "
            f"per backend (<backend>.ctx), which this autotune would misread; run 'autotune storage upgrade "
            f"{shown_storage}' once to rename them (the trials' records stay as they are)"
        )
    if writing and version in READ_ONLY:
        raise StorageError(
            f"study '{study.study_name}' in {shown_storage} has schema version {version}: its long values are stored "
            f"in 72-column parts, which this autotune reads but does not write; run 'autotune storage upgrade "
            f"{shown_storage}' once to store each field whole (schema {SCHEMA_VERSION}), then run again"
        )
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise StorageError(
            f"study '{study.study_name}' in {shown_storage} has schema version {version!r}; this "
            f"autotune reads up to {SCHEMA_VERSION}: upgrade autotune to read it"
        )


def write_calibration(study: optuna.Study, backend: str, calibration: Mapping[str, Any]) -> None:
    """Store what a model backend learned from ``backend``'s measured trials (replacing the last:
    it is refit on all of them each time)."""
    study.set_user_attr(CALIBRATION_PREFIX + backend, dict(calibration))


def stored_calibrations(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """Each real backend's stored calibration, by the real backend's name."""
    return {
        key[len(CALIBRATION_PREFIX) :]: value
        for key, value in study.user_attrs.items()
        if key.startswith(CALIBRATION_PREFIX)
    }


def quality_decisions(study: optuna.Study) -> list[dict[str, Any]]:
    """Every stored paired-drop decision of a study (``autotune.study.quality``), by weights:
    which configurations were decided how."""
    found = [v for k, v in study.user_attrs.items() if k.startswith(QUALITY_DECISION_PREFIX)]
    return sorted(found, key=lambda d: str(d.get("weights")))
