"""Heartbeats of running trials, in hpo's own table: a worker beats for its trial while it runs;
a trial whose beats stopped (worker killed, host lost, process paused) is stale, and another
worker fails it and queues it again. Ages are measured on the database's clock, so hosts whose
clocks disagree still agree on who is stale.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from types import TracebackType

import sqlalchemy as sa
from optuna.trial import FrozenTrial
from sqlalchemy.engine import Engine

from hpo.storage.errors import StorageError
from hpo.storage.tables import ensure_tables, heartbeats

log = logging.getLogger(__name__)

# Hosts' clocks disagree a little: a trial's start time is written with its worker's clock.
CLOCK_SKEW_S = 60


@dataclass(frozen=True)
class StaleTrial:
    number: int
    worker: str
    silent_s: float  # seconds since its last beat (or since it started, if it never beat)

    def reason(self, grace_s: float) -> str:
        return (
            f"stale: no heartbeat from its worker {self.worker} for {self.silent_s:.0f} s "
            f"(grace period {grace_s:.0f} s); the worker died, hung or was paused"
        )


@dataclass(frozen=True)
class LastBeat:
    worker: str
    beat_at: datetime  # on the database's clock: a later beat changes it
    silent_s: float  # seconds since


class Heartbeats:
    """The heartbeat rows of one study."""

    def __init__(self, engine: Engine, study_id: int) -> None:
        self.engine = engine
        self.study_id = study_id
        ensure_tables(engine)

    def start(self, number: int, worker: str) -> None:
        """The first beat of a trial this worker now runs."""
        with self.engine.begin() as conn:  # trial numbers are never reused: a plain insert
            conn.execute(
                heartbeats.insert().values(
                    study_id=self.study_id,
                    number=number,
                    worker=worker,
                    beat_at=sa.func.current_timestamp(),
                )
            )

    def beat(self, number: int, worker: str) -> bool:
        """False once the trial is no longer this worker's: another worker took it over."""
        update = (
            heartbeats.update()
            .where(self._row(number), heartbeats.c.worker == worker)
            .values(beat_at=sa.func.current_timestamp())
        )
        with self.engine.begin() as conn:
            return conn.execute(update).rowcount > 0

    def forget(self, number: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(heartbeats.delete().where(self._row(number)))

    def last_beats(self, numbers: list[int]) -> dict[int, LastBeat]:
        """The last beat of each of these trials that has a heartbeat row."""
        if not numbers:
            return {}
        columns = (heartbeats.c.number, heartbeats.c.worker, heartbeats.c.beat_at)
        query = sa.select(*columns, sa.func.current_timestamp()).where(
            heartbeats.c.study_id == self.study_id, heartbeats.c.number.in_(numbers)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return {
            number: LastBeat(worker, beat_at, (_utc(now) - _utc(beat_at)).total_seconds())
            for number, worker, beat_at, now in rows
        }

    def stale(self, running: list[FrozenTrial], grace_s: float) -> list[StaleTrial]:
        """The running trials whose last beat is older than `grace_s`, and those that never
        beat at all (a worker lost between creating a trial and its first beat) once they are
        twice as old, with room for clock skew."""
        if not running:
            return []
        numbers = [t.number for t in running]
        columns = (heartbeats.c.number, heartbeats.c.worker, heartbeats.c.beat_at)
        query = sa.select(*columns, sa.func.current_timestamp()).where(
            heartbeats.c.study_id == self.study_id, heartbeats.c.number.in_(numbers)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        found: list[StaleTrial] = []
        for number, worker, beat_at, now in rows:
            silent_s = (_utc(now) - _utc(beat_at)).total_seconds()
            if silent_s > grace_s:
                found.append(StaleTrial(number, worker, silent_s))
        beating = {row[0] for row in rows}
        local_now = datetime.now(timezone.utc)
        for trial in running:
            if trial.number in beating or trial.datetime_start is None:
                continue
            # Optuna hands a trial's start out as naive local time (it stores UTC).
            age_s = (local_now - trial.datetime_start.astimezone(timezone.utc)).total_seconds()
            if age_s > 2 * grace_s + CLOCK_SKEW_S:
                worker = str(trial.user_attrs.get("worker", "unknown"))
                found.append(StaleTrial(trial.number, worker, age_s))
        return found

    def _row(self, number: int) -> sa.ColumnElement[bool]:
        return sa.and_(heartbeats.c.study_id == self.study_id, heartbeats.c.number == number)


def silences(engine: Engine, study_id: int) -> dict[int, float]:
    """Seconds since each beating trial's last beat (trial number -> seconds), read only: an
    empty answer where no worker has created hpo's table yet."""
    if not sa.inspect(engine).has_table(heartbeats.name):
        return {}
    query = sa.select(heartbeats.c.number, heartbeats.c.beat_at, sa.func.current_timestamp())
    with engine.connect() as conn:
        rows = conn.execute(query.where(heartbeats.c.study_id == study_id)).all()
    return {number: (_utc(now) - _utc(beat_at)).total_seconds() for number, beat_at, now in rows}


class HeartbeatThread:
    """Beats for one trial every `interval_s` while the trial runs; `lost` is set when the
    trial was taken over by another worker. A database outage only delays beats."""

    def __init__(self, beats: Heartbeats, number: int, worker: str, interval_s: float) -> None:
        self.beats, self.number, self.worker, self.interval_s = beats, number, worker, interval_s
        self.lost = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"hpo-heartbeat-{number}", daemon=True
        )

    def __enter__(self) -> HeartbeatThread:
        self._thread.start()  # the first beat was recorded with the trial (Heartbeats.start)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        self._thread.join()
        with contextlib.suppress(sa.exc.SQLAlchemyError, StorageError):
            self.beats.forget(self.number)

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            try:
                if not self.beats.beat(self.number, self.worker):
                    self.lost.set()
                    return
            except (sa.exc.SQLAlchemyError, StorageError) as e:
                log.debug("heartbeat of trial %d not recorded: %s", self.number, e)


def _utc(moment: datetime) -> datetime:
    """Aware UTC: PostgreSQL returns aware times, SQLite naive UTC ones."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc)
