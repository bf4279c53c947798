"""Launch-to-launch noise: what a figure of one launch is worth (issue 39 item 4).

Each trial's spread is that of the runs inside one launch (``[measure]``): the engine, its
allocator and the card's clocks stay as they were, so runs agree to 1-3%. A second launch of the
same configuration starts all of that again: on an H200 with experts in host memory 13
configurations measured in two launches differed by 11% (median) and 25% (worst), and the best
read 143, 175, 166 and 167 tok/s in four. A ratio of two single launches (the winner against a
baseline) is only as good as that.

Every configuration measured in more than one launch contributes: the finish's rounds beside
each contender's first launch, a configuration the search measured twice (a retry, a repeated
proposal on resume), and each baseline with the finish's launches of it (the finish re-launches
the fastest baseline beside the leaders, interleaved: ``FinishPhase``). The study's
between-launch spread is the median over those configurations of their launches' range
relative to their median (for two launches: their relative difference), the worst kept beside
it; ratios to baselines and the report use it, next to the within-launch spread, each named.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from autotune.study import records

if TYPE_CHECKING:  # pragma: no cover
    import optuna

__all__ = [
    "BASELINE_ROUND_PREFIX",
    "Noise",
    "baseline_rounds",
    "estimate",
    "launches_by_config",
    "write_baseline_round",
]

# Under the baselines' own prefix (records.BASELINE_PREFIX), so a study header never takes it for a
# setting; records.baselines skips it (no weights).
BASELINE_ROUND_PREFIX = records.BASELINE_PREFIX + "finish-round:"  # + <Baseline.key>:<round>


def write_baseline_round(
    study: "optuna.Study",
    key: str,
    round_: int,
    *,
    metrics: Mapping[str, float] | None = None,
    error: str | None = None,
    worker: str | None = None,
) -> None:
    """Store the finish's launch ``round_`` of baseline ``key`` (a study attribute per round, as
    the contenders' rounds: two workers never overwrite each other's)."""
    study.set_user_attr(
        f"{BASELINE_ROUND_PREFIX}{key}:{round_}", {"metrics": dict(metrics or {}), "error": error, "worker": worker}
    )


def baseline_rounds(study: "optuna.Study") -> dict[str, dict[int, dict[str, Any]]]:
    """Baseline key -> round -> what the finish measured of it."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for name, value in study.user_attrs.items():
        if not name.startswith(BASELINE_ROUND_PREFIX) or not isinstance(value, dict):
            continue
        key, _, round_ = name[len(BASELINE_ROUND_PREFIX) :].rpartition(":")
        if key and round_.isdigit():
            out.setdefault(key, {})[int(round_)] = value
    return out


def baseline_launches(base: records.Baseline, rounds: Mapping[int, Mapping[str, Any]], metric: str) -> list[float]:
    """Each launch's median of ``metric`` for one baseline: its own, then the finish's."""
    first = base.median(metric)
    out = [] if first is None or base.failed else [float(first)]
    for _, r in sorted(rounds.items()):
        value = (r.get("metrics") or {}).get(metric)
        if value is not None and not r.get("error"):
            out.append(float(value))
    return out


def launches_by_config(study: "optuna.Study", metric: str) -> dict[str, list[float]]:
    """Every configuration's launches (each launch's median of ``metric``), keyed by the
    configuration (a trial's config key, ``baseline:<key>`` for a baseline)."""
    out: dict[str, list[float]] = defaultdict(list)
    number_to_key: dict[int, str] = {}
    for r in records.measured(study):
        m = r.median(metric)
        if r.config_key is None or m is None:
            continue
        out[r.config_key].append(float(m))
        number_to_key[r.number] = r.config_key
    for number, rounds in records.remeasures(study).items():
        key = number_to_key.get(number)
        if key is None:
            continue
        for _, round_ in sorted(rounds.items()):
            # Rounds stored before they kept their metrics hold the score alone: the metric's
            # own value where the objective is that metric and the round met every constraint.
            value = (
                (round_.metrics or {}).get(metric)
                if round_.metrics is not None
                else (round_.value if round_.feasible else None)
            )
            if value is not None and not round_.failed:
                out[key].append(float(value))
    stored_rounds = baseline_rounds(study)
    for key, base in records.baselines(study).items():
        out[f"baseline:{key}"] = baseline_launches(base, stored_rounds.get(key, {}), metric)
    return dict(out)


def relative_range(values: Iterable[float]) -> float | None:
    vals = list(values)
    if len(vals) < 2:
        return None
    mid = statistics.median(vals)
    return (max(vals) - min(vals)) / abs(mid) if mid else None


@dataclass(frozen=True)
class Noise:
    """A study's two spreads of ``metric``.

    Attributes:
        within: The median over measured trials of their runs' spread inside one launch (MAD
            over median); None with no measured trial.
        between: The median over configurations launched more than once of their launches'
            relative range; None where none was; ``worst`` the largest of them.
        configs, launches: How many configurations, and launches of them, ``between`` is from.
    """

    metric: str
    within: float | None
    between: float | None
    worst: float | None
    configs: int
    launches: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "within_launch": self.within,
            "between_launches": self.between,
            "between_worst": self.worst,
            "configs": self.configs,
            "launches": self.launches,
        }

    @property
    def silent(self) -> bool:
        """A model's study: every run agreed exactly and nothing was launched twice."""
        return not self.within and self.between is None

    def text(self) -> str:
        within = "-" if self.within is None else f"{self.within * 100:.1f}%"
        line = f"noise: within a launch {within} (the runs inside one launch"
        if self.between is None:
            return line + "); between launches unknown (no configuration was measured in more than one launch)"
        return (
            line + f"), between launches {self.between * 100:.1f}% (median over {self.configs} configurations "
            f"measured in more than one launch, {self.launches} launches; worst {self.worst * 100:.1f}%): "
            "a ratio or a lead smaller than the latter is not shown to be real"
        )


def objective_metric(study: "optuna.Study") -> str:
    return str((records.study_header(study).get("objective") or {}).get("metric") or "aggregate_tok_s")


def estimate(study: "optuna.Study", metric: str | None = None) -> Noise:
    metric = metric or objective_metric(study)
    within = [s for r in records.measured(study) if (s := (r.metrics.get(metric) or {}).get("spread")) is not None]
    ranges = [(len(v), rr) for v in launches_by_config(study, metric).values() if (rr := relative_range(v)) is not None]
    between = statistics.median(r for _, r in ranges) if ranges else None
    return Noise(
        metric,
        statistics.median(within) if within else None,
        between,
        max((r for _, r in ranges), default=None),
        len(ranges),
        sum(n for n, _ in ranges),
    )


def fastest_baseline(study: "optuna.Study", metric: str | None = None) -> records.Baseline | None:
    """The measured baseline with the highest ``metric`` (the objective's): the one the finish
    re-launches beside the leaders, so the headline's ratio compares launches with launches."""
    metric = metric or objective_metric(study)
    measured = [
        b for b in records.baselines(study).values() if not b.failed and b.config and b.median(metric) is not None
    ]
    return max(measured, key=lambda b: b.median(metric) or 0.0, default=None)
