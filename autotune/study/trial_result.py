"""One trial's outcome as a value, and the one place that stores it.

The trial's flow (study/trial_phase.py) fills a ``TrialResult``: the ``TrialRecord`` fields it
learns, its constraints, how it ends. It never writes the storage itself: ``commit`` does, at a
few checkpoints, and nothing is read back from the storage in between.

- started: the configuration, its key and the worker, before the claim (another worker that
  meets the claim reads them);
- before each step that can take minutes or crash the process (making weights, measuring
  quality, launching the engine): what is known so far, so that a crash keeps it;
- finished: the rest, then the constraints and the tell (the sampler reads a finished trial's
  constraints, so they are set before it finishes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import optuna

from autotune.study import optuna_internals, records
from autotune.study.records import TrialState


@dataclass
class TrialResult:
    """What one trial learnt and how it ended. ``state`` is what the runner reports (an answer
    reports the earlier trial's state); ``ends`` is what Optuna is told (None: still running)."""

    state: str = "RUNNING"
    config: dict[str, Any] = field(default_factory=dict)
    values: list[float] | None = None
    reason: str | None = None
    answered_from: int | None = None
    failed_in: str | None = None  # the scope whose failure this is (study/systematic.py)
    worked: tuple[str, ...] = ()  # the scopes that did their part
    broken: tuple[str, ...] = ()  # the constraints a measured trial broke (its line says so)
    fields: dict[str, Any] = field(default_factory=dict)  # TrialRecord fields learnt
    constraints: dict[str, float] = field(default_factory=dict)
    ends: TrialState | None = None
    _stored: dict[str, Any] = field(default_factory=dict, repr=False)  # what ``commit`` wrote
    _told: bool = field(default=False, repr=False)

    def learn(self, **fields: Any) -> "TrialResult":
        """Record fields of ``TrialRecord`` (refused: any other name)."""
        unknown = sorted(set(fields) - set(records.STORED))
        if unknown:
            raise KeyError(f"{unknown[0]!r} is not a TrialRecord field")
        self.fields.update(fields)
        return self

    def pruned(self, reason: str, constraints: dict[str, float] | None = None, **fields: Any) -> "TrialResult":
        self.learn(prune_reason=reason, **fields)
        self.constraints.update(constraints or {})
        self.state, self.reason, self.ends = "PRUNED", reason, TrialState.PRUNED
        return self

    def failed(self, reason: str, log_tail: str | None = None, **fields: Any) -> "TrialResult":
        self.learn(fail_reason=reason, **({"log_tail": log_tail[-4000:]} if log_tail else {}), **fields)
        self.state, self.reason, self.ends = "FAIL", reason, TrialState.FAIL
        return self

    def completed(self, values: list[float], constraints: dict[str, float]) -> "TrialResult":
        self.constraints.update(constraints)
        self.state, self.values, self.ends = "COMPLETE", list(values), TrialState.COMPLETE
        return self

    @property
    def told(self) -> bool:
        return self._told

    def pending(self) -> dict[str, Any]:
        """The fields learnt since the last commit with another value than it stored (the
        prediction judged again after the weights are made is mostly the same: not rewritten)."""
        return {k: v for k, v in self.fields.items() if k not in self._stored or self._stored[k] != v}


def commit(study: optuna.Study, trial: optuna.Trial, result: TrialResult) -> None:
    """Store what ``result`` learnt since its last commit; once it has ended, its constraints
    and the tell too (once). One transaction on an RDB storage (``optuna_internals.write_trial``),
    else Optuna's public calls (``records.store``, ``set_constraint``); then ``Study.tell``.

    Raises:
        optuna.exceptions.UpdateFinishedTrialError: the trial was finished already.
    """
    ending = result.ends is not None and not result._told
    new = result.pending()
    constraints = result.constraints if ending else {}
    if not optuna_internals.write_trial(trial, records.attributes(new), constraints):
        # Optuna's own calls: another storage, or what write_trial leaves to them. The
        # constraints first: each set_constraint reads the whole trial back.
        for key, value in constraints.items():
            trial.set_constraint(key, value)
        records.store(trial, new)
    result._stored.update(new)
    if not ending:
        return
    if result.ends == TrialState.COMPLETE:
        study.tell(trial, result.values)
    else:
        study.tell(trial, state=result.ends)
    result._told = True
