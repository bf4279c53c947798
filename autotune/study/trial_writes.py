"""A running trial's attributes written in one transaction: what a trial's record costs (and
a study's system attributes, where optuna-dashboard keeps each trial's note).

Optuna's RDB storage spends a transaction, a query of the trial's state and a statement built
anew on each ``set_user_attr``, and reads the whole trial back before each ``set_constraint``;
a trial's record is some 60 attributes (``records.cells``). These write them together where the
storage is an RDB one, and take Optuna's own calls everywhere else. Apart from
:mod:`autotune.study.storage` (which opens storages and studies) so that the records, which
write through these, and the storage, which opens a study with the records' header, import in
one direction.
"""

from __future__ import annotations

import json
import math
import sqlite3
from typing import Any, Callable, Mapping

import optuna
import sqlalchemy
import sqlalchemy.exc
from optuna.storages._rdb import models as _rdb_models  # a trial's record in one transaction
from optuna.storages._rdb.storage import _create_scoped_session as _rdb_session
from optuna.study._constrained_optimization import _CONSTRAINTS_KEY  # set_constraints, batched

__all__ = ["remember_user_attrs", "set_constraints", "set_user_attrs", "update_study_system_attrs", "user_attrs_of"]


def set_user_attrs(trial: optuna.Trial, attrs: Mapping[str, Any],
                   constraints: Mapping[str, float] | None = None) -> None:
    """Write user attributes of a running trial, and ``constraints`` as ``set_constraints``
    does, in one transaction, in order.

    Optuna's RDB storage spends a transaction, a query of the trial's state and a statement
    built anew on each ``set_user_attr``: a trial's record is some 60 attributes
    (records.cells), and that was a quarter of the default study's time. See ``_write_attrs``.

    Raises:
        optuna.exceptions.UpdateFinishedTrialError: the trial is finished (nothing is written).
    """
    keyed = _batchable_constraints(trial, constraints) if constraints else {}
    if constraints and keyed is None:  # Optuna's own path, with its warning or error
        set_user_attrs(trial, attrs)
        for key, value in constraints.items():
            trial.set_constraint(key, value)
        return
    if not attrs and not keyed:
        return
    parts = [(_rdb_models.TrialUserAttributeModel, attrs, False), (_rdb_models.TrialSystemAttributeModel, keyed, True)]
    if not _write_attrs(trial, [(m, a, fresh) for m, a, fresh in parts if a]):
        for key, value in attrs.items():
            trial.storage.set_trial_user_attr(trial._trial_id, key, value)
        remember_user_attrs(trial, attrs)
        for key, value in (constraints or {}).items():
            trial.set_constraint(key, value)
        return
    remember_user_attrs(trial, attrs)
    trial._cached_frozen_trial.system_attrs.update(keyed)


def remember_user_attrs(trial: optuna.Trial, attrs: Mapping[str, Any]) -> None:
    """Show ``attrs`` in the running trial's own copy of its attributes (what ``Trial.user_attrs``
    reads), as ``Trial.set_user_attr`` does, uncopied; the storage is not written."""
    trial._cached_frozen_trial.user_attrs.update(attrs)


def set_constraints(trial: optuna.Trial, constraints: Mapping[str, float]) -> None:
    """``Trial.set_constraint`` for each constraint, in one transaction: Optuna's reads the
    whole trial back from the database first, each time (9% of the default study).

    A constraint already set, or a value Optuna would refuse (not a number, NaN), takes
    Optuna's own path, with its warning or error.
    """
    set_user_attrs(trial, {}, constraints)


def _batchable_constraints(trial: optuna.Trial, constraints: Mapping[str, float]) -> dict[str, float] | None:
    """The system attributes that store ``constraints``; None where Optuna's own
    ``set_constraint`` must take them (a value it would refuse, a constraint already set)."""
    keyed = {f"{_CONSTRAINTS_KEY}:{k}": v for k, v in constraints.items()}
    plain = all(isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
                for v in constraints.values())
    if not plain or any(k in trial._cached_frozen_trial.system_attrs for k in keyed):
        return None
    return {k: float(v) for k, v in keyed.items()}


def _write_attrs(trial: optuna.Trial, parts: list[tuple[type, Mapping[str, Any], bool]]) -> bool:
    """Write attributes (a trial's user or system ones: each part's model) in one transaction
    where the storage is an RDB one; False, with nothing written, where the caller must use
    Optuna's own calls instead: another storage (journal, in-memory), one attribute, an
    integrity error (a racing writer where the database has no upsert), or, for a part marked
    fresh, a key already stored.

    On SQLite, PostgreSQL and MySQL the trial's state is checked once and each part's
    attributes upserted in one statement run over all its rows, as Optuna's own per-key upsert
    stores each (json.dumps of the value); another RDB database gets Optuna's per-key write in
    one session.

    Raises:
        optuna.exceptions.UpdateFinishedTrialError: the trial is finished.
    """
    store = trial.storage
    backend = getattr(store, "_backend", store)  # a study wraps its RDBStorage in a cache
    trial_id = trial._trial_id
    if not isinstance(backend, optuna.storages.RDBStorage) or sum(len(a) for _, a, _ in parts) < 2:
        return False
    try:
        with _rdb_session(backend.scoped_session) as session:
            state = _rdb_models.TrialModel.find_or_raise_by_id(trial_id, session).state
            backend.check_trial_is_updatable(trial_id, state)
            for model, attrs, fresh in parts:  # every check before any write
                stored = session.query(model.key).filter(model.trial_id == trial_id, model.key.in_(list(attrs)))
                if fresh and stored.first() is not None:
                    return False
            for model, attrs, _ in parts:
                upsert = _upsert(model.__table__, backend.engine.name, "trial_id")
                if upsert is not None:
                    rows = [{"trial_id": trial_id, "key": k, "value_json": json.dumps(v)} for k, v in attrs.items()]
                    session.connection().execute(upsert, rows)
                else:
                    for key, value in attrs.items():
                        backend._set_trial_attr_without_commit(session, model, trial_id, key, value)
    except sqlalchemy.exc.IntegrityError:
        return False
    return True


def update_study_system_attrs(study: optuna.Study, prefix: str,
                              update: Callable[[dict[str, Any]], Mapping[str, Any]]) -> bool:
    """Read the study's system attributes whose keys start with ``prefix``, and write what
    ``update`` makes of them, in one transaction where the storage is an RDB one; False, with
    nothing written, elsewhere (journal, in-memory), where the caller uses Optuna's own calls.

    Optuna's ``set_study_system_attr`` is a transaction per key, and its reader,
    ``get_study_system_attrs``, reads every key of the study: optuna-dashboard's ``save_note``
    read them all twice per trial (a note per trial: a read that grows with the study).
    """
    backend = getattr(study._storage, "_backend", study._storage)
    if not isinstance(backend, optuna.storages.RDBStorage):
        return False
    model = _rdb_models.StudySystemAttributeModel
    study_id = study._study_id
    with _rdb_session(backend.scoped_session) as session:
        _rdb_models.StudyModel.find_or_raise_by_id(study_id, session)
        rows = session.query(model.key, model.value_json).filter(
            model.study_id == study_id, model.key.startswith(prefix, autoescape=True))
        # LIKE ignores case on SQLite: the prefix is checked again here.
        attrs = update({key: json.loads(value) for key, value in rows if key.startswith(prefix)})
        if not attrs:
            return True
        upsert = _upsert(model.__table__, backend.engine.name, "study_id")
        if upsert is not None:
            session.connection().execute(
                upsert, [{"study_id": study_id, "key": k, "value_json": json.dumps(v)} for k, v in attrs.items()])
            return True
    for key, value in attrs.items():  # a database without an upsert: Optuna's per-key write
        backend.set_study_system_attr(study_id, key, value)
    return True


def _upsert(table: sqlalchemy.Table, dialect: str, owner: str) -> sqlalchemy.sql.Executable | None:
    """An insert-or-replace of attributes (``owner`` (trial_id, study_id), key, value_json) in
    this dialect, as Optuna's RDB storage writes one; None where Optuna has none either."""
    if dialect == "sqlite" and sqlite3.sqlite_version_info >= (3, 24, 0) or dialect == "postgresql":
        from sqlalchemy.dialects import postgresql, sqlite

        stmt = (sqlite if dialect == "sqlite" else postgresql).insert(table)
        return stmt.on_conflict_do_update(index_elements=[table.c[owner], table.c.key],
                                          set_={"value_json": stmt.excluded.value_json})
    if dialect == "mysql":
        from sqlalchemy.dialects import mysql

        my = mysql.insert(table)
        return my.on_duplicate_key_update(value_json=my.inserted.value_json)
    return None


def user_attrs_of(trial: optuna.Trial) -> Mapping[str, Any]:
    """A running trial's user attributes, not copied (``Trial.user_attrs`` deep-copies them all
    on each read); read only."""
    return trial._cached_frozen_trial.user_attrs
