"""Atomic claims on configurations, so that two workers never measure the same one.

Checking the storage for a configuration and then launching it is a race between workers
sharing a study. A claim is a row keyed by (study, configuration) in a table of our own
beside Optuna's, in the same database: inserting it succeeds for exactly one trial. A claim
whose trial was interrupted or whose worker died is taken over with a compare-and-swap
update, so the configuration is measured again by exactly one trial.

Whether a claim's worker still lives is one rule for every host (``holder``): the claiming
trial records its worker's host and pid before it claims (``worker``, "host:pid"); on this
host a pid that no longer exists is dead at once, and on any host a heartbeat older than
``storage.HEARTBEAT_GRACE_S`` is (a pid means nothing on another host, and on this one a pid
can be reused).
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from typing import Any

import optuna
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from autotune.study import records, storage

_METADATA = sa.MetaData()
CLAIMS = sa.Table(
    "autotune_config_claims",
    _METADATA,
    sa.Column("study_id", sa.Integer, primary_key=True),
    sa.Column("config_hash", sa.String(40), primary_key=True),
    sa.Column("trial_id", sa.Integer, nullable=False),
)


class Claims:
    """Claims of one study. Storages without SQL (journal files) fall back to no claims."""

    def __init__(self, engine: sa.engine.Engine | None, study_id: int):
        self.study_id = study_id
        self.engine = engine
        if self.engine is not None:
            for attempt in range(5):
                try:
                    _METADATA.create_all(self.engine, checkfirst=True)
                    break
                except (IntegrityError, ProgrammingError, OperationalError):
                    if attempt == 4:  # another worker was creating it at the same moment
                        raise

    @staticmethod
    def _hash(key: str) -> str:
        return hashlib.sha1(key.encode()).hexdigest()

    def claim(self, key: str, trial_id: int) -> int | None:
        """Claim ``key`` for ``trial_id``; returns None when claimed, else the holder's trial id."""
        if self.engine is None:
            return None
        h = self._hash(key)
        try:
            with self.engine.begin() as conn:
                conn.execute(CLAIMS.insert().values(study_id=self.study_id, config_hash=h, trial_id=trial_id))
            return None
        except IntegrityError:
            with self.engine.begin() as conn:
                row = conn.execute(
                    sa.select(CLAIMS.c.trial_id).where(CLAIMS.c.study_id == self.study_id, CLAIMS.c.config_hash == h)
                ).first()
            return None if row is None else int(row[0])

    def take_over(self, key: str, holder_trial_id: int, trial_id: int) -> bool:
        """Move the claim from a trial that will never finish it; True when this trial got it."""
        if self.engine is None:
            return True
        with self.engine.begin() as conn:
            result = conn.execute(
                CLAIMS.update()
                .where(
                    CLAIMS.c.study_id == self.study_id,
                    CLAIMS.c.config_hash == self._hash(key),
                    CLAIMS.c.trial_id == holder_trial_id,
                )
                .values(trial_id=trial_id)
            )
        return result.rowcount == 1

    def release(self, key: str, holder_id: int) -> None:
        """Give up ``key`` held by ``holder_id`` (its work was interrupted before anything was stored)."""
        if self.engine is None:
            return
        with self.engine.begin() as conn:
            conn.execute(
                CLAIMS.delete().where(
                    CLAIMS.c.study_id == self.study_id,
                    CLAIMS.c.config_hash == self._hash(key),
                    CLAIMS.c.trial_id == holder_id,
                )
            )


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """The worker measuring a RUNNING trial, and whether it still lives (``holder``)."""

    number: int
    worker: str
    host: str
    pid: int | None
    heartbeat_age_s: float | None
    limit_s: float
    dead_because: str | None  # None: alive

    @property
    def alive(self) -> bool:
        return self.dead_because is None

    def describe(self) -> str:
        """``host X (pid N, last heartbeat 12 s ago)``, and why it is dead where it is."""
        beat = (
            "no heartbeat yet" if self.heartbeat_age_s is None else f"last heartbeat {self.heartbeat_age_s:.0f} s ago"
        )
        why = "" if self.dead_because is None else f", {self.dead_because}"
        return f"host {self.host or '?'} (pid {'?' if self.pid is None else self.pid}, {beat}{why})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "host": self.host,
            "pid": self.pid,
            "heartbeat_age_s": self.heartbeat_age_s,
            "heartbeat_limit_s": self.limit_s,
            "alive": self.alive,
            "text": self.describe(),
        }


def holder(
    number: int, worker: str | None, heartbeat_age_s: float | None, limit_s: float, here: str | None = None
) -> Holder:
    """The liveness of the worker ``worker`` ("host:pid") holding trial ``number``, whose last
    heartbeat is ``heartbeat_age_s`` old (None: none recorded, or a storage without heartbeats:
    alive, as far as anyone can tell). Dead: on this host (``here``) its pid is gone; on any
    host its heartbeat is older than ``limit_s``."""
    host, _, pid_text = str(worker or "").rpartition(":")
    pid = int(pid_text) if pid_text.isdigit() else None
    dead = None
    if host == (socket.gethostname() if here is None else here) and pid is not None and not process_alive(pid):
        dead = "its process is gone"
    elif heartbeat_age_s is not None and heartbeat_age_s > limit_s:
        dead = f"over the {limit_s:g} s limit"
    return Holder(number, str(worker or ""), host, pid, heartbeat_age_s, limit_s, dead)


def running_holders(study: optuna.Study) -> list[tuple[optuna.trial.FrozenTrial, Holder]]:
    """Each RUNNING trial of ``study`` with its worker's liveness (``holder``), by the rule and
    limit of this module, at the database's clock."""
    ages = storage.heartbeat_ages(study)
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    return [
        (
            t,
            holder(
                t.number,
                records.field_of(t.user_attrs, "worker"),
                ages.get(storage.trial_id_of(t)),
                storage.HEARTBEAT_GRACE_S,
            ),
        )
        for t in running
    ]
