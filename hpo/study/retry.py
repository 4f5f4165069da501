"""Hand a trial back to the study: a trial whose worker died, was preempted or was stopped is
re-queued with the same parameters, a bounded number of times, inside the study's budget.
"""

from __future__ import annotations

import logging
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

log = logging.getLogger(__name__)

# Attributes that describe how one attempt ended; a retry starts without them. Its time
# (wall_s) too: a retry stopped before recording its own would count its attempt's in
# device-hours.
_ATTEMPT_ATTRS = ("fail_reason", "prune_reason", "interrupted", "worker", "gpu", "status", "wall_s")


def retry_trial(study: optuna.Study, trial: FrozenTrial, max_retries: int) -> int | None:
    """Queue a WAITING copy of `trial` (same parameters); returns its number, or None when the
    trial was already retried `max_retries` times. The copy carries the `failed_trial` system
    attribute, which the study budget counts as a retry rather than a new trial."""
    history = [*trial.system_attrs.get("retry_history", []), trial.number]
    if len(history) > max_retries:
        log.warning("trial %d was retried %d times already; not again", trial.number, max_retries)
        return None
    system_attrs: dict[str, Any] = {
        **trial.system_attrs,
        "failed_trial": trial.system_attrs.get("failed_trial", trial.number),
        "retry_history": history,
    }
    user_attrs = {k: v for k, v in trial.user_attrs.items() if k not in _ATTEMPT_ATTRS}
    user_attrs["retry_of"] = trial.number
    # Every attempt of one configuration shares the first attempt's checkpoint folder.
    user_attrs["first_attempt"] = system_attrs["failed_trial"]
    study.add_trial(
        optuna.create_trial(
            state=TrialState.WAITING,
            params=trial.params,
            distributions=trial.distributions,
            user_attrs=user_attrs,
            system_attrs=system_attrs,
        )
    )
    # The history names this attempt, so exactly one trial carries it (another worker may
    # already be running it).
    trials = study.get_trials(deepcopy=False)
    return next(t.number for t in trials if t.system_attrs.get("retry_history") == history)
