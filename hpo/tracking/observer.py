"""What a worker tells whoever watches its trials (an experiment tracker): each trial's start,
evaluations and end, as Optuna's callbacks or Lightning Fabric's loggers hear them. The worker
gets one observer where its trials start (hpo.study.loop.run_trials) and hands it down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial


class TrialObserver(Protocol):
    """Hears a worker's trials; each call returns at once (the work, if any, in the
    background), and none raises into the trial."""

    def trial_started(self, trial: optuna.Trial, params: dict[str, Any]) -> None:
        """The trial's parameters are sampled, its training about to start."""
        ...

    def evaluation(self, number: int, report: dict[str, Any]) -> None:
        """One evaluation of trial `number`, as hpo.trial.training sends it: `samples`
        trained so far and `metrics`."""
        ...

    def trial_ended(self, trial: optuna.Trial, state: str, reason: str | None = None) -> None:
        """The trial's end (`complete`, `pruned` or `failed`), once the study records it."""
        ...

    def trial_interrupted(self, trial: FrozenTrial, reason: str) -> None:
        """A trial failed for a reason not its own and was handed back (queued again)."""
        ...

    def close(self, study: optuna.Study | None) -> None:
        """The worker's trials are over: let the last calls finish (a bounded wait)."""
        ...


class NoObserver:
    """A worker whose config asks for no tracker: every call does nothing."""

    def trial_started(self, trial: optuna.Trial, params: dict[str, Any]) -> None:
        pass

    def evaluation(self, number: int, report: dict[str, Any]) -> None:
        pass

    def trial_ended(self, trial: optuna.Trial, state: str, reason: str | None = None) -> None:
        pass

    def trial_interrupted(self, trial: FrozenTrial, reason: str) -> None:
        pass

    def close(self, study: optuna.Study | None) -> None:
        pass


class Observers:
    """Several observers heard as one (the trackers, the study's notices), in order."""

    def __init__(self, *observers: TrialObserver) -> None:
        self.observers = observers

    def trial_started(self, trial: optuna.Trial, params: dict[str, Any]) -> None:
        for observer in self.observers:
            observer.trial_started(trial, params)

    def evaluation(self, number: int, report: dict[str, Any]) -> None:
        for observer in self.observers:
            observer.evaluation(number, report)

    def trial_ended(self, trial: optuna.Trial, state: str, reason: str | None = None) -> None:
        for observer in self.observers:
            observer.trial_ended(trial, state, reason)

    def trial_interrupted(self, trial: FrozenTrial, reason: str) -> None:
        for observer in self.observers:
            observer.trial_interrupted(trial, reason)

    def close(self, study: optuna.Study | None) -> None:
        for observer in self.observers:
            observer.close(study)
