"""What a worker says of its study through study.notify, decided on the notifier's thread
(hpo.notify) from the study as stored: a new best, from the worker whose trial set it; failures
in a row for one reason, and the study's end, each said once across all workers, by a claim
in the study's system attributes taken under the study's lock.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo import notify
from hpo.config.notify import NotifyConfig
from hpo.notify import Notices
from hpo.storage.engine import StudyStorage
from hpo.study.front import best_of, rule_for
from hpo.study.trials import counted_trials

# Study system attributes: what was said already (a claim, taken under the study's lock).
ENDED_ATTR = "hpo:notified_end"  # the count of trials the end was said with
FAILURES_ATTR = "hpo:notified_failures"  # the first trial of the streak said
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
_NUMBERS = re.compile(r"\d+(?:\.\d+)?")


class StudyNotices:
    """One worker's notices of one study."""

    def __init__(
        self, study: optuna.Study, storage: StudyStorage, notices: Notices, failures: int
    ) -> None:
        self.study, self.storage, self.notices = study, storage, notices
        self.failures_in_a_row = failures
        self.study_id = storage.get_study_id_from_name(study.study_name)
        self.objectives = list(study.metric_names or [])

    # A TrialObserver (hpo.tracking.observer): the worker tells it of each trial's end, once
    # the end stands (not a trial another worker took over).
    def trial_started(self, trial: optuna.Trial, params: dict[str, Any]) -> None:
        pass

    def evaluation(self, number: int, report: dict[str, Any]) -> None:
        pass

    def trial_interrupted(self, trial: FrozenTrial, reason: str) -> None:
        pass  # handed back and queued again: not the trial's failure

    def trial_ended(self, trial: optuna.Trial, state: str, reason: str | None = None) -> None:
        number = trial.number
        if state == "complete" and self.notices.wants("best"):
            self.notices.submit(lambda: self._say_best(number))
        elif state == "failed" and self.notices.wants("failures"):
            self.notices.submit(self._say_failures)

    def worker_done(self, budget: int | None, device_hours_spent: bool = False) -> None:
        """This worker runs no more trials (not stopped: its budget, its device-hours or its
        timeout): the study's end is said if nothing runs and nothing is left to run."""
        if self.notices.wants("end"):
            self.notices.submit(lambda: self._say_end(budget, device_hours_spent))

    def close(self, study: optuna.Study | None) -> None:
        """The last messages go out, for up to study.notify.wait seconds."""
        self.notices.close()

    def _say_best(self, number: int) -> None:
        complete = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        scored = [(t, t.values) for t in complete if t.values is not None]
        best = best_of(scored, rule_for(self.study))
        trial = next((t for t in best if t.number == number), None)
        if trial is None:
            return
        name = self.study.study_name
        if len(self.study.directions) == 1:
            title = f"hpo: study {name!r}: new best {self._values(trial)}"
        else:
            title = f"hpo: study {name!r}: trial {trial.number} joins the Pareto front"
        body = (
            f"Trial {trial.number}: {self._values(trial)}\n"
            f"Parameters: {_params(trial.params)}\n"
            f"Trials finished so far: {_finished_count(self.study)}"
        )
        self.notices.say(title, body)

    def _say_failures(self) -> None:
        finished = self.study.get_trials(deepcopy=False, states=FINISHED)
        streak = failure_streak(finished)
        if len(streak) < self.failures_in_a_row:
            return
        if not self._claim(FAILURES_ATTR, streak[0].number):
            return
        reason = str(streak[-1].user_attrs.get("fail_reason", "no reason recorded"))
        first_line = reason.splitlines()[0] if reason.strip() else reason
        title = f"hpo: study {self.study.study_name!r}: {len(streak)} trials in a row failed"
        body = (
            f"Trials {streak[0].number} to {streak[-1].number} failed for the same reason:\n"
            f"{first_line[:500]}\n"
            f"See `hpo status --study {self.study.study_name}`; the workers go on."
        )
        self.notices.say(title, body)

    def _say_end(self, budget: int | None, device_hours_spent: bool = False) -> None:
        trials = self.study.get_trials(deepcopy=False)
        if not study_ended(trials, budget, device_hours_spent):
            return
        counted = counted_trials(trials)
        if not self._claim(ENDED_ATTR, counted):
            return
        states: dict[str, int] = {}
        for t in trials:
            states[t.state.name.lower()] = states.get(t.state.name.lower(), 0) + 1
        shown = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        complete = [(t, t.values) for t in trials if t.state == TrialState.COMPLETE and t.values]
        best = best_of(complete, rule_for(self.study))
        best_line = (
            "; ".join(f"trial {t.number}: {self._values(t)}" for t in best[:5])
            if best
            else "no trial completed"
        )
        name = self.study.study_name
        self.notices.say(
            f"hpo: study {name!r} has ended",
            f"Trials: {shown}.\nBest: {best_line}\nSee `hpo best --study {name}`.",
        )

    def _claim(self, key: str, value: Any) -> bool:
        """True for the one worker that records `value` under `key` first; False where it is
        recorded already (another worker said it)."""
        with self.storage.lock(self.study_id):
            if self.storage.get_study_system_attrs(self.study_id).get(key) == value:
                return False
            self.storage.set_study_system_attr(self.study_id, key, value)
        return True

    def _values(self, trial: FrozenTrial) -> str:
        values = trial.values or []
        names = self.objectives if len(self.objectives) == len(values) else []
        names = names or [f"value{i}" if len(values) > 1 else "value" for i in range(len(values))]
        return ", ".join(f"{n}={v:.4g}" for n, v in zip(names, values, strict=True))


def failure_streak(finished: list[FrozenTrial]) -> list[FrozenTrial]:
    """The last finished trials, in the order they ended, that all failed for the same reason
    (its numbers ignored: "allocate 20.00 MiB" and "allocate 24.00 MiB" are one reason)."""
    ordered = sorted(finished, key=lambda t: (t.datetime_complete or dt.datetime.min, t.number))
    streak: list[FrozenTrial] = []
    for trial in reversed(ordered):
        if trial.state != TrialState.FAIL:
            break
        if streak and reason_kind(trial) != reason_kind(streak[0]):
            break
        streak.insert(0, trial)
    return streak


def reason_kind(trial: FrozenTrial) -> str:
    reason = str(trial.user_attrs.get("fail_reason", ""))
    first_line = reason.splitlines()[0] if reason.strip() else ""
    return _NUMBERS.sub("#", first_line)


def study_ended(
    trials: list[FrozenTrial], budget: int | None, device_hours_spent: bool = False
) -> bool:
    """Nothing runs, and no worker starts another trial: the budget is spent (queued trials
    past it wait for a larger one; or the device-hours, study.budget_device_hours), or there
    is none (a timeout ended the workers) and nothing is queued."""
    if any(t.state == TrialState.RUNNING for t in trials):
        return False
    if device_hours_spent:
        return True
    if budget is not None:
        return counted_trials(trials) >= budget
    return not any(t.state == TrialState.WAITING for t in trials)


def _params(params: dict[str, Any]) -> str:
    shown = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()]
    text = ", ".join(shown)
    return text if len(text) <= 500 else text[:497] + "..."


def _finished_count(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def start(
    study: optuna.Study, storage: StudyStorage, config: NotifyConfig | None
) -> StudyNotices | None:
    """The worker's notices of its study; None without study.notify."""
    if config is None:
        return None
    return StudyNotices(study, storage, notify.start(config), config.failures_in_a_row)
