"""What a user asks of a running or finished study: the list of studies, the best trial, and a
status summary (states, running trials, throughput, failures and prunes by reason).

Given hpo's StudyStorage, each is answered by the database (storage.study_queries: counts and
aggregates, the best trial, the running ones), in about the same time at 100,000 trials as at
ten; otherwise, from the study's trials read whole.
"""

from __future__ import annotations

import datetime as dt
import math
import shlex
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpo import tracking
from hpo.reports import cost
from hpo.reports.text import best_values_text, rank_state_text
from hpo.storage import heartbeats, study_queries
from hpo.storage.engine import StudyStorage
from hpo.study.device_time import WALL_S
from hpo.study.device_time import trial_device_s as _device_s
from hpo.study.front import best_of, rule_for
from hpo.study.join import model_loader, trial_adapter
from hpo.study.kept_models import best_trials as kept_best_trials
from hpo.study.names import quoted_study_name
from hpo.study.setup_record import setup_changes
from hpo.study.trials import RETRY_ATTR, counted_trials
from hpo.trial import folders as checkpoints

# Trials that reached an outcome the search learns from: what trials/hour counts.
DONE = (TrialState.COMPLETE, TrialState.PRUNED)
FINISHED = tuple(s for s in TrialState if s.is_finished())
CHECKPOINT_ERROR = "checkpoint_error"


@dataclass(frozen=True)
class Database:
    """A study whose questions the database answers."""

    storage: StudyStorage
    study_id: int


def database_of(study: optuna.Study, storage: object) -> Database | None:
    """The study's database, when hpo's storage holds it and the queries know its schema."""
    if not isinstance(storage, StudyStorage) or not study_queries.supported(storage.engine):
        return None
    return Database(storage, storage.get_study_id_from_name(study.study_name))


def studies(storage: optuna.storages.BaseStorage) -> list[dict[str, Any]]:
    if isinstance(storage, StudyStorage) and study_queries.supported(storage.engine):
        return [_study_row(storage, study) for study in storage.rdb.get_all_studies()]
    rows = []
    for summary in optuna.study.get_all_study_summaries(storage, include_best_trial=True):
        best = summary.best_trial if len(summary.directions) == 1 else None
        rows.append(
            _row(
                summary.study_name,
                summary.directions,
                summary.n_trials,
                best,
                summary.datetime_start,
            )
        )
    return rows


def _study_row(storage: StudyStorage, study: Any) -> dict[str, Any]:
    """`studies`' row of one study, from the database's counts and best trial."""
    directions = list(study.directions)
    study_id = storage.rdb.get_study_id_from_name(study.study_name)
    size, started = study_queries.size_and_start(storage.engine, study_id)
    best = _best_single(storage, study_id, directions[0]) if len(directions) == 1 else None
    return _row(study.study_name, directions, size, best, started)


def _row(
    name: str,
    directions: Sequence[StudyDirection],
    n_trials: int,
    best: FrozenTrial | None,
    started: dt.datetime | None,
) -> dict[str, Any]:
    return {
        "name": name,
        # One direction, or one per objective of a study with several.
        "direction": " and ".join(d.name.lower() for d in directions),
        "directions": [d.name.lower() for d in directions],
        "n_trials": n_trials,
        "best_value": best.value if best is not None else None,
        "started": _iso(started),
    }


def _best_single(
    storage: StudyStorage, study_id: int, direction: StudyDirection
) -> FrozenTrial | None:
    """The best trial of a study of one objective, by the database's ordering."""
    maximize = direction == StudyDirection.MAXIMIZE
    best_id = study_queries.best_trial_id(storage.engine, study_id, maximize)
    return None if best_id is None else storage.rdb.get_trial(best_id)


def best_trials(
    study: optuna.Study, trials: list[FrozenTrial] | None = None, storage: object = None
) -> list[dict[str, Any]]:
    """The best trial, or with several objectives the trials of the Pareto front; empty when
    no trial has completed. `trials`: the study's trials, if the caller has read them;
    `storage`: hpo's, to ask the database instead."""
    db = database_of(study, storage) if trials is None else None
    if db is not None:
        best = _best_from_database(study, db)
    else:
        trials = study.get_trials(deepcopy=False) if trials is None else trials
        best = kept_best_trials(trials, rule_for(study))
    return [_trial_summary(study, t) for t in best]


def _best_from_database(study: optuna.Study, db: Database) -> list[FrozenTrial]:
    directions = study.directions
    if len(directions) == 1:
        best = _best_single(db.storage, db.study_id, directions[0])
        return [] if best is None else [best]
    values = study_queries.complete_values(db.storage.engine, db.study_id, len(directions))
    front = best_of(sorted(values.items()), rule_for(study))
    return [db.storage.rdb.get_trial(trial_id) for trial_id in front]


def _trial_summary(study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
    summary: dict[str, Any] = {"study": study.study_name, "number": trial.number}
    names = metric_names(study)
    if len(study.directions) == 1:
        summary["value"] = trial.value
        summary["metric"] = names[0] if names else None
    else:
        summary["values"] = trial.values
        summary["metrics"] = names
    missing = checkpoints.missing_model(trial.number, trial.user_attrs)
    return {
        **summary,
        "params": trial.params,
        "user_attrs": trial.user_attrs,
        "model_loader": model_loader(study.user_attrs, trial.user_attrs),
        "adapter": trial_adapter(study.user_attrs, trial.user_attrs),
        "model_missing": missing,
    }


def metric_names(study: optuna.Study) -> list[str] | None:
    """The names of the study's metrics (hpo names them: `accuracy`), one per objective; None
    for a study plain Optuna made without names."""
    names = study.metric_names
    return list(names) if names and len(names) == len(study.directions) else None


def status(
    study: optuna.Study, now: dt.datetime | None = None, storage: object = None
) -> dict[str, Any]:
    """Trials by state, running trials with worker and age, best, device-hours, trials/hour,
    failures and prunes grouped by reason, and trials whose checkpoints were lost. `storage`:
    hpo's, to ask the database.

    Device-hours: every trial's time, however it ended (the time its worker recorded, else
    from its start to its end) and running ones' up to their last heartbeat. Trials/hour:
    trials that completed or were pruned, from the first one's start to the last one's end;
    None before one has."""
    # Optuna stores naive UTC but hands trials' times back as naive local time: so is `now`.
    now = now or dt.datetime.now()
    db = database_of(study, storage)
    if db is not None:
        return _with_spend(study, _status_from_database(study, db, now))
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state in DONE and t.datetime_complete]
    best = best_trials(study, trials)
    several = len(study.directions) > 1
    shown = {
        "study": study.study_name,
        "trials": dict(Counter(t.state.name.lower() for t in trials)),
        "running": [
            {**_running(t, now), "silent_s": None} for t in trials if t.state == TrialState.RUNNING
        ],
        "best": best[0] if best and not several else None,
        "pareto_front": best if several else None,
        "grace_period_s": _positive(study.user_attrs.get("grace_period_s")),
        "device_hours": round(sum(_device_s(t, now) for t in trials) / 3600, 4),
        "trials_per_hour": _trials_per_hour(done),
        "failures": _reasons(trials, TrialState.FAIL, "fail_reason"),
        "prunes": _reasons(trials, TrialState.PRUNED, "prune_reason"),
        "budget": _budget(study.user_attrs.get("n_trials")),
        "counted": counted_trials(trials),
        "lost_checkpoints": lost_checkpoints(trials),
        "tracking_missing": tracking_missing(study),
        "setup_changes": setup_changes(study.user_attrs),
    }
    return _with_spend(study, shown)


def _with_spend(study: optuna.Study, shown: dict[str, Any]) -> dict[str, Any]:
    """The study's device-hour budget and what its device-hours cost (study.budget_device_hours,
    study.price_per_device_hour), None where it has none."""
    price = cost.price_of(study.user_attrs)
    shown["budget_device_hours"] = cost.budget_of(study.user_attrs)
    shown["cost"] = (
        None
        if price is None
        else {"amount": round(shown["device_hours"] * price[0], 2), "currency": price[1]}
    )
    return shown


def _status_from_database(study: optuna.Study, db: Database, now: dt.datetime) -> dict[str, Any]:
    engine, study_id = db.storage.engine, db.study_id
    counts = study_queries.state_counts(engine, study_id)
    running = db.storage.rdb.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
    silent = heartbeats.silences(engine, study_id)
    best = [_trial_summary(study, t) for t in _best_from_database(study, db)]
    several = len(study.directions) > 1
    done, first, last = study_queries.finished_span(engine, study_id, DONE)
    hours = (last - first).total_seconds() / 3600 if first and last else 0.0
    device_s = (
        study_queries.user_attr_sum(engine, study_id, WALL_S, FINISHED)
        + sum(study_queries.spans_without(engine, study_id, WALL_S))
        + sum(_device_s(t, now, silent.get(t.number)) for t in running)
    )
    lost, latest, reason = study_queries.latest_user_attr(engine, study_id, CHECKPOINT_ERROR)
    return {
        "study": study.study_name,
        "trials": {state.name.lower(): n for state, n in sorted(counts.items()) if n},
        "running": [
            {**_running(t, now), "silent_s": silent.get(t.number)}
            for t in sorted(running, key=lambda t: t.number)
        ],
        "best": best[0] if best and not several else None,
        "pareto_front": best if several else None,
        "grace_period_s": _positive(study.user_attrs.get("grace_period_s")),
        "device_hours": round(device_s / 3600, 4),
        "trials_per_hour": round(done / hours, 2) if hours > 0 else None,
        "failures": study_queries.reasons(
            engine, study_id, TrialState.FAIL, "fail_reason", counts.get(TrialState.FAIL, 0)
        ),
        "prunes": study_queries.reasons(
            engine, study_id, TrialState.PRUNED, "prune_reason", counts.get(TrialState.PRUNED, 0)
        ),
        "budget": _budget(study.user_attrs.get("n_trials")),
        # As counted_trials counts: started trials, less the failed ones a retry replaces.
        "counted": sum(n for state, n in counts.items() if state != TrialState.WAITING)
        - study_queries.system_attr_count(engine, study_id, RETRY_ATTR),
        "lost_checkpoints": _lost(lost, latest, reason),
        "tracking_missing": tracking_missing(study),
        "setup_changes": setup_changes(study.user_attrs),
    }


def stale(report: dict[str, Any]) -> list[int]:
    """Running trials silent past the study's grace period: their worker died or hangs, and
    they wait for a live worker to take them over."""
    grace = report.get("grace_period_s")
    return [
        run["number"]
        for run in report["running"]
        if grace is not None and run.get("silent_s") is not None and run["silent_s"] > grace
    ]


def stalled(report: dict[str, Any]) -> bool:
    """Trials run or wait, but none runs with a live worker: nothing moves until a worker
    starts (a watcher asks more than once, as between two trials of a worker nothing runs).
    Queued trials past a spent budget are not stalled: a new worker would not start them."""
    states = report["trials"]
    unfinished = states.get("running", 0) + states.get("waiting", 0)
    if waiting_for_budget(report):
        return False
    return unfinished > 0 and len(stale(report)) == states.get("running", 0)


def ended(report: dict[str, Any]) -> bool:
    """No trial runs, the budget (when the study records one) is spent, and no trial waits
    but past it. Between two trials of a worker nothing runs for a moment: unless the study
    has ended for good (ended_for_good), a watcher asks twice, some time apart."""
    states = report["trials"]
    if not states or states.get("running"):
        return False
    if device_hours_spent(report):
        return True
    if states.get("waiting"):
        return bool(waiting_for_budget(report))
    budget = report.get("budget")
    return budget is None or sum(states.values()) >= budget


def ended_for_good(report: dict[str, Any]) -> bool:
    """Ended, and no worker starts another trial: the budget the study records is spent by
    the trials it counts (a failed trial that a retry replaces is not counted). Without a
    budget (a study with only a timeout, or one plain Optuna made), nothing running may be a
    worker between two trials."""
    budget = report.get("budget")
    spent = budget is not None and report.get("counted", 0) >= budget
    return ended(report) and (spent or device_hours_spent(report))


def device_hours_spent(report: dict[str, Any]) -> bool:
    """The study's device-hours reach its budget (study.budget_device_hours): no worker
    starts another trial."""
    budget = report.get("budget_device_hours")
    return budget is not None and report["device_hours"] >= budget


def waiting_for_budget(report: dict[str, Any]) -> int:
    """Queued trials that no worker will start: nothing runs and the budget is spent. Only a
    worker with a larger n_trials (the study's budget is its latest worker's) runs them."""
    states, budget = report["trials"], report.get("budget")
    waiting = states.get("waiting", 0)
    if not waiting or states.get("running") or budget is None:
        return 0
    return waiting if report.get("counted", 0) >= budget else 0


def budget_advice(report: dict[str, Any]) -> str:
    """What runs the queued trials that wait for a larger budget."""
    waiting, budget = waiting_for_budget(report), report["budget"]
    trials = "1 queued trial waits" if waiting == 1 else f"{waiting} queued trials wait"
    return (
        f"{trials}: the budget of {budget} trials is spent; run them with a larger one, "
        f"e.g. hpo run --study {shlex.quote(report['study'])} --config ... "
        f"--n-trials {report['counted'] + waiting}"
    )


def status_lines(report: dict[str, Any]) -> list[str]:
    states = ", ".join(f"{n} {s}" for s, n in sorted(report["trials"].items())) or "no trials"
    lines = [f"study {quoted_study_name(report['study'])}: {states}"]
    stale_trials = stale(report)
    for run in report["running"]:
        line = f"  running #{run['number']} on {run['worker']} for {run['age_s']:.0f} s"
        if run["number"] in stale_trials:
            line += (
                f", silent for {run['silent_s']:.0f} s: its worker is gone or hangs; the "
                "next worker to start a trial takes it over"
            )
        lines.append(line)
    best = report["best"]
    if best is not None:
        lines.append(f"best #{best['number']}: {best_values_text(best)}")
        held = rank_state_text(best.get("user_attrs") or {})
        if held is not None:
            lines.append(f"  {held}")
    for trial in report["pareto_front"] or []:
        lines.append(f"Pareto front #{trial['number']}: {best_values_text(trial)}")
    lines.append(figures_line(report))
    if waiting_for_budget(report):
        lines.append(f"  {budget_advice(report)}")
    for title in ("failures", "prunes"):
        for reason, count in report[title].items():
            lines.append(f"  {title[:-1]}: {count} x {reason}")
    best = [report["best"]] if report["best"] is not None else report["pareto_front"] or []
    lines += checkpoint_warnings(best, report.get("lost_checkpoints"))
    lines += setup_warnings(report.get("setup_changes") or [])
    return lines + tracking_warnings(report.get("tracking_missing"))


def setup_warnings(changes: list[dict[str, Any]]) -> list[str]:
    """A study whose workers were allowed another data set, model, evaluation schedule or
    pruner (`hpo run --allow-changed-setup`) mixes trials that do not compare: said."""
    if not changes:
        return []
    latest = changes[-1]
    fields = ", ".join(latest.get("fields") or {}) or "its setup"
    times = "once" if len(changes) == 1 else f"{len(changes)} times"
    return [
        f"WARNING: the study mixes setups: changed {times} with --allow-changed-setup "
        f"(latest at {latest.get('at', 'an unknown time')}: {fields}); its trials before "
        "and after a change do not compare"
    ]


def tracking_missing(study: optuna.Study) -> dict[str, Any] | None:
    """The trials an experiment tracker (MLflow, TensorBoard) is missing, all or in part: how
    many, and the latest one's reason."""
    missing = tracking.missing_trials(study.user_attrs)
    if not missing:
        return None
    latest = max(missing)
    return {"trials": len(missing), "latest": latest, "reason": missing[latest]}


def tracking_warnings(missing: dict[str, Any] | None) -> list[str]:
    if not missing:
        return []
    trials = "1 trial" if missing["trials"] == 1 else f"{missing['trials']} trials"
    return [
        f"WARNING: the tracker is missing {trials} (all or in part); the latest, trial "
        f"#{missing['latest']}: {missing['reason']}"
    ]


def figures_line(report: dict[str, Any]) -> str:
    """Device-hours, saying what they count, trials/hour once it means something, and the
    budget."""
    text = f"device-hours {report['device_hours']:.3f} (every trial, however it ended; running "
    text += "ones up to their last heartbeat)"
    if report["trials_per_hour"] is not None:
        text += f", {report['trials_per_hour']:.1f} trials/hour (completed or pruned)"
    if report.get("budget"):
        text += f", budget {report['budget']} trials"
    if report.get("cost") is not None:
        text += f", cost {report['cost']['amount']:.2f} {report['cost']['currency']}"
    if report.get("budget_device_hours") is not None:
        text += f", budget {report['budget_device_hours']:g} device-hours"
    return text


def checkpoint_warnings(best: list[dict[str, Any]], lost: dict[str, Any] | None) -> list[str]:
    """Loud lines for what leaves a study without a best model (`best`: best_trials' entries)
    or without checkpoints (`lost`: status' lost_checkpoints)."""
    lines = [f"WARNING: {trial['model_missing']}" for trial in best if trial.get("model_missing")]
    if lost:
        trials = "1 trial" if lost["trials"] == 1 else f"{lost['trials']} trials"
        lines.append(
            f"WARNING: checkpoints not written or not stored for {trials} "
            f"(checkpoint_error); the latest, trial #{lost['latest']}: "
            f"{lost['reason']}"
        )
    return lines


def finite_number(value: object) -> bool:
    """A finite int or float (not a bool, not text): a figure hpo recorded, not a plain Optuna
    study's attribute of the same name and of its own kind."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value)  # type: ignore[arg-type]


def _positive(value: object) -> float | None:
    """A positive number hpo recorded in the study's attributes; None for anything else."""
    return float(value) if finite_number(value) and value > 0 else None  # type: ignore[arg-type,operator]


def _budget(value: object) -> int | None:
    """The study's n_trials as hpo recorded it (a positive whole number), or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def lost_checkpoints(trials: list[FrozenTrial]) -> dict[str, Any] | None:
    """How many trials recorded a checkpoint_error, and the latest one's; None if none did."""
    lost = [t for t in trials if CHECKPOINT_ERROR in t.user_attrs]
    if not lost:
        return None
    return _lost(len(lost), lost[-1].number, lost[-1].user_attrs[CHECKPOINT_ERROR])


def _lost(count: int, latest: int | None, reason: object) -> dict[str, Any] | None:
    return {"trials": count, "latest": latest, "reason": reason} if count else None


def _running(trial: FrozenTrial, now: dt.datetime) -> dict[str, Any]:
    started = trial.datetime_start
    return {
        "number": trial.number,
        "worker": trial.user_attrs.get("worker", "unknown"),
        "age_s": (now - started).total_seconds() if started else None,
    }


def _trials_per_hour(done: list[FrozenTrial]) -> float | None:
    starts = [t.datetime_start for t in done if t.datetime_start]
    ends = [t.datetime_complete for t in done if t.datetime_complete]
    if not starts or not ends:
        return None
    hours = (max(ends) - min(starts)).total_seconds() / 3600
    return round(len(done) / hours, 2) if hours > 0 else None


def _reasons(trials: list[FrozenTrial], state: TrialState, attr: str) -> dict[str, int]:
    """Counts by reason; the reason's kind (text before the first colon) groups variants."""
    kinds = Counter(
        str(t.user_attrs.get(attr, "no reason recorded")).split(":")[0]
        for t in trials
        if t.state == state
    )
    return dict(kinds.most_common())


def _iso(moment: dt.datetime | None) -> str | None:
    return moment.isoformat() if moment else None
