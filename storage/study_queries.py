"""What hpo's commands and workers ask of a study's trials as a whole, answered by the database:
counts by state, the study-wide budget count, device-seconds, the time span, and reasons by kind.
Optuna's public API answers each of these by reading every trial of the study with all its
parameters and attributes (Optuna's own `get_n_trials` too): seconds at 20,000 trials.

These read Optuna's tables directly: the one place hpo depends on Optuna's schema. Each answer is
checked against the public API's on a study with every kind of trial in
tests/test_study_queries.py, which breaks on an upgrade that changes the schema; a database of a
schema version hpo does not know gets `None` (`supported`), and callers use the public API.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from optuna.distributions import json_to_distribution
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.engine import Engine

from hpo.storage.outage import is_transient

# Optuna's schema versions these queries were checked against (`version_info.schema_version`).
KNOWN_SCHEMA_VERSIONS = frozenset({12})

# The indexes of Optuna's schema that these queries rely on, as (table, leading columns): a
# study's trials by study id, and every per-trial table by trial id. hpo creates none of its
# own on Optuna's tables (they belong to Optuna's migrations); the test of this module checks
# that these exist on both backends. At 20,000 trials the one scan left, a study's rows of
# `trials` for counts by state, took 3 ms on PostgreSQL.
INDEXES_USED = (
    ("trials", ("study_id",)),
    ("trial_params", ("trial_id",)),
    ("trial_values", ("trial_id",)),
    ("trial_user_attributes", ("trial_id",)),
    ("trial_system_attributes", ("trial_id",)),
    ("trial_intermediate_values", ("trial_id",)),
)

_metadata = sa.MetaData()
_version_info = sa.Table("version_info", _metadata, sa.Column("schema_version", sa.Integer))
_trials = sa.Table(
    "trials",
    _metadata,
    sa.Column("trial_id", sa.Integer),
    sa.Column("number", sa.Integer),
    sa.Column("study_id", sa.Integer),
    sa.Column("state", sa.String),
    sa.Column("datetime_start", sa.DateTime),
    sa.Column("datetime_complete", sa.DateTime),
)


def _attributes(name: str) -> sa.Table:
    return sa.Table(
        name,
        _metadata,
        sa.Column("trial_id", sa.Integer),
        sa.Column("key", sa.String),
        sa.Column("value_json", sa.Text),
    )


_user_attrs = _attributes("trial_user_attributes")
_system_attrs = _attributes("trial_system_attributes")
_values = sa.Table(
    "trial_values",
    _metadata,
    sa.Column("trial_id", sa.Integer),
    sa.Column("objective", sa.Integer),
    sa.Column("value", sa.Float),
    sa.Column("value_type", sa.String),
)
_params = sa.Table(
    "trial_params",
    _metadata,
    sa.Column("trial_id", sa.Integer),
    sa.Column("param_name", sa.String),
    sa.Column("param_value", sa.Float),
    sa.Column("distribution_json", sa.Text),
)
_steps = sa.Table(
    "trial_intermediate_values",
    _metadata,
    sa.Column("trial_id", sa.Integer),
    sa.Column("step", sa.Integer),
    sa.Column("intermediate_value", sa.Float),
    sa.Column("intermediate_value_type", sa.String),
)
_INFINITE = {"INF_POS": math.inf, "INF_NEG": -math.inf}
_PARTS = ("params", "distributions", "values", "user", "system", "steps")


def _of_study(table: sa.Table) -> sa.Join:
    """`table` (of one row per trial and something) joined to its trials, to filter by study."""
    return table.join(_trials, _trials.c.trial_id == table.c.trial_id)


def supported(engine: Engine) -> bool:
    """Whether this database has a schema these queries know. A lost connection is raised, to
    be retried: taken for an unknown schema, it would turn every later read to Optuna's."""
    try:
        with engine.connect() as conn:
            version = conn.execute(sa.select(_version_info.c.schema_version)).scalar()
    except sa.exc.SQLAlchemyError as e:
        if is_transient(e):
            raise
        return False
    return version in KNOWN_SCHEMA_VERSIONS


def state_counts(engine: Engine, study_id: int) -> dict[TrialState, int]:
    query = (
        sa.select(_trials.c.state, sa.func.count())
        .where(_trials.c.study_id == study_id)
        .group_by(_trials.c.state)
    )
    with engine.connect() as conn:
        return {TrialState[state]: count for state, count in conn.execute(query)}


def system_attr_count(engine: Engine, study_id: int, key: str) -> int:
    """How many of the study's trials carry the system attribute `key`."""
    query = (
        sa.select(sa.func.count())
        .select_from(_of_study(_system_attrs))
        .where(_trials.c.study_id == study_id, _system_attrs.c.key == key)
    )
    with engine.connect() as conn:
        return int(conn.execute(query).scalar() or 0)


def user_attr_sum(
    engine: Engine, study_id: int, key: str, states: Sequence[TrialState] | None = None
) -> float:
    """The sum of a numeric user attribute over the study's trials (of `states`, if given;
    others count 0)."""
    raw = _user_attrs.c.value_json
    number: sa.ColumnElement[float]
    if engine.dialect.name == "postgresql":  # a cast of text that is not a number would fail
        number = sa.case(
            (raw.regexp_match(r"^-?[0-9.]+([eE][-+]?[0-9]+)?$"), sa.cast(raw, sa.Float)), else_=0.0
        )
    else:  # SQLite casts text that is not a number to 0
        number = sa.cast(raw, sa.Float)
    query = (
        sa.select(sa.func.sum(number))
        .select_from(_of_study(_user_attrs))
        .where(_trials.c.study_id == study_id, _user_attrs.c.key == key)
    )
    if states is not None:
        query = query.where(_trials.c.state.in_([s.name for s in states]))
    with engine.connect() as conn:
        return float(conn.execute(query).scalar() or 0.0)


def finished_span(
    engine: Engine, study_id: int, states: Sequence[TrialState] | None = None
) -> tuple[int, dt.datetime | None, dt.datetime | None]:
    """Finished trials (of `states`, if given) with an end time: how many, the first start and
    the last end among them (naive UTC, as Optuna stores them)."""
    ended = [s.name for s in (states or TrialState) if s.is_finished()]
    start, end = _trials.c.datetime_start, _trials.c.datetime_complete
    query = sa.select(sa.func.count(), sa.func.min(start), sa.func.max(end)).where(
        _trials.c.study_id == study_id, _trials.c.state.in_(ended), end.is_not(None)
    )
    with engine.connect() as conn:
        count, first, last = conn.execute(query).one()
    return int(count), _datetime(first), _datetime(last)


def spans_without(engine: Engine, study_id: int, key: str) -> list[float]:
    """Seconds from start to end of each finished trial without the user attribute `key` (a
    trial whose worker recorded no time of its own: killed, lost, or stopped before it ran)."""
    finished = [s.name for s in TrialState if s.is_finished()]
    has_key = sa.exists().where(
        _user_attrs.c.trial_id == _trials.c.trial_id, _user_attrs.c.key == key
    )
    start, end = _trials.c.datetime_start, _trials.c.datetime_complete
    query = sa.select(start, end).where(
        _trials.c.study_id == study_id,
        _trials.c.state.in_(finished),
        start.is_not(None),
        end.is_not(None),
        ~has_key,
    )
    spans = []
    with engine.connect() as conn:
        for began, ended in conn.execute(query):
            began, ended = _datetime(began), _datetime(ended)
            if began is not None and ended is not None:
                spans.append(max(0.0, (ended - began).total_seconds()))
    return spans


def latest_user_attr(engine: Engine, study_id: int, key: str) -> tuple[int, int | None, Any]:
    """How many of the study's trials have the user attribute `key`, and the latest of them:
    its number and the attribute's value (None, None when none has it)."""
    with_key = (
        sa.select(sa.func.count(), sa.func.max(_trials.c.number))
        .select_from(_of_study(_user_attrs))
        .where(_trials.c.study_id == study_id, _user_attrs.c.key == key)
    )
    with engine.connect() as conn:
        count, number = conn.execute(with_key).one()
        if not count:
            return 0, None, None
        value = conn.execute(
            sa.select(_user_attrs.c.value_json)
            .select_from(_of_study(_user_attrs))
            .where(
                _trials.c.study_id == study_id, _trials.c.number == number, _user_attrs.c.key == key
            )
        ).scalar()
    return int(count), int(number), None if value is None else json.loads(value)


def reasons(
    engine: Engine, study_id: int, state: TrialState, key: str, in_state: int
) -> dict[str, int]:
    """The `in_state` trials in `state` counted by the kind of their `key` user attribute (its
    text before the first colon), most first; grouped by the database, as reasons carry numbers
    and differ. Trials without it count as "no reason recorded"."""
    raw = _user_attrs.c.value_json
    if engine.dialect.name == "postgresql":
        kind = sa.func.split_part(raw, ":", 1)
    else:
        kind = sa.func.substr(raw, 1, sa.func.instr(raw + ":", ":") - 1)
    query = (
        sa.select(kind, sa.func.count())
        .select_from(_of_study(_user_attrs))
        .where(
            _trials.c.study_id == study_id, _trials.c.state == state.name, _user_attrs.c.key == key
        )
        .group_by(kind)
    )
    kinds: Counter[str] = Counter()
    with engine.connect() as conn:
        for text, count in conn.execute(query):
            kinds[_json_prefix(text)] += count
    without = in_state - sum(kinds.values())
    if without > 0:
        kinds["no reason recorded"] += without
    return dict(kinds.most_common())


def _json_prefix(text: str) -> str:
    """The start of a JSON value, cut at a colon, as the text it stands for."""
    for candidate in (text, text + '"'):
        try:
            return str(json.loads(candidate))
        except ValueError:
            continue
    return text.strip('"')


def complete_values(engine: Engine, study_id: int, objectives: int) -> dict[int, list[float]]:
    """Every complete trial's values (trial id -> one per objective): the Pareto front of a
    study of several objectives needs these, not the trials' parameters and attributes."""
    query = (
        sa.select(_values.c.trial_id, _values.c.objective, _values.c.value, _values.c.value_type)
        .select_from(_of_study(_values))
        .where(_trials.c.study_id == study_id, _trials.c.state == TrialState.COMPLETE.name)
    )
    found: dict[int, list[float]] = {}
    with engine.connect() as conn:
        for trial_id, objective, value, kind in conn.execute(query):
            row = found.setdefault(trial_id, [math.nan] * objectives)
            if 0 <= objective < objectives:
                row[objective] = _INFINITE.get(kind, value)
    return {k: v for k, v in found.items() if not any(math.isnan(x) for x in v)}


def best_trial_id(engine: Engine, study_id: int, maximize: bool) -> int | None:
    """The complete trial with the best first value, the earliest of equals (as
    `max(trials, ...)` over the trials in order would pick); None if none completed."""
    rank = sa.case(
        (_values.c.value_type == "INF_NEG", -1), (_values.c.value_type == "INF_POS", 1), else_=0
    )
    sign = 1 if maximize else -1
    query = (
        sa.select(_trials.c.trial_id)
        .select_from(_of_study(_values))
        .where(
            _trials.c.study_id == study_id,
            _trials.c.state == TrialState.COMPLETE.name,
            _values.c.objective == 0,
        )
        .order_by(
            (sign * rank).desc(),
            (sign * sa.func.coalesce(_values.c.value, 0)).desc(),
            _trials.c.number,
        )
        .limit(1)
    )
    with engine.connect() as conn:
        return conn.execute(query).scalar()


def size_and_start(engine: Engine, study_id: int) -> tuple[int, dt.datetime | None]:
    """How many trials the study holds, and when its first one started."""
    query = sa.select(sa.func.count(), sa.func.min(_trials.c.datetime_start)).where(
        _trials.c.study_id == study_id
    )
    with engine.connect() as conn:
        count, first = conn.execute(query).one()
    return int(count), _datetime(first)


def sample_ids(engine: Engine, study_id: int, maximize: bool, limit: int) -> list[int]:
    """At most `limit` trial ids to draw a large study from: the best quarter by the first
    value, the latest quarter, and the rest spread evenly over the study (by trial number)."""
    quarter = max(1, limit // 4)
    sign = 1 if maximize else -1
    best = (
        sa.select(_trials.c.trial_id)
        .select_from(_of_study(_values))
        .where(
            _trials.c.study_id == study_id,
            _trials.c.state == TrialState.COMPLETE.name,
            _values.c.objective == 0,
            _values.c.value_type == "FINITE",
        )
        .order_by((sign * _values.c.value).desc(), _trials.c.number)
        .limit(quarter)
    )
    latest = (
        sa.select(_trials.c.trial_id)
        .where(_trials.c.study_id == study_id)
        .order_by(_trials.c.number.desc())
        .limit(quarter)
    )
    size, _ = size_and_start(engine, study_id)
    stride = max(1, size // max(1, limit - 2 * quarter))
    spread = sa.select(_trials.c.trial_id).where(
        _trials.c.study_id == study_id, _trials.c.number % stride == 0
    )
    with engine.connect() as conn:
        ids = {row[0] for query in (best, latest, spread) for row in conn.execute(query)}
    return sorted(ids)[: limit + quarter]


def trials(
    engine: Engine, trial_ids: list[int], only_user_keys: Sequence[str] | None = None
) -> list[FrozenTrial]:
    """These trials, whole (what Optuna's `get_trial` gives for each), in a few queries; with
    `only_user_keys`, what a table of them shows: state, times, parameters, values and these
    user attributes only (no curves, no system attributes): a third of the time for a report's
    table of 1,000 trials."""
    with engine.connect() as conn:
        found = _read(conn, _trials.c.trial_id.in_(trial_ids), only_user_keys)
    return [found[i] for i in trial_ids if i in found]


def study_trials(
    engine: Engine, study_id: int, after_id: int, also: list[int]
) -> list[tuple[int, FrozenTrial]]:
    """(trial id, trial) of the study's trials with an id above `after_id` or in `also`, in
    bulk: what a cache of finished trials reads (Optuna's own reads them through its ORM, some
    ten times slower)."""
    newer = _trials.c.trial_id > after_id
    which = sa.or_(newer, _trials.c.trial_id.in_(also)) if also else newer
    with engine.connect() as conn:
        found = _read(conn, sa.and_(_trials.c.study_id == study_id, which))
    return sorted(found.items())


def _read(
    conn: sa.Connection, which: sa.ColumnElement[bool], only_user_keys: Sequence[str] | None = None
) -> dict[int, FrozenTrial]:
    """The trials `which` selects (a condition on the trials table), by trial id."""
    found: dict[int, dict[str, Any]] = {}
    for row in conn.execute(sa.select(_trials).where(which)):
        found[row.trial_id] = {"row": row, **{part: {} for part in _PARTS}}
    if found:
        ids = sa.select(_trials.c.trial_id).where(which)
        _fill_parts(conn, ids, found)
        _fill_attributes(conn, ids, found, only_user_keys)
        if only_user_keys is None:
            _fill_steps(conn, ids, found)
    return {trial_id: _frozen(parts) for trial_id, parts in found.items()}


def _fill_parts(conn: sa.Connection, ids: sa.Select[Any], found: dict[int, dict[str, Any]]) -> None:
    for trial_id, name, value, dist_json in conn.execute(
        sa.select(
            _params.c.trial_id,
            _params.c.param_name,
            _params.c.param_value,
            _params.c.distribution_json,
        ).where(_params.c.trial_id.in_(ids))
    ):
        if trial_id not in found:
            continue  # created while this read: the next read takes it whole
        distribution = json_to_distribution(dist_json)
        found[trial_id]["distributions"][name] = distribution
        found[trial_id]["params"][name] = distribution.to_external_repr(value)
    for trial_id, objective, value, kind in conn.execute(
        sa.select(
            _values.c.trial_id, _values.c.objective, _values.c.value, _values.c.value_type
        ).where(_values.c.trial_id.in_(ids))
    ):
        if trial_id in found:
            found[trial_id]["values"][objective] = _INFINITE.get(kind, value)


def _fill_attributes(
    conn: sa.Connection,
    ids: sa.Select[Any],
    found: dict[int, dict[str, Any]],
    only_user_keys: Sequence[str] | None,
) -> None:
    tables = [(_user_attrs, "user"), (_system_attrs, "system")]
    for table, part in tables if only_user_keys is None else tables[:1]:
        query = sa.select(table.c.trial_id, table.c.key, table.c.value_json)
        query = query.where(table.c.trial_id.in_(ids))
        if only_user_keys is not None:
            query = query.where(table.c.key.in_(list(only_user_keys)))
        for trial_id, key, raw in conn.execute(query):
            if trial_id in found:
                found[trial_id][part][key] = json.loads(raw)


def _fill_steps(conn: sa.Connection, ids: sa.Select[Any], found: dict[int, dict[str, Any]]) -> None:
    for trial_id, step, value, kind in conn.execute(
        sa.select(
            _steps.c.trial_id,
            _steps.c.step,
            _steps.c.intermediate_value,
            _steps.c.intermediate_value_type,
        ).where(_steps.c.trial_id.in_(ids))
    ):
        if trial_id in found:
            steps = found[trial_id]["steps"]
            steps[step] = math.nan if kind == "NAN" else _INFINITE.get(kind, value)


def _frozen(parts: dict[str, Any]) -> FrozenTrial:
    row = parts["row"]
    values = [parts["values"][k] for k in sorted(parts["values"])] or None
    return FrozenTrial(
        number=row.number,
        state=TrialState[row.state],
        value=None,
        values=values,
        datetime_start=_datetime(row.datetime_start),
        datetime_complete=_datetime(row.datetime_complete),
        params=parts["params"],
        distributions=parts["distributions"],
        user_attrs=parts["user"],
        system_attrs=parts["system"],
        intermediate_values=parts["steps"],
        trial_id=row.trial_id,
    )


def _datetime(value: object) -> dt.datetime | None:
    """A stored time (naive UTC) as Optuna hands it out: naive local time."""
    if value is None:
        return None
    # SQLite may hand back text for an aggregate.
    moment = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(str(value))
    return moment.replace(tzinfo=dt.timezone.utc).astimezone().replace(tzinfo=None)
