"""What a user asks of a running or finished study: the list of studies, the best trial, and a
status summary (states, running trials, throughput, failures and prunes by reason).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState


def studies(storage: optuna.storages.BaseStorage) -> list[dict[str, Any]]:
    rows = []
    for summary in optuna.study.get_all_study_summaries(storage, include_best_trial=True):
        best = summary.best_trial
        rows.append(
            {
                "name": summary.study_name,
                "direction": summary.direction.name.lower(),
                "n_trials": summary.n_trials,
                "best_value": best.value if best is not None else None,
                "started": _iso(summary.datetime_start),
            }
        )
    return rows


def best_trial(study: optuna.Study) -> dict[str, Any] | None:
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return None
    best = study.best_trial
    return {
        "study": study.study_name,
        "number": best.number,
        "value": best.value,
        "params": best.params,
        "user_attrs": best.user_attrs,
    }


def status(study: optuna.Study, now: dt.datetime | None = None) -> dict[str, Any]:
    """Trials by state, running trials with worker and age, best, device-hours, trials/hour,
    and failures and prunes grouped by reason."""
    now = now or dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)  # Optuna stores naive UTC
    trials = study.get_trials(deepcopy=False)
    finished = [t for t in trials if t.state.is_finished() and t.datetime_complete]
    return {
        "study": study.study_name,
        "trials": dict(Counter(t.state.name.lower() for t in trials)),
        "running": [_running(t, now) for t in trials if t.state == TrialState.RUNNING],
        "best": best_trial(study),
        "device_hours": round(sum(t.user_attrs.get("wall_s", 0.0) for t in trials) / 3600, 4),
        "trials_per_hour": _trials_per_hour(finished),
        "failures": _reasons(trials, TrialState.FAIL, "fail_reason"),
        "prunes": _reasons(trials, TrialState.PRUNED, "prune_reason"),
    }


def status_lines(report: dict[str, Any]) -> list[str]:
    states = ", ".join(f"{n} {s}" for s, n in sorted(report["trials"].items())) or "no trials"
    lines = [f"study {report['study']!r}: {states}"]
    for run in report["running"]:
        lines.append(f"  running #{run['number']} on {run['worker']} for {run['age_s']:.0f} s")
    best = report["best"]
    if best is not None:
        lines.append(f"best #{best['number']}: {best['value']:.4f} {best['params']}")
    per_hour = report["trials_per_hour"] or 0.0
    lines.append(f"device-hours {report['device_hours']:.3f}, {per_hour:.1f} trials/hour")
    for title in ("failures", "prunes"):
        for reason, count in report[title].items():
            lines.append(f"  {title[:-1]}: {count} x {reason}")
    return lines


def _running(trial: FrozenTrial, now: dt.datetime) -> dict[str, Any]:
    started = trial.datetime_start
    return {
        "number": trial.number,
        "worker": trial.user_attrs.get("worker", "unknown"),
        "age_s": (now - started).total_seconds() if started else None,
    }


def _trials_per_hour(finished: list[FrozenTrial]) -> float | None:
    starts = [t.datetime_start for t in finished if t.datetime_start]
    ends = [t.datetime_complete for t in finished if t.datetime_complete]
    if not starts or not ends:
        return None
    hours = (max(ends) - min(starts)).total_seconds() / 3600
    return round(len(finished) / hours, 2) if hours > 0 else None


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
