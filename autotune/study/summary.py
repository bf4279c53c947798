"""A study's outcome: counts, the best feasible trial and the Pareto front, from its records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import optuna

from autotune.study import records
from autotune.study.records import TrialRecord, TrialState


@dataclass
class StudySummary:
    """The outcome of a run (``autotune study``) or of a stored study (``autotune best``).

    ``storage`` is always the masked URL: a summary is printed and stored."""

    study_name: str
    storage: str
    n_trials: int
    n_complete: int
    n_failed: int
    n_pruned: int
    n_new: int
    n_measured: int
    interrupted: bool
    elapsed_s: float
    best: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def best_trial(study: optuna.Study) -> TrialRecord | None:
    """The best feasible trial that measured itself (first objective for a Pareto study)."""
    best = None
    for r in records.measured(study):
        if r.feasible and r.values and (best is None or r.values[0] > best.values[0]):  # type: ignore[index]
            best = r
    return best


def pareto_front(study: optuna.Study) -> list[TrialRecord]:
    """Feasible measured trials that no other feasible one beats on every objective."""
    signs = [1.0 if d == optuna.study.StudyDirection.MAXIMIZE else -1.0 for d in study.directions]
    pool = [r for r in records.measured(study) if r.feasible and r.values]

    def dominates(a: TrialRecord, b: TrialRecord) -> bool:
        pairs = [(s * x, s * y) for s, x, y in zip(signs, a.values or (), b.values or ())]
        return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)

    front = [r for r in pool if not any(dominates(o, r) for o in pool if o is not r)]
    return sorted(front, key=lambda r: -signs[0] * r.values[0])  # type: ignore[index]


def trial_record(r: TrialRecord) -> dict[str, Any]:
    """What ``autotune best`` shows of a trial."""
    return {
        "number": r.number,
        "params": dict(r.config or {}),
        "values": list(r.values) if r.values else None,
        "metrics": {k: v.get("median") for k, v in r.metrics.items()},
        "quality": r.quality,
        "predicted_vram": r.predicted_vram,
        "measured_vram_bytes": r.measured_vram_bytes,
        "deploy_command": r.deploy_command,
        "engine": r.engine,
    }


def summarize(study: optuna.Study, shown_storage: str) -> StudySummary:
    """Counts and best trial of a study as stored."""
    all_records = records.records(study)
    states = [r.state for r in all_records]
    n_answered = sum(1 for r in all_records if r.answered)
    best = best_trial(study)
    summary = StudySummary(
        study_name=study.study_name,
        storage=shown_storage,
        n_trials=len(all_records),
        n_complete=states.count(TrialState.COMPLETE),
        n_failed=states.count(TrialState.FAIL),
        n_pruned=states.count(TrialState.PRUNED) - n_answered,
        n_new=0,
        n_measured=0,
        interrupted=False,
        elapsed_s=0.0,
        best=trial_record(best) if best else None,
        extra={"n_answered_from_storage": n_answered},
    )
    if len(study.directions) > 1:
        summary.extra["pareto_front"] = [trial_record(r) for r in pareto_front(study)]
    return summary
