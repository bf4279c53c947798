"""What a trial and a study store: the one writer and the one reader of their attributes.

Optuna keeps a trial's data as free-form user attributes. autotune's are declared here, once:
``write`` refuses a key that is not a field of ``TrialRecord``, and ``TrialRecord.of`` is how
everything that reads a stored trial (the runner on resume, the summary, the report, bench/)
sees it. A study records ``SCHEMA_VERSION``; a storage written by a newer autotune, or a study
that autotune did not write, is refused instead of misread.
"""

from __future__ import annotations

import json
import unicodedata
import weakref
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import optuna

from autotune.backend import Measurement, TrialConfig
from autotune.errors import StorageError
from autotune.study import trial_writes

if TYPE_CHECKING:  # pragma: no cover
    from autotune.hardware import GpuSpec

SCHEMA_VERSION = 2
# 1 -> 2: the knobs every backend shares are stored under one parameter name (``ctx``,
# ``parallel``, ``flash_attn``, ``kv_bits``; space.py) instead of ``<backend>.<name>``; the
# trials' attributes did not change. ``autotune storage upgrade`` renames a version-1 study.
UPGRADABLE = {1}
SCHEMA_ATTR = "autotune_schema_version"
QUALITY_PREFIX = "quality:"
QUALITY_DECISION_PREFIX = QUALITY_PREFIX + "drop:"  # + a hash: one candidate's paired drop and verdict
QUALITY_POWER_ATTR = "quality_power"
# What a run stores beside the trials for the study's summary (study/summary.py, summarize):
LAST_RUN_ATTR = "last_run"                     # {"converged": bool}: how the latest run ended
EXCLUDED_ATTR = "excluded_before_search"       # the pre-search screen's lines (also in the header)
WHY_BEST_ATTR = "why_best"                     # "why not a neighbour" of the best (study/explain.py)
CALIBRATION_PREFIX = "calibration:"  # + a real backend's name: its model backend's calibration
REMEASURE_PREFIX = "remeasure:"
BASELINE_PREFIX = "baseline:"  # + ``Baseline.key``: one launch a user gets without tuning, measured once
FINISH_PLAN_ATTR = "finish_plan"
TrialState = optuna.trial.TrialState


# The runner reads every trial's record before each trial (what was measured, what stands for
# each configuration): joining split attributes again each time took 13% of the default study.
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
    raw: Mapping[str, Any]             # every user attribute as stored, to copy an answer from
    config: Mapping[str, Any] | None = None
    config_key: str | None = None
    worker: str | None = None
    answered_from: int | None = None   # a proposal the storage already answered: not a measurement
    from_prior: bool = False
    explore: bool = False
    probe: bool = False                # multi-fidelity stopped it after its first run (study.probe)
    retry: bool = False                # interrupted or its worker died: measure the configuration again
    deferred: bool = False             # not started: making its weights would overrun the budget (retry too)
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

    @classmethod
    def of(cls, t: optuna.trial.FrozenTrial) -> "TrialRecord":
        finished = t.state.is_finished()
        if finished:
            hit = _FINISHED.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
        a = t.user_attrs
        stored = {name: joined(a, name) for name in STORED if name in a}
        record = cls(number=t.number, state=t.state, values=tuple(t.values) if t.values else None,
                     constraints=dict(t.constraints), raw=a, **stored)
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


# optuna-dashboard shows each user attribute on one line that does not wrap: a long JSON value
# (a trial's metrics are 1,600 characters, an engine's log tail 4,000) made a trial page 9,000 px
# wide. A dict, list or string whose line would be wider than this is stored in parts, with
# ``<field>`` holding a marker; ``joined`` puts it back. A list is stored one item per attribute
# (``<field>.<i>``), a string one piece per attribute, cut only after a separator (a line's end,
# a space, a comma, a semicolon; else a slash) where the line has one, so that a word is never
# split across two lines unless it is wider than a line itself. A dict packs its short items
# together, as many as fit a line, under ``<field>.~<i>``, and stores each item too long for a
# line under ``<field>.<key>`` (recursively): one attribute per key made a trial 131 attributes,
# each written in a transaction of its own, 38% of the default study's time.
# 72 columns: the attribute column of a trial page in a 1,280 px window holds some 85 characters
# of key and value (tests/test_browser.py measures the page); wide letters need the rest.
CELL_CHARS = 72
SPLIT_MARK = "_split"  # {"_split": "dict"}, "list" or "text" (a long string, in pieces)
STALE = {SPLIT_MARK: "stale"}  # a part of an earlier, longer value (attributes cannot be deleted)
_BREAK_AFTER = ("\n", " ,;\t", "/")  # where a piece may end, the best first


def width(text: str) -> int:
    """The columns ``text`` takes on one line: an East Asian wide or full-width character (CJK,
    most emoji) counts two, a combining mark none."""
    if text.isascii():
        return len(text)
    return sum(0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1
               for ch in text)


def _fitting(text: str, columns: int) -> int:
    """How many characters of ``text``, from its start, fit ``columns`` (at least one)."""
    if text.isascii():
        return max(1, min(len(text), columns))
    used = 0
    for i, ch in enumerate(text):
        used += width(ch)
        if used > columns:
            return max(1, i)
    return len(text)


def _cut(text: str, columns: int) -> int:
    """Where the first piece of ``text`` (wider than ``columns``) ends: after the last separator
    that fits, the best kind first; else where the line is full, never before a combining mark
    (it belongs to the letter before it)."""
    n = _fitting(text, columns)
    for kinds in _BREAK_AFTER:
        at = max(text.rfind(ch, 0, n) for ch in kinds)
        if at > 0:
            return at + 1
    while 1 < n < len(text) and unicodedata.combining(text[n]):
        n -= 1
    return n


def _pieces(text: str, columns: int) -> list[str]:
    """``text`` in pieces of at most ``columns`` columns whose concatenation is ``text``."""
    out = []
    while width(text) > columns:
        cut = _cut(text, columns)
        out.append(text[:cut])
        text = text[cut:]
    return out + ([text] if text else [])


def cells(name: str, value: Any) -> list[tuple[str, Any]]:
    """The user attributes that store ``value`` under ``name``: itself, or a marker and its parts."""
    if isinstance(value, str) and width(name) + width(value) + 2 > CELL_CHARS:
        pieces = _pieces(value, max(CELL_CHARS - width(name) - 8, 40))
        digits = len(str(len(pieces) - 1))  # .00 to .11: optuna-dashboard lists the parts in order
        return [(name, {SPLIT_MARK: "text"})] + [(f"{name}.{i:0{digits}d}", p) for i, p in enumerate(pieces)]
    if not isinstance(value, (dict, list)) or not value:
        return [(name, value)]
    if width(name) + len(json.dumps(value, default=str)) <= CELL_CHARS:
        return [(name, value)]
    if isinstance(value, dict):
        if any(not isinstance(k, str) or "." in k or k.startswith(GROUP) for k in value):
            return [(name, value)]  # its keys could not be told from the path: kept whole
        return [(name, {SPLIT_MARK: "dict"})] + _packed(name, value)
    out: list[tuple[str, Any]] = [(name, {SPLIT_MARK: "list"})]
    digits = len(str(len(value) - 1))
    for i, item in enumerate(value):
        out += cells(f"{name}.{i:0{digits}d}", item)
    return out


GROUP = "~"  # ``<field>.~<i>``: several short items of a dict, stored as one


def _packed(name: str, value: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The parts of a long dict: its short items in groups that fit a line, the others split."""
    out: list[tuple[str, Any]] = []
    groups: list[dict[str, Any]] = [{}]

    def fits(d: Mapping[str, Any]) -> bool:
        return len(name) + len(GROUP) + 4 + len(json.dumps(d, default=str)) <= CELL_CHARS

    for key, item in value.items():
        if not fits({key: item}):
            out += cells(f"{name}.{key}", item)
        elif fits({**groups[-1], key: item}):
            groups[-1][key] = item
        else:
            groups.append({key: item})
    return [(f"{name}.{GROUP}{i}", g) for i, g in enumerate(groups) if g] + out


def joined(attrs: Mapping[str, Any], name: str) -> Any:
    """The value ``cells`` stored under ``name`` (a value stored whole is returned as is)."""
    value = attrs.get(name)
    if not (isinstance(value, dict) and set(value) == {SPLIT_MARK}):
        return value
    prefix = name + "."
    keys = {k[len(prefix):].split(".", 1)[0] for k in attrs if k.startswith(prefix)}
    parts = {k: joined(attrs, prefix + k) for k in keys if attrs.get(prefix + k) != STALE}
    if value[SPLIT_MARK] in ("list", "text"):
        ordered = [parts[k] for k in sorted(parts, key=int)]
        return "".join(ordered) if value[SPLIT_MARK] == "text" else ordered
    out: dict[str, Any] = {}
    # The groups in the order they were packed (so the dict's keys keep their order), then the
    # long items by name: ``keys`` is a set, whose order differs from one process to the next.
    for k in sorted(parts, key=lambda k: (0, int(k[len(GROUP):]), "") if k.startswith(GROUP) else (1, 0, k)):
        if k.startswith(GROUP):
            out.update(parts[k])
        else:
            out[k] = parts[k]
    return out


# What ``hold`` and ``set_constraints`` keep for a running trial until its next ``write`` (the
# trial's object -> its user attributes in the order they were held, its constraints).
_HELD: "weakref.WeakKeyDictionary[optuna.Trial, tuple[dict[str, Any], dict[str, float]]]" = weakref.WeakKeyDictionary()


def write(trial: optuna.Trial, **attrs: Any) -> None:
    """Store fields of ``TrialRecord`` on a running trial, in one transaction with the fields
    held for it (saved at once, so a crash keeps what was known); long dicts and lists as
    ``cells``. With no fields, it stores what is held."""
    _store(trial, _attrs_of(trial, attrs))


def hold(trial: optuna.Trial, **attrs: Any) -> None:
    """``write`` these fields with the trial's next ``write``, in its transaction: for fields
    learnt one after another with nothing slow or outside the process in between (the runner
    ``write``s before it launches, makes, measures or tells; each storage transaction was a
    few milliseconds, some eight a trial). The trial reads them at once (``Trial.user_attrs``)."""
    _held(trial, _attrs_of(trial, attrs))


def _held(trial: optuna.Trial, attrs: Mapping[str, Any]) -> None:
    _HELD.setdefault(trial, ({}, {}))[0].update(attrs)
    trial_writes.remember_user_attrs(trial, attrs)


def _store(trial: optuna.Trial, attrs: Mapping[str, Any]) -> None:
    held, constraints = _HELD.pop(trial, ({}, {}))
    trial_writes.set_user_attrs(trial, {**held, **attrs} if held else attrs, constraints or None)


def _attrs_of(trial: optuna.Trial, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The user attributes that store ``fields``: their cells, and a stale mark on each part of
    an earlier, longer value that the new one does not overwrite."""
    had = trial_writes.user_attrs_of(trial)
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if key not in _STORED_SET:
            raise KeyError(f"{key!r} is not a TrialRecord field")
        new = dict(cells(key, value))
        if isinstance(value, (dict, list, str)):
            prefix = key + "."
            out.update((k, STALE) for k, v in had.items() if k.startswith(prefix) and k not in new and v != STALE)
        out.update(new)
    return out


def hold_measurement(trial: optuna.Trial, m: Measurement, predicted_bytes: int) -> None:
    """``hold`` a measurement's fields, and a flat copy of each metric's median (the score and
    the tell follow at once)."""
    attrs = _attrs_of(trial, {"metrics": {k: v.to_dict() for k, v in m.metrics.items()}})
    # flat copies: sortable columns in optuna-dashboard, never read back
    attrs.update((k, v.median) for k, v in m.metrics.items())
    fields: dict[str, Any] = {}
    if m.peak_vram_bytes is not None:
        fields.update(measured_vram_bytes=m.peak_vram_bytes,
                      vram_prediction_error=(predicted_bytes - m.peak_vram_bytes) / m.peak_vram_bytes)
    if m.telemetry is not None:
        fields["telemetry"] = m.telemetry.to_dict()
    if m.attrs:
        fields["engine_facts"] = dict(m.attrs)
    attrs.update(_attrs_of(trial, fields))
    _held(trial, attrs)


def set_constraints(trial: optuna.Trial, constraints: Mapping[str, float]) -> None:
    """The trial's constraints (what the sampler reads as feasibility), stored with its next
    ``write``, in the same transaction; the runner writes before it tells."""
    _HELD.setdefault(trial, ({}, {}))[1].update(constraints)


def records(study: optuna.Study, states: Iterable[TrialState] | None = None) -> list[TrialRecord]:
    return [TrialRecord.of(t) for t in study.get_trials(deepcopy=False, states=tuple(states) if states else None)]


def measured(study: optuna.Study) -> list[TrialRecord]:
    """Complete trials that measured something themselves (not answers from the storage)."""
    return [r for r in records(study, (TrialState.COMPLETE,)) if not r.answered]


def standing_by_key(study: optuna.Study, latest: bool = False,
                    trials: Iterable[optuna.trial.FrozenTrial] | None = None) -> dict[str, TrialRecord]:
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
    return {"key": gpu.key, "name": gpu.name, "vram_bytes": gpu.vram_bytes,
            "mem_bandwidth_gb_s": gpu.mem_bandwidth_gb_s, "compute_capability": gpu.compute_capability}


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

    value: float | None = None           # the first objective, scored as the trial was
    feasible: bool = True                # every constraint held in this run too
    per_user_tok_s: float | None = None
    peak_vram_bytes: int | None = None
    # Each throughput/latency metric's median in this run (aggregate_tok_s, ...): the headline
    # figures are the median over every run, not the first (summary.headline).
    metrics: dict[str, float] | None = None
    error: str | None = None             # the launch failed: the round counts, as a failure
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
        number, _, round_ = key[len(REMEASURE_PREFIX):].partition(":")
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
    name: str = "default"                # which of the backend's baselines (DefaultLaunch.name)
    title: str = ""                      # how the summary names it; empty: the backend's default launch
    weights_why: str = ""                # why these weights: the user's highest-precision candidate
    config: Mapping[str, Any] | None = None
    description: str = ""                # which defaults, and where they come from
    deploy_command: str | None = None    # what the user runs today
    metrics: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # Stat.to_dict() by name
    peak_vram_bytes: int | None = None
    error: str | None = None             # it failed (out of memory, timeout...): why
    log_tail: str | None = None
    seconds: float | None = None
    engine: Mapping[str, Any] | None = None
    worker: str | None = None
    retry: bool = False                  # failed for the budget's or the machine's sake: a resume measures it again

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
            known.setdefault("backend", key[len(BASELINE_PREFIX):])
            if "weights" in known:
                out[key[len(BASELINE_PREFIX):]] = Baseline(**known)
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
    return {key: value for key, value in attrs.items() if key not in (SCHEMA_ATTR, FINISH_PLAN_ATTR)
            and not key.startswith((QUALITY_PREFIX, CALIBRATION_PREFIX, REMEASURE_PREFIX, BASELINE_PREFIX))} if SCHEMA_ATTR in attrs else {}


def check_schema(study: optuna.Study, shown_storage: str) -> None:
    """Refuse a study this autotune would misread.

    Raises:
        StorageError: written by a newer autotune, or trials that autotune did not write.
    """
    version = study.user_attrs.get(SCHEMA_ATTR)
    if version is None:
        if study.get_trials(deepcopy=False):
            raise StorageError(f"study '{study.study_name}' in {shown_storage} was not written by autotune "
                               "(no schema version); use another study name or storage")
        return
    if version in UPGRADABLE:
        raise StorageError(
            f"study '{study.study_name}' in {shown_storage} has schema version {version}: its parameters are named "
            f"per backend (<backend>.ctx), which this autotune would misread; run 'autotune storage upgrade "
            f"{shown_storage}' once to rename them (the trials' records stay as they are)")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise StorageError(f"study '{study.study_name}' in {shown_storage} has schema version {version!r}; this "
                           f"autotune reads up to {SCHEMA_VERSION}: upgrade autotune to read it")


def write_calibration(study: optuna.Study, backend: str, calibration: Mapping[str, Any]) -> None:
    """Store what a model backend learned from ``backend``'s measured trials (replacing the last:
    it is refit on all of them each time)."""
    study.set_user_attr(CALIBRATION_PREFIX + backend, dict(calibration))


def stored_calibrations(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """Each real backend's stored calibration, by the real backend's name."""
    return {key[len(CALIBRATION_PREFIX):]: value for key, value in study.user_attrs.items()
            if key.startswith(CALIBRATION_PREFIX)}


def quality_decisions(study: optuna.Study) -> list[dict[str, Any]]:
    """Every stored paired-drop decision of a study (``autotune.study.quality``), by weights:
    which configurations were decided how."""
    found = [v for k, v in study.user_attrs.items() if k.startswith(QUALITY_DECISION_PREFIX)]
    return sorted(found, key=lambda d: str(d.get("weights")))
