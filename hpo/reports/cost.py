"""What a study's device time costs (study.price_per_device_hour), its device-hour budget, and
the device time (or cost) it took to come within REACH_TOLERANCE of its best value.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpo.study.device_time import BUDGET_ATTR, HOUR_S, PRICE_ATTR, trial_device_s

REACH_TOLERANCE = 0.005  # "within 0.005 of the best": what the report's cost-to-reach counts


def price_of(user_attrs: dict[str, Any]) -> tuple[float, str] | None:
    """The study's recorded price per device-hour and its currency; None if it has none."""
    price = user_attrs.get(PRICE_ATTR)
    if not isinstance(price, dict):
        return None
    amount, currency = price.get("amount"), price.get("currency")
    if not isinstance(amount, (int, float)) or isinstance(amount, bool) or amount <= 0:
        return None
    return float(amount), str(currency or "")


def budget_of(user_attrs: dict[str, Any]) -> float | None:
    """The study's recorded device-hour budget; None if it has none."""
    budget = user_attrs.get(BUDGET_ATTR)
    number = isinstance(budget, (int, float)) and not isinstance(budget, bool)
    return float(budget) if number and math.isfinite(budget) and budget > 0 else None  # type: ignore[arg-type,operator]


def spend_text(hours: float, price: tuple[float, str] | None) -> str:
    """`0.512 device-hours`, with its cost when the study has a price (`, 1.28 EUR`)."""
    text = f"{hours:.3f} device-hours"
    if price is not None:
        text += f" ({hours * price[0]:.2f} {price[1]})".rstrip()
    return text


def to_reach(
    trials: list[FrozenTrial], direction: StudyDirection, tolerance: float = REACH_TOLERANCE
) -> tuple[int, float] | None:
    """The first completed trial (in start order) within `tolerance` of the best value, and
    the device-hours of every trial that started no later than it (what the study had spent
    on the way, parallel workers' trials included); None before a trial completed."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    if not complete:
        return None
    values = [t.value for t in complete]
    maximize = direction == StudyDirection.MAXIMIZE
    best = max(values) if maximize else min(values)  # type: ignore[type-var]
    reached = [t for t in complete if abs(t.value - best) <= tolerance]  # type: ignore[operator]
    first = min(reached, key=_started)
    now = dt.datetime.now()  # as Optuna hands trials' times back: naive local time
    spent_s = sum(
        trial_device_s(t, now)
        for t in trials
        if t.datetime_start is not None and _started(t) <= _started(first)
    )
    return first.number, spent_s / HOUR_S


def reach_line(study: optuna.Study, trials: list[FrozenTrial]) -> str | None:
    """The report's line: the device-hours (and cost) to come within REACH_TOLERANCE of the
    best; None for a study of several objectives or none completed."""
    if len(study.directions) > 1:
        return None
    reached = to_reach(trials, study.direction)
    if reached is None:
        return None
    number, hours = reached
    return (
        f"to reach within {REACH_TOLERANCE} of the best: "
        f"{spend_text(hours, price_of(study.user_attrs))} (trial #{number} first did)"
    )


def _started(trial: FrozenTrial) -> tuple[Any, int]:
    return (trial.datetime_start, trial.number)
