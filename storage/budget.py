"""A study-wide trial budget that holds with any number of workers: the count of the study's
trials and the creation of a new one happen under one lock (advisory on PostgreSQL, a file lock
beside an SQLite database).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy as sa
from optuna.trial import FrozenTrial, TrialState

from storage.outage import retrying

_STARTED = sa.text("SELECT count(*) FROM trials WHERE study_id = :id AND state != 'WAITING'")
_RETRIES = sa.text(
    "SELECT count(*) FROM trial_system_attributes a JOIN trials t ON t.trial_id = a.trial_id "
    "WHERE t.study_id = :id AND a.key = 'failed_trial'"
)


_SILENT = sa.text(
    "SELECT t.trial_id FROM trials t LEFT JOIN trial_heartbeats h ON h.trial_id = t.trial_id "
    "WHERE t.study_id = :id AND t.state = 'RUNNING' AND h.trial_id IS NULL "
    "AND t.datetime_start < :cutoff"
)
# Hosts' clocks disagree a little: trial start times are written with the worker's clock.
CLOCK_SKEW_S = 60


class TrialBudgetSpent(Exception):
    """The study already holds its budget of trials; this worker should stop."""


class BudgetedRDBStorage(optuna.storages.RDBStorage):
    """RDBStorage that refuses to create a trial past `trial_budget` trials of the study.

    Enqueued (WAITING) trials run within the budget and do not count until they start; trials
    created from a template (enqueue, retries of a dead worker's trial) are not refused here.
    With `patience_s`, calls ride out a database outage of up to that long (see outage.py)."""

    trial_budget: int | None = None
    patience_s: float | None = None

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        try:
            return super().set_trial_state_values(trial_id, state, values)
        except optuna.exceptions.UpdateFinishedTrialError:
            # A retry after a commit whose answer the outage lost: it is already done.
            if self.patience_s is not None and self.get_trial(trial_id).state == state:
                return True
            raise

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

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        """Optuna's stale trials, and RUNNING trials that never sent a heartbeat at all (Optuna
        skips those): a trial whose creation committed while its worker lost the connection
        would otherwise stay RUNNING forever."""
        stale = super()._get_stale_trial_ids(study_id)
        grace_s = self.grace_period or 2 * (self.heartbeat_interval or 0)
        cutoff = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(
            seconds=2 * grace_s + CLOCK_SKEW_S
        )
        with self.engine.connect() as conn:
            silent = conn.execute(_SILENT, {"id": study_id, "cutoff": cutoff}).scalars().all()
        return stale + [trial_id for trial_id in silent if trial_id not in stale]

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
        with sqlite_lock(self.engine.url.database):
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


def sqlite_lock(database: str | None) -> contextlib.AbstractContextManager[None]:
    """The one lock beside an SQLite database file under which hpo's processes take turns:
    creating tables, counting the trial budget, creating the batch-size cache."""
    return file_lock(Path(f"{database}.hpo-lock"))


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes on one host (SQLite studies live on one host)."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# Every call a worker makes on the study, public or called by Optuna's cache layer.
_RIDES_OUT_OUTAGES = (
    "create_new_study", "set_study_user_attr", "set_study_system_attr", "get_study_id_from_name",
    "get_study_name_from_id", "get_study_directions", "get_study_user_attrs",
    "get_study_system_attrs", "get_trial_user_attrs", "get_trial_system_attrs", "get_all_studies",
    "_create_new_trial", "set_trial_param", "get_trial_param", "set_trial_state_values",
    "set_trial_intermediate_value", "set_trial_user_attr", "set_trial_system_attr",
    "get_trial_id_from_study_id_trial_number", "get_trial", "_get_trials", "get_best_trial",
    "record_heartbeat", "_get_stale_trial_ids",
)  # fmt: skip


def _riding_out_outages(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: BudgetedRDBStorage, *args: Any, **kwargs: Any) -> Any:
        if self.patience_s is None:
            return method(self, *args, **kwargs)
        return retrying(lambda: method(self, *args, **kwargs), name, self.patience_s)

    return call


for _name in _RIDES_OUT_OUTAGES:
    setattr(
        BudgetedRDBStorage,
        _name,
        _riding_out_outages(_name, getattr(BudgetedRDBStorage, _name)),
    )
