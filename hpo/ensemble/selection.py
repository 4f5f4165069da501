"""Greedy forward selection with replacement (Caruana et al. 2004): start from the best member
and add, round by round, the member (again, possibly) that most improves the held-out score.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hpo.ensemble.scoring import average, direction_of, is_better, metric_for, score

DEFAULT_ROUNDS = 25


@dataclass(frozen=True)
class Selection:
    """The members chosen: how often each was added, their weights (counts over rounds), the
    held-out score after each round."""

    counts: dict[str, int]
    metric: str
    scores: list[float] = field(default_factory=list)

    @property
    def weights(self) -> dict[str, float]:
        total = sum(self.counts.values())
        return {name: count / total for name, count in self.counts.items()}

    @property
    def score(self) -> float:
        return self.scores[-1]


def member_scores(
    task: str, metric: str, predictions: Mapping[str, np.ndarray], labels: np.ndarray
) -> dict[str, float]:
    return {name: score(task, metric, p, labels) for name, p in predictions.items()}


def best_member(
    task: str, metric: str, predictions: Mapping[str, np.ndarray], labels: np.ndarray
) -> str:
    """The member with the best score (the first of equals, in the given order)."""
    direction = direction_of(task, metric)
    scores = member_scores(task, metric, predictions, labels)
    best = next(iter(scores))
    for name, value in scores.items():
        if is_better(value, scores[best], direction):
            best = name
    return best


def greedy_selection(
    task: str,
    predictions: Mapping[str, np.ndarray],
    labels: np.ndarray,
    metric: str | None = None,
    max_rounds: int = DEFAULT_ROUNDS,
) -> Selection:
    """Caruana's selection on one held-out split. Each round tries every member (with
    replacement) and keeps the one whose addition scores best; it stops after `max_rounds`, or
    when no addition improves the score. A near-duplicate of a chosen member changes the average
    little, so it is rarely chosen over a member that errs elsewhere."""
    metric = metric_for(task, metric)
    direction = direction_of(task, metric)
    first = best_member(task, metric, predictions, labels)
    counts: Counter[str] = Counter({first: 1})
    scores = [score(task, metric, np.asarray(predictions[first]), labels)]
    for _ in range(1, max_rounds):
        round_best: tuple[str, float] | None = None
        for name in predictions:
            trial = dict(counts)
            trial[name] = trial.get(name, 0) + 1
            value = score(task, metric, average(predictions, trial), labels)
            if round_best is None or is_better(value, round_best[1], direction):
                round_best = (name, value)
        if round_best is None or not is_better(round_best[1], scores[-1], direction):
            break
        counts[round_best[0]] += 1
        scores.append(round_best[1])
    return Selection(dict(counts), metric, scores)
