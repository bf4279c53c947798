"""Atomic claims on configurations, so that two workers never measure the same one.

Checking the storage for a configuration and then launching it is a race between workers
sharing a study. A claim is a row keyed by (study, configuration) in a table of our own
beside Optuna's, in the same database: inserting it succeeds for exactly one trial. A claim
whose trial was interrupted or whose worker died is taken over with a compare-and-swap
update, so the configuration is measured again by exactly one trial.
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

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
                .where(CLAIMS.c.study_id == self.study_id, CLAIMS.c.config_hash == self._hash(key),
                       CLAIMS.c.trial_id == holder_trial_id)
                .values(trial_id=trial_id)
            )
        return result.rowcount == 1

    def release(self, key: str, holder_id: int) -> None:
        """Give up ``key`` held by ``holder_id`` (its work was interrupted before anything was stored)."""
        if self.engine is None:
            return
        with self.engine.begin() as conn:
            conn.execute(CLAIMS.delete().where(CLAIMS.c.study_id == self.study_id,
                                               CLAIMS.c.config_hash == self._hash(key),
                                               CLAIMS.c.trial_id == holder_id))
