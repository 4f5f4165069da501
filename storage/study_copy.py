"""A study copied from one database to another (SQLite to PostgreSQL and back): Optuna's part
through Optuna's public storage calls, hpo's own rows beside it, and never a half study.

The trials are written under a temporary name (`hpo-copy-` and a random suffix), checked
against the source, and only then renamed to the study's name, in the one transaction that also
brings the batch-size records over. A copy stopped before that rename (an error, Ctrl-C, even
SIGKILL) leaves no study of that name: at most a temporary one, deleted on the way out unless
the process was killed outright. Heartbeats are not copied: no worker runs the copy's trials.
The Optuna calls are those `optuna.copy_study` makes (a trial created from each source trial as
its template keeps every field); copy_study itself writes under the final name from the start.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy as sa
from optuna.storages import BaseStorage
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.engine import Engine, make_url

from hpo.storage.errors import StorageError
from hpo.storage.tables import batch_sizes, check_version, ensure_tables
from hpo.storage.url import StorageURL, mask_text

log = logging.getLogger(__name__)

TEMPORARY_PREFIX = "hpo-copy-"
_TEMPORARY_NAME = re.compile(rf"{TEMPORARY_PREFIX}[0-9a-f]{{12}}")

# Optuna's table of studies. Optuna has no call to rename a study: the rename that publishes a
# finished copy is this one UPDATE of its name column, in a transaction of hpo's.
_studies = sa.Table(
    "studies",
    sa.MetaData(),
    sa.Column("study_id", sa.Integer, primary_key=True),
    sa.Column("study_name", sa.String(512)),
)


class StudyNameTaken(StorageError):
    """The target database already holds a study of the copy's name."""


@dataclass(frozen=True)
class StudySnapshot:
    """A study as read once from its database: what a copy writes."""

    name: str
    directions: list[StudyDirection]
    user_attrs: dict[str, Any]
    system_attrs: dict[str, Any]
    trials: list[FrozenTrial]  # by number
    batch_sizes: list[dict[str, Any]]  # the rows of hpo_batch_sizes

    def states(self) -> dict[str, int]:
        """How many trials are in each state, by Optuna's names (COMPLETE, PRUNED...)."""
        counts: dict[str, int] = {}
        for trial in self.trials:
            counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
        return counts

    def running(self) -> list[int]:
        return [t.number for t in self.trials if t.state == TrialState.RUNNING]


def read_snapshot(source: BaseStorage, engine: Engine, study_id: int) -> StudySnapshot:
    """The study `study_id` of `source` (whose engine is `engine`), with the database's
    batch-size records; StorageError when hpo's tables there have another layout."""
    check_version(engine)  # reads only
    return StudySnapshot(
        name=source.get_study_name_from_id(study_id),
        directions=list(source.get_study_directions(study_id)),
        user_attrs=source.get_study_user_attrs(study_id),
        system_attrs=source.get_study_system_attrs(study_id),
        trials=source.get_all_trials(study_id, deepcopy=True),
        batch_sizes=_batch_size_rows(engine),
    )


def trial_fingerprint(trials: Sequence[FrozenTrial]) -> list[str]:
    """Each trial as comparable text: two studies whose fingerprints are equal hold the same
    trials (numbers, states, values, times, parameters and distributions, attributes and
    intermediate values). NaN and infinities compare equal to themselves."""
    return [json.dumps(_comparable(t), sort_keys=True, default=repr) for t in trials]


def temporary_name() -> str:
    return f"{TEMPORARY_PREFIX}{uuid.uuid4().hex[:12]}"


def unfinished_copies(names: Sequence[str]) -> list[str]:
    """The studies that copies stopped before their end left (or copies still under way)."""
    return [name for name in names if _TEMPORARY_NAME.fullmatch(name)]


def write_copy(
    target: BaseStorage,
    snapshot: StudySnapshot,
    temporary: str,
    copied: Callable[[int], None] = lambda number: None,
    last_check: Callable[[], None] = lambda: None,
) -> int:
    """The snapshot written to `target` as study `temporary`; returns its study id. Deleted
    again when anything goes wrong or the copy is interrupted, before the error goes on;
    `copied(number)` is called after each trial, `last_check()` once the copy is written and
    read back equal (an error it raises deletes the copy too)."""
    study_id = target.create_new_study(snapshot.directions, temporary)
    try:
        for key, value in snapshot.system_attrs.items():
            target.set_study_system_attr(study_id, key, value)
        for key, value in snapshot.user_attrs.items():
            target.set_study_user_attr(study_id, key, value)
        # In number order: Optuna numbers a study's trials in the order they are created, so
        # every trial keeps its number (which hpo's attributes refer to: retry_of, failed_trial).
        for trial in snapshot.trials:
            target.create_new_trial(study_id, template_trial=trial)
            copied(trial.number)
        _check_copy(snapshot, target.get_all_trials(study_id, deepcopy=False))
        last_check()
    except BaseException:
        discard(target, study_id)
        raise
    return study_id


def publish(
    target: BaseStorage,
    engine: Engine,
    study_id: int,
    temporary: str,
    name: str,
    batch_size_rows: Sequence[dict[str, Any]],
) -> None:
    """Give the written copy its name and bring the batch-size records over, in one
    transaction; StudyNameTaken (the copy deleted) when a study of that name appeared since."""
    rename = (
        _studies.update()
        .where(_studies.c.study_id == study_id, _studies.c.study_name == temporary)
        .values(study_name=name)
    )
    try:
        ensure_tables(engine)
        with engine.begin() as conn:
            if conn.execute(rename).rowcount != 1:
                raise StorageError(f"the copy {temporary!r} vanished from the target mid-copy")
            _merge_batch_sizes(conn, batch_size_rows)
    except sa.exc.IntegrityError as e:  # the unique study name: another study took it
        discard(target, study_id)
        raise StudyNameTaken(
            f"a study {name!r} appeared in the target during the copy (another copy, or a "
            "worker); nothing was copied: copy again, with --to-study NEW_NAME to keep both"
        ) from e
    except BaseException:
        discard(target, study_id)
        raise


def discard(target: BaseStorage, study_id: int) -> None:
    """Delete a copy that was not published (its temporary name is the copy's own). A database
    that fails here too (it went down) keeps the copy under its temporary name, and the error
    that stopped the copy is the one raised."""
    try:
        target.delete_study(study_id)
    except KeyError:
        pass  # never written, or deleted already
    except (sa.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
        reason = (mask_text(str(e)).strip().splitlines() or [type(e).__name__])[0]
        log.warning("the unfinished copy (study id %d) stays in the target: %s", study_id, reason)


def same_database(first: StorageURL, second: StorageURL) -> bool:
    """Whether two URLs reach the same database: the same SQLite file, or the same PostgreSQL
    host, port and database (whoever connects)."""
    a, b = make_url(first.url), make_url(second.url)
    if a.get_backend_name() != b.get_backend_name():
        return False
    if a.get_backend_name() == "sqlite":
        return Path(a.database or "").resolve() == Path(b.database or "").resolve()
    address = ("localhost", "127.0.0.1", "::1", None)

    def where(url: sa.URL) -> tuple[Any, ...]:
        host = "localhost" if url.host in address else url.host
        return host, url.port or 5432, url.database

    return where(a) == where(b)


def _check_copy(snapshot: StudySnapshot, copied: Sequence[FrozenTrial]) -> None:
    """The copy holds every trial of the snapshot, equal in every field."""
    expected, found = trial_fingerprint(snapshot.trials), trial_fingerprint(copied)
    if expected == found:
        return
    if len(expected) != len(found):
        raise StorageError(
            f"the copy holds {len(found)} trials where the source holds {len(expected)}; "
            "nothing was copied: is another program writing to the copy's temporary study?"
        )
    pairs = zip(snapshot.trials, expected, found, strict=True)
    differs = next(trial.number for trial, e, f in pairs if e != f)
    raise StorageError(
        f"trial {differs} of the copy differs from the source's, as read back; nothing was "
        "copied. A bug: please report it with both databases' kinds and the Optuna version"
    )


def _comparable(trial: FrozenTrial) -> dict[str, Any]:
    return {
        "number": trial.number,
        "state": trial.state.name,
        "values": _floats(trial.values),
        "datetime_start": trial.datetime_start,
        "datetime_complete": trial.datetime_complete,
        "params": trial.params,
        "distributions": {k: repr(d) for k, d in trial.distributions.items()},
        "user_attrs": trial.user_attrs,
        "system_attrs": trial.system_attrs,
        "intermediate_values": {
            str(step): _floats([value]) for step, value in trial.intermediate_values.items()
        },
    }


def _floats(values: Sequence[float] | None) -> list[str] | None:
    # As text: NaN is not equal to itself, but its text is.
    return None if values is None else [repr(float(v)) for v in values]


def _batch_size_rows(engine: Engine) -> list[dict[str, Any]]:
    if not sa.inspect(engine).has_table(batch_sizes.name):
        return []
    with engine.connect() as conn:
        rows = conn.execute(sa.select(batch_sizes).order_by(batch_sizes.c.key_hash)).mappings()
        return [dict(row) for row in rows]


def _merge_batch_sizes(conn: sa.Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Records the target lacks are added; where both databases searched the same key, the
    smaller size stands (the cache only ever lowers a size: a larger one ran out of memory)."""
    if not rows:
        return
    query = sa.select(batch_sizes.c.key_hash, batch_sizes.c.physical_batch_size)
    held: dict[str, int] = {key: size for key, size in conn.execute(query).all()}
    new = [row for row in rows if row["key_hash"] not in held]
    if new:
        conn.execute(batch_sizes.insert(), new)
    for row in rows:
        if row["key_hash"] in held and held[row["key_hash"]] > row["physical_batch_size"]:
            conn.execute(
                batch_sizes.update()
                .where(batch_sizes.c.key_hash == row["key_hash"])
                .values(
                    physical_batch_size=row["physical_batch_size"], updated_at=row["updated_at"]
                )
            )
