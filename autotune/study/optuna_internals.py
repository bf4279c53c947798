"""Every use of Optuna's private API in autotune, in one module, for the Optuna it was written for.

autotune otherwise reads and writes studies through Optuna's and optuna-dashboard's public
calls. What is here has no public form: the storage and ids behind a study or trial (the claims
table and the heartbeat query key rows by them), the RDB heartbeat (``optimize`` beats it;
autotune's ask/tell loop beats it itself), writing a trial this worker does not hold (a dead
worker's), the trials a sampler sees while a trial is sampled, and TPE's fit kept across the
proposals of one trial. ``OPTUNA_VERSION`` is the release this was checked against:
tests/test_optuna_internals.py fails when the installed Optuna is another, so an upgrade starts
here.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import optuna
import sqlalchemy
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


def set_finished_attrs(study: optuna.Study, trial: optuna.trial.FrozenTrial, attrs: dict[str, Any],
                       state: optuna.trial.TrialState | None = None) -> bool:
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
        rows = conn.execute(sqlalchemy.select(beats.trial_id, beats.heartbeat)
                            .join(models.TrialModel, models.TrialModel.trial_id == beats.trial_id)
                            .where(models.TrialModel.study_id == study._study_id,
                                   models.TrialModel.state == optuna.trial.TrialState.RUNNING)).all()
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

    def _sample(self, study: optuna.Study, trial: FrozenTrial,
                search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
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
