"""A study-wide trial budget that holds with any number of workers: the count of the study's
trials and the creation of a new one happen under one lock (advisory on PostgreSQL, a file lock
beside an SQLite database).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy as sa
from optuna.trial import FrozenTrial

_STARTED = sa.text("SELECT count(*) FROM trials WHERE study_id = :id AND state != 'WAITING'")
_RETRIES = sa.text(
    "SELECT count(*) FROM trial_system_attributes a JOIN trials t ON t.trial_id = a.trial_id "
    "WHERE t.study_id = :id AND a.key = 'failed_trial'"
)


class TrialBudgetSpent(Exception):
    """The study already holds its budget of trials; this worker should stop."""


class BudgetedRDBStorage(optuna.storages.RDBStorage):
    """RDBStorage that refuses to create a trial past `trial_budget` trials of the study.

    Enqueued (WAITING) trials run within the budget and do not count until they start; trials
    created from a template (enqueue, retries of a dead worker's trial) are not refused here."""

    trial_budget: int | None = None

    # Optuna's caching layer calls _create_new_trial directly, so the check lives here.
    def _create_new_trial(
        self, study_id: int, template_trial: FrozenTrial | None = None
    ) -> FrozenTrial:
        if self.trial_budget is None or template_trial is not None:
            return super()._create_new_trial(study_id, template_trial)
        with self._budget_lock(study_id):
            if self._started_trials(study_id) >= self.trial_budget:
                raise TrialBudgetSpent(f"the study holds its budget of {self.trial_budget} trials")
            return super()._create_new_trial(study_id, template_trial)

    def _started_trials(self, study_id: int) -> int:
        """Started trials, less the failed ones that a retry replaces (each retry carries the
        `failed_trial` system attribute), so that retries of dead workers' trials fit."""
        with self.engine.connect() as conn:
            return int(conn.execute(_STARTED, {"id": study_id}).scalar_one()) - int(
                conn.execute(_RETRIES, {"id": study_id}).scalar_one()
            )

    @contextlib.contextmanager
    def _budget_lock(self, study_id: int) -> Iterator[None]:
        if self.engine.dialect.name == "postgresql":
            with advisory_lock(self.engine, f"hpo-budget-{study_id}"):
                yield
            return
        database = self.engine.url.database
        with file_lock(Path(f"{database}.hpo-lock")):
            yield


@contextlib.contextmanager
def advisory_lock(engine: Any, name: str) -> Iterator[None]:
    """A PostgreSQL session lock named by `name`, held on its own connection."""
    lock_id = int(hashlib.sha256(name.encode()).hexdigest()[:15], 16)
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": lock_id})
        try:
            yield
        finally:
            conn.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": lock_id})
            conn.commit()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes on one host (SQLite studies live on one host)."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
