"""Multi-fidelity: a launch's first run is a probe, and a probe far below the leader ends it.

A measurement repeats runs until their spread settles (``[measure]``); most configurations of a
study are not close to the best, and their first run already says so. With ``[study]
probe_margin = m`` the runner hands each launch a probe (``StudyContext.probe``): the first run's
figures are scored by the study's objective, reported to Optuna as the trial's intermediate value
(step 0), and Optuna's pruner interface decides, through :class:`LeaderGapPruner`, whether the
launch goes on. A stopped launch is recorded as PRUNED with its probe figures and the reason;
it is never launched again, and it cannot win (one run is not a measurement to crown).

The margin must be wider than the noise between runs of one configuration, or the best could be
stopped by a low first run: on the H200 grids (bench/results/h200_grids) the between-run spread
had a median of 2.5-3.5% and a worst case of 9-24%, hence a default suggestion of 0.15.

The server is not reused across launches: every knob of a study (weights, ctx, cache type,
flash-attn, slots) changes the engine's command line, so no two configurations share a server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import optuna
from optuna.pruners import BasePruner
from optuna.trial import FrozenTrial, TrialState

from autotune.study import objective as objective_mod
from autotune.study import records

if TYPE_CHECKING:  # pragma: no cover
    from autotune.config import Objective

PROBE_STEP = 0


class LeaderGapPruner(BasePruner):
    """Prunes a trial whose probe is below ``(1 - margin)`` times the best complete value.

    Optuna's own pruners compare intermediate values with each other's percentiles or halve
    the field; a tuner looking for the single best wants "clearly behind the leader" instead,
    and nothing pruned before a first trial has finished.
    """

    def __init__(self, margin: float):
        if not 0 < margin < 1:
            raise ValueError(f"margin must be between 0 and 1, not {margin}")
        self.margin = margin

    def leader(self, study: optuna.Study) -> float | None:
        values = [
            t.values[0]
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.values
            and (records.field_of(t.user_attrs, "score") or {}).get("feasible", True)
            and t.user_attrs.get("answered_from") is None
        ]
        return max(values) if values else None

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        probe = trial.intermediate_values.get(PROBE_STEP)
        if probe is None:
            return False
        leader = self.leader(study)
        if leader is None:
            return False
        return probe < (1 - self.margin) * leader


def make_probe(
    trial: optuna.Trial,
    objective: "Objective",
    used_bytes: int,
    budget_bytes: int,
    drop: float | None,
    margin: float,
    heard: dict[str, str],
) -> Callable[[Mapping[str, float]], bool]:
    """The probe of one launch: scores the first run, reports it, asks the study's pruner.

    ``heard`` receives the reason when the probe stops the launch (for the trial's record).
    """

    def probe(first_run: Mapping[str, float]) -> bool:
        metric = first_run.get(objective.metric)
        if metric is None:
            return True  # nothing to judge by: measure in full
        per_user = first_run.get("per_user_tok_s")
        s = objective_mod.score(objective, metric, used_bytes, budget_bytes, drop, per_user)
        trial.report(s.values[0], PROBE_STEP)
        floor = objective.min_per_user_tok_s
        if floor is not None and per_user is not None and per_user < (1 - margin) * floor:
            heard["reason"] = (
                f"probe: per-user {per_user:.1f} tok/s in the first run, more than "
                f"{margin:.0%} below the floor of {floor:g}"
            )
            return False
        if trial.should_prune():
            pruner = trial.study.pruner
            leader = pruner.leader(trial.study) if isinstance(pruner, LeaderGapPruner) else None
            heard["reason"] = (
                f"probe: {s.values[0]:.1f} in the first run, more than {margin:.0%} below the leader's {leader:.1f}"
                if leader is not None
                else "probe: pruned"
            )
            return False
        return True

    return probe
