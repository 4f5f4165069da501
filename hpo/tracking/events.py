"""What the trackers are told: plain values, built on the worker's thread, logged on the
tracker's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StudyStart:
    study: str
    params: dict[str, Any]  # sampler, pruner, objectives...
    config: dict[str, Any]  # the whole config
    search_space: dict[str, Any]
    retrain_of: str | None = None  # a retrain study's: the study it retrains (hpo retrain)


@dataclass
class TrialStart:
    number: int
    first_attempt: int  # a retry's first attempt: its run goes on
    params: dict[str, Any]
    worker: str
    host: str


@dataclass
class TrialEnd:
    number: int
    state: str  # complete, pruned or failed
    reason: str | None = None
    samples: int = 0  # the step of the end's metrics
    metrics: dict[str, float] = field(default_factory=dict)
    derived: dict[str, Any] = field(default_factory=dict)  # physical batch, device...
    best_model: str | None = None


@dataclass
class TrialInterrupted:
    """A trial failed for a reason not its own (its worker died or was stopped) and handed
    back: its run waits for the retry, if one comes."""

    number: int
    first_attempt: int
    reason: str
