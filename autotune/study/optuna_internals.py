"""Every use of Optuna's private API in autotune, in one module, for the Optuna it was written for.

autotune otherwise reads and writes studies through Optuna's and optuna-dashboard's public
calls. What is here has no public form: the storage and ids behind a study or trial (the claims
table and the heartbeat query key rows by them), the RDB heartbeat (``optimize`` beats it;
autotune's ask/tell loop beats it itself), writing a trial this worker does not hold (a dead
worker's), the trials a sampler sees while a trial is sampled, TPE's fit kept across the
proposals of one trial, and a trial's checkpoint written in one transaction (``write_trial``:
Optuna's public calls take one each, measured there). ``OPTUNA_VERSION`` is the release this was checked against:
tests/test_optuna_internals.py fails when the installed Optuna is another, so an upgrade starts
here.
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import threading
from typing import Any, Iterator

import optuna
import sqlalchemy
import sqlalchemy.exc
from optuna.distributions import BaseDistribution
from optuna.storages._heartbeat import is_heartbeat_enabled  # RDBStorage's heartbeat, used by optimize()
from optuna.trial import FrozenTrial

OPTUNA_VERSION = "5.1.0"
HEARTBEAT_INTERVAL_S = 20
HEARTBEAT_GRACE_S = 60


def storage_of(study: optuna.Study) -> optuna.storages.BaseStorage:
    return study._storage


def study_id_of(study: optuna.Study) -> int:
    return study._study_id


def trial_id_of(trial: optuna.Trial | optuna.trial.FrozenTrial) -> int:
    return trial._trial_id


def sql_engine(study: optuna.Study) -> sqlalchemy.engine.Engine | None:
    """The SQLAlchemy engine under a study's storage (None for journal files)."""
    storage = study._storage
    backend = getattr(storage, "_backend", storage)  # a study wraps its RDBStorage in a cache
    return getattr(backend, "engine", None)


def set_finished_attrs(
    study: optuna.Study,
    trial: optuna.trial.FrozenTrial,
    attrs: dict[str, Any],
    state: optuna.trial.TrialState | None = None,
) -> bool:
    """Write attributes (and a state) of a trial this worker does not hold; False when another
    worker finished it first."""
    try:
        for key, value in attrs.items():
            study._storage.set_trial_user_attr(trial._trial_id, key, value)
        if state is not None:
            study._storage.set_trial_state_values(trial._trial_id, state)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    return True


def heartbeat_ages(study: optuna.Study) -> dict[int, float]:
    """Seconds since the last heartbeat of each RUNNING trial that has one, by trial id, at the
    database's clock (as Optuna's own stale check reads it: the workers' clocks may differ);
    empty for a storage without heartbeats."""
    from optuna.storages._rdb import models

    engine = sql_engine(study)
    if engine is None or not is_heartbeat_enabled(study._storage):
        return {}
    beats = models.TrialHeartbeatModel
    with engine.connect() as conn:
        now = conn.execute(sqlalchemy.select(sqlalchemy.func.now())).scalar()
        rows = conn.execute(
            sqlalchemy.select(beats.trial_id, beats.heartbeat)
            .join(models.TrialModel, models.TrialModel.trial_id == beats.trial_id)
            .where(
                models.TrialModel.study_id == study._study_id,
                models.TrialModel.state == optuna.trial.TrialState.RUNNING,
            )
        ).all()
    now = now.replace(tzinfo=None)
    return {int(trial_id): max((now - beat.replace(tzinfo=None)).total_seconds(), 0.0) for trial_id, beat in rows}


def frozen(study: optuna.Study, trial_id: int) -> optuna.trial.FrozenTrial:
    return study._storage.get_trial(trial_id)


def trial_snapshot(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's trials as Optuna's samplers read them while a trial is sampled: read once per
    trial, by the first reader after ``Study.ask`` (which empties that cache), and kept until the
    next ask. Read only."""
    return study._get_trials(deepcopy=False, use_cache=True)


class Heartbeat:
    """Records the running trial's heartbeat so another worker can fail it if we die."""

    def __init__(self, study: optuna.Study):
        self.storage = study._storage
        self.trial_id: int | None = None
        self.stop = threading.Event()
        self.enabled = is_heartbeat_enabled(self.storage)
        if self.enabled:
            threading.Thread(target=self._loop, daemon=True, name="autotune-heartbeat").start()

    def _loop(self) -> None:
        while not self.stop.wait(HEARTBEAT_INTERVAL_S / 2):
            trial_id = self.trial_id
            if trial_id is not None:
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception:  # a missed beat only risks a spurious stale mark later
                    pass

    def beat(self, trial: optuna.Trial | None) -> None:
        self.trial_id = None if trial is None else trial._trial_id
        if self.enabled and self.trial_id is not None:
            self.storage.record_heartbeat(self.trial_id)

    def close(self) -> None:
        self.beat(None)
        self.stop.set()


class FitOnceTPESampler(optuna.samplers.TPESampler):
    """Optuna's TPE that, inside ``fitting_once()``, fits its two Parzen estimators once per
    search space (a group of ``group=True``) and draws every later proposal from that fit.

    TPE fits from the finished trials of the study's snapshot, which ``Study.ask`` takes once per
    trial (``use_cache``): every proposal asked for one trial is fitted on the same trials, and
    refitting them is the same fit again. Fitting draws nothing from the random state, so the
    proposals, and their order, are those of ``TPESampler`` with the same arguments, one for one
    (tests/test_sampling.py holds them side by side). Outside ``fitting_once()``, and with
    ``constant_liar`` (whose fit counts running trials, which change between tries), it is
    ``TPESampler`` unchanged.

    Built on two of TPESampler's internals (``_sample``, ``_build_parzen_estimator``) of
    Optuna 5 (``OPTUNA_VERSION``).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._fits: dict[tuple[Any, ...], tuple[Any, Any]] | None = None
        self._built: list[Any] | None = None

    @contextlib.contextmanager
    def fitting_once(self) -> Iterator[None]:
        """Proposals asked inside share one fit per search space (one trial's, not a study's)."""
        self._fits = {}
        try:
            yield
        finally:
            self._fits = None

    def _build_parzen_estimator(self, *args: Any, **kwargs: Any) -> Any:
        estimator = super()._build_parzen_estimator(*args, **kwargs)
        if self._built is not None:
            self._built.append(estimator)
        return estimator

    def _sample(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if self._fits is None or self._constant_liar:
            return super()._sample(study, trial, search_space)
        key = tuple(search_space.items())
        fit = self._fits.get(key)
        if fit is None:  # the first proposal: TPE's own, keeping the estimators it fits
            self._built = []
            try:
                proposal = super()._sample(study, trial, search_space)
            finally:
                built, self._built = self._built, None
            if len(built) == 2:  # below, above
                self._fits[key] = (built[0], built[1])
            return proposal
        below, above = fit  # what TPESampler._sample does after its fit
        samples = below.sample(self._rng.rng, self._n_ei_candidates)
        proposal = self._compare(samples, self._compute_acquisition_func(samples, below, above))
        for name, distribution in search_space.items():
            proposal[name] = distribution.to_external_repr(proposal[name])
        return proposal


# ------------------------------------------------------------------ a trial's checkpoint in one transaction


def write_trial(trial: optuna.Trial, attrs: dict[str, Any], constraints: dict[str, float]) -> bool:
    """Write user attributes of a running trial and its constraints (as ``set_constraint``
    stores them) in one transaction, where the storage is an RDB one; False, with nothing
    written, where the caller must take Optuna's public calls: another storage (journal, in
    memory), fewer than two values, a constraint already set (Optuna warns of it), a value
    ``set_constraint`` would refuse, or a database without an upsert.

    Why: each public ``set_user_attr`` is a transaction with a query of the trial's state, and
    each ``set_constraint`` reads the whole trial back first; on the default study (2-core dev
    VM, loaded) that made the study's CPU time 6.1 -> 9.2 s with notes, 8.1 s without, and its
    wall time twice as long.

    Raises:
        optuna.exceptions.UpdateFinishedTrialError: the trial is finished (nothing is written).
    """
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session
    from optuna.study._constrained_optimization import _CONSTRAINTS_KEY

    store = trial.storage
    backend = getattr(store, "_backend", store)  # a study wraps its RDBStorage in a cache
    if not isinstance(backend, optuna.storages.RDBStorage) or len(attrs) + len(constraints) < 2:
        return False
    keyed = {f"{_CONSTRAINTS_KEY}:{k}": v for k, v in constraints.items()}
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) for v in keyed.values()):
        return False
    cached = trial._cached_frozen_trial
    if any(k in cached.system_attrs for k in keyed):
        return False
    parts = [(models.TrialUserAttributeModel, attrs), (models.TrialSystemAttributeModel, keyed)]
    upserts = [(_upsert(model.__table__, backend.engine.name), model, values) for model, values in parts if values]
    if any(upsert is None for upsert, _, _ in upserts):
        return False
    trial_id = trial._trial_id
    try:
        with _create_scoped_session(backend.scoped_session) as session:
            state = models.TrialModel.find_or_raise_by_id(trial_id, session).state
            backend.check_trial_is_updatable(trial_id, state)
            for upsert, _, values in upserts:
                session.connection().execute(
                    upsert, [{"trial_id": trial_id, "key": k, "value_json": json.dumps(v)} for k, v in values.items()]
                )
    except sqlalchemy.exc.IntegrityError:
        return False
    cached.user_attrs.update(attrs)  # as set_user_attr and set_constraint keep the running trial's copy
    cached.system_attrs.update({k: float(v) for k, v in keyed.items()})
    return True


def _upsert(table: sqlalchemy.Table, dialect: str) -> Any:
    """An insert-or-replace of a trial's attributes (trial_id, key, value_json) in this dialect,
    as Optuna's RDB storage writes one; None where Optuna has none either."""
    if dialect == "sqlite" and sqlite3.sqlite_version_info >= (3, 24, 0) or dialect == "postgresql":
        from sqlalchemy.dialects import postgresql, sqlite

        stmt = (sqlite if dialect == "sqlite" else postgresql).insert(table)
        return stmt.on_conflict_do_update(
            index_elements=[table.c.trial_id, table.c.key], set_={"value_json": stmt.excluded.value_json}
        )
    if dialect == "mysql":
        from sqlalchemy.dialects import mysql

        my = mysql.insert(table)
        return my.on_duplicate_key_update(value_json=my.inserted.value_json)
    return None
