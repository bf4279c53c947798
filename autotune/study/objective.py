"""Scores, penalties and constraints of a trial.

Default score: the chosen throughput metric (aggregate tok/s at the trial's parallel streams)
minus ``penalty_per_point`` tok/s for every accuracy point lost against the reference
weights. Constraints are given to Optuna as real constraints (``Trial.set_constraint``): a value
<= 0 is satisfied. VRAM: (used - budget) / budget, predicted before launch and measured after.
Quality, when ``max_drop_points`` is set: drop - max_drop. Latency, when
``min_per_user_tok_s`` is set: (floor - per-user tok/s) / floor, so that a configuration which
serves many users but each of them slowly is not taken for a good one. Each latency target
(``ttft_p95_ms`` and the like, docs/workload.md): (measured percentile - target) / target. With
targets, the score is usually goodput (``goodput_tok_s``): the throughput of the requests that met
every target, measured per request (:mod:`autotune.measure.load`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from autotune.config import Objective

if TYPE_CHECKING:  # pragma: no cover
    import optuna


@dataclass(frozen=True)
class Score:
    """A trial's objective value(s) and constraint values."""

    values: tuple[float, ...]
    constraints: dict[str, float]
    throughput: float
    quality_drop_points: float | None
    penalty: float

    @property
    def feasible(self) -> bool:
        return all(c <= 0 for c in self.constraints.values())


def directions(objective: Objective) -> list[str]:
    """Optuna directions: one for a single score, throughput and quality drop for a Pareto study."""
    if objective.mode == "pareto":
        return ["maximize", "minimize"]
    return ["maximize"]


def objective_names(objective: Mapping[str, Any], n_objectives: int) -> list[str]:
    """The names of the objectives (``score``'s values, in order) that Optuna and its dashboard
    show; ``objective`` is the study file's [objective] as stored (``vars(Objective)``)."""
    metric = str(objective.get("metric", "aggregate_tok_s"))
    if n_objectives > 1:
        return [metric, "quality drop (points)"][:n_objectives]
    return [f"score ({metric} - penalty)"]


def metric_words(metric: str) -> str:
    """A metric's name as a person reads it: ``aggregate_tok_s`` -> ``aggregate tok/s``."""
    return metric.replace("_tok_s", " tok/s").replace("_ms", " ms").replace("_", " ")


_WORDED = {
    "metric",
    "quality",
    "penalty_per_point",
    "max_drop_points",
    "reference_weights",
    "mode",
    "require_quality",
    "min_per_user_tok_s",
    "slo",
}


def objective_words(objective: Mapping[str, Any]) -> str:
    """The study file's [objective] as stored (``vars(Objective)``) in words, e.g. "maximise
    aggregate tok/s, per-user at least 10 tok/s"; a key this does not know is named as it is."""
    metric = metric_words(str(objective.get("metric") or "aggregate_tok_s"))
    quality = objective.get("quality")
    parts = [
        f"the trade-off of {metric} (higher) against {quality or 'quality'} drop (lower): every configuration "
        "no other beats on both"
        if objective.get("mode") == "pareto"
        else f"maximise {metric}"
    ]
    if objective.get("min_per_user_tok_s") is not None:
        parts.append(f"per-user at least {objective['min_per_user_tok_s']:g} tok/s")
    if quality:
        against = f" against {objective['reference_weights']}" if objective.get("reference_weights") else ""
        penalty, most = objective.get("penalty_per_point") or 0, objective.get("max_drop_points")
        if penalty:
            parts.append(f"less {penalty:g} per point of {quality} drop{against}")
        if most is not None:
            parts.append(f"{quality} drop at most {most:g} point{'' if most == 1 else 's'}{against}")
        if not penalty and most is None and objective.get("mode") != "pareto":
            parts.append(f"{quality} measured{against}, not counted in the score")
    for key, target in objective.get("slo") or ():  # ("ttft_p95_ms", 150.0): "TTFT p95 at most 150 ms"
        quantity, percentile, _unit = str(key).split("_")
        parts.append(f"{quantity.upper()} {percentile} at most {target:g} ms")
    parts += [f"{k} = {v}" for k, v in objective.items() if k not in _WORDED and v is not None]
    return ", ".join(parts)


def name_objectives(study: optuna.Study, objective: Mapping[str, Any]) -> None:
    names = objective_names(objective, len(study.directions))
    if study.metric_names != names:
        study.set_metric_names(names)


VRAM = "vram_over_budget"
QUALITY = "quality_drop_over_max"
PER_USER = "per_user_below_min"
# The quality constraint of a configuration refused by its verdict although its point estimate
# is below the bound (undecided, [quality] undecided = "reject"): infeasible, by a hair.
QUALITY_REFUSED = 1e-3


def vram_constraint(used_bytes: int, budget_bytes: int) -> float:
    return (used_bytes - budget_bytes) / budget_bytes


def unmeasured_constraints(objective: Objective, vram_over: float = 1.0) -> dict[str, float]:
    """Constraint values of a trial that never ran (pruned): infeasible, by VRAM as given.

    Samplers learn from pruned trials too; a configuration that cannot run must never look
    feasible to them.
    """
    out = {VRAM: vram_over}
    if objective.max_drop_points is not None:
        out[QUALITY] = 0.0
    if objective.min_per_user_tok_s is not None:
        out[PER_USER] = 0.0
    for key, _ in objective.slo:
        out[slo_constraint(key)] = 0.0
    return out


def slo_constraint(key: str) -> str:
    """The constraint of a latency target (``ttft_p95_ms`` -> ``slo_ttft_p95_ms``): its value is
    (measured - target) / target, so a trial that meets it is <= 0."""
    return f"slo_{key}"


def score(
    objective: Objective,
    throughput: float,
    vram_bytes: int,
    vram_budget_bytes: int,
    quality_drop_points: float | None,
    per_user_tok_s: float | None = None,
    quality_admitted: bool | None = None,
    latencies: Mapping[str, float] | None = None,
) -> Score:
    """Score one measured trial.

    Args:
        objective: The study's objective settings.
        throughput: The measured value of ``objective.metric`` (tok/s).
        vram_bytes: Measured peak device memory, or the prediction when nothing was measured.
        vram_budget_bytes: The budget the study allows.
        quality_drop_points: Accuracy points lost against the reference (may be negative when
            the artifact scores better), or None when the study has no quality metric.
        per_user_tok_s: Measured decode speed each user sees at the trial's parallel streams.
        quality_admitted: The study's verdict on a paired drop (``autotune.study.quality``):
            True when its interval lies within the bound (or the undecided policy accepts it),
            False when it lies over (or the policy rejects it); None: the bound is applied to
            the point estimate. The verdict sets the constraint's sign, the distance its size.
        latencies: The trial's measured latency percentiles (medians over its runs), by key
            (``ttft_p95_ms``...), for the study's latency targets.
    """
    drop = quality_drop_points
    penalty = objective.penalty_per_point * max(drop, 0.0) if drop is not None else 0.0
    constraints = {VRAM: vram_constraint(vram_bytes, vram_budget_bytes)}
    if objective.max_drop_points is not None:
        # No quality figure counts as the worst: a study that caps the drop must not pass a
        # trial it could not check (float('inf') is not storable; a large finite value is).
        over = (drop - objective.max_drop_points) if drop is not None else 1e9
        if quality_admitted is True:
            over = min(over, 0.0)
        elif quality_admitted is False:
            over = max(over, QUALITY_REFUSED)
        constraints[QUALITY] = over
    if objective.min_per_user_tok_s is not None:
        floor = objective.min_per_user_tok_s
        constraints[PER_USER] = (floor - per_user_tok_s) / floor if per_user_tok_s is not None else 1e9
    for key, target in objective.slo:
        value = (latencies or {}).get(key)
        constraints[slo_constraint(key)] = (value - target) / target if value is not None else 1e9
    if objective.mode == "pareto":
        values: Sequence[float] = (throughput, drop if drop is not None else 0.0)
    else:
        values = (throughput - penalty,)
    return Score(tuple(values), constraints, throughput, drop, penalty)
