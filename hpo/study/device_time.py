"""A study's device time: each trial's, however it ended, and running ones' up to their last
heartbeat. `hpo status` prints it; study.budget_device_hours stops starting trials once it is
spent (hpo.study.trials). `now` is naive local time, as Optuna hands trials' times back.
"""

from __future__ import annotations

import datetime as dt

from optuna.trial import FrozenTrial, TrialState

WALL_S = "wall_s"  # a trial's own record of its time, written however it ends
# Study user attributes: study.budget_device_hours and study.price_per_device_hour, the latest
# worker's ({"amount": 2.5, "currency": "EUR"}).
BUDGET_ATTR = "budget_device_hours"
PRICE_ATTR = "price_per_device_hour"
HOUR_S = 3600.0


def trial_device_s(trial: FrozenTrial, now: dt.datetime, silent_s: float | None = None) -> float:
    """A trial's time: a running one's up to its last heartbeat (`silent_s` ago; without a
    heartbeat row, up to now); a finished one's as it recorded it (wall_s), else from its
    start to its end (its worker was killed, or it stopped before training).

    A worker killed outright (a second Ctrl-C, kill -9) leaves its trial RUNNING until another
    worker sweeps it: what it ran is what its heartbeats vouch for, not its age, which grows
    for as long as no worker comes. The sweep records the same figure as the trial's wall_s."""
    start, end = trial.datetime_start, trial.datetime_complete
    if trial.state == TrialState.RUNNING:
        if start is None:
            return 0.0
        return max(0.0, (now - start).total_seconds() - (silent_s or 0.0))
    if not trial.state.is_finished():
        return 0.0
    if WALL_S in trial.user_attrs:
        return recorded_seconds(trial.user_attrs[WALL_S])
    return max(0.0, (end - start).total_seconds()) if start and end else 0.0


def recorded_seconds(value: object) -> float:
    """A trial's wall_s; 0 for one that is not a number (set by hand, say)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if number else 0.0  # type: ignore[arg-type]


def device_hours(
    trials: list[FrozenTrial], now: dt.datetime, silences: dict[int, float] | None = None
) -> float:
    """The study's device-hours; `silences`: each running trial's seconds since its last
    heartbeat, by number."""
    silent = silences or {}
    return sum(trial_device_s(t, now, silent.get(t.number)) for t in trials) / HOUR_S
