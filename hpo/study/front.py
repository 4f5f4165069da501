"""Which trials make the Pareto front of a study of several objectives, by hpo's rule: the one
place that decides it for the models kept, `hpo best`, `hpo status`, the report and the
worker's summary (Optuna's own `study.best_trials` knows nothing of the two points below).

1. A trial no better than chance on a quality metric (the value of always answering the
   evaluation split's most common label, recorded by the workers as `chance_level`) is never
   on the front while another trial beats chance on all of them: a model that learned nothing
   is no trade-off, however fast it trained.
2. Throughput (`samples_per_s`) is measured, and noisy: a trial better on the quality metrics
   dominates one whose throughput is higher by no more than `study.throughput_tolerance` (a
   fraction of it). A real trade-off (faster by more than that) stays on the front.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import optuna
from optuna.study import StudyDirection

from hpo.config.schema import DEFAULT_THROUGHPUT_TOLERANCE

T = TypeVar("T")

THROUGHPUT_OBJECTIVES = frozenset({"samples_per_s"})
# Study user attributes the rule reads (set by the workers: hpo.study.loop).
TOLERANCE_ATTR = "throughput_tolerance"
CHANCE_ATTR = "chance_level"


@dataclass(frozen=True)
class FrontRule:
    """How one study's trials are compared: `directions` per objective; `throughput` the
    indices of throughput objectives; `tolerance` their relative noise; `chance` per objective,
    the value of guessing (None: no such floor, as for throughput)."""

    directions: tuple[StudyDirection, ...]
    throughput: frozenset[int] = frozenset()
    tolerance: float = 0.0
    chance: tuple[float | None, ...] = ()


def rule_for(study: optuna.Study) -> FrontRule:
    """The study's rule, from its objectives' names and what its workers recorded."""
    directions = tuple(study.directions)
    if len(directions) == 1:
        return FrontRule(directions)
    attrs = study.user_attrs
    names: list[str | None] = [None] * len(directions)
    if study.metric_names:
        names = [*study.metric_names]
    chance_levels: dict[str, Any] = attrs.get(CHANCE_ATTR) or {}
    return FrontRule(
        directions,
        throughput=frozenset(i for i, name in enumerate(names) if name in THROUGHPUT_OBJECTIVES),
        tolerance=float(attrs.get(TOLERANCE_ATTR, DEFAULT_THROUGHPUT_TOLERANCE)),
        chance=tuple(_number(chance_levels.get(name)) if name else None for name in names),
    )


def as_rule(rule: FrontRule | Sequence[StudyDirection]) -> FrontRule:
    """A rule as given, or from directions alone: plain Pareto dominance."""
    return rule if isinstance(rule, FrontRule) else FrontRule(tuple(rule))


def best_of(scored: Sequence[tuple[T, Sequence[float]]], rule: FrontRule) -> list[T]:
    """Of (item, values) pairs in trial order: the best on the one objective (the first of
    equals), or the Pareto front by the rule, in the same order."""
    signs = [1.0 if d == StudyDirection.MAXIMIZE else -1.0 for d in rule.directions]
    signed = [
        (item, [s * v for s, v in zip(signs, values, strict=True)]) for item, values in scored
    ]
    if len(signs) == 1:
        return [max(signed, key=lambda pair: pair[1][0])[0]] if signed else []
    floors = [None if c is None else s * c for s, c in zip(signs, rule.chance, strict=False)]
    useful = [(item, score) for item, score in signed if _beats(score, floors)]
    candidates = useful or signed  # nothing beat chance: the front of all, as they are
    front = _pareto_front(candidates)
    quality = [i for i in range(len(signs)) if i not in rule.throughput]
    return [
        item
        for item, score in front
        if not any(_better_within_tolerance(other, score, quality, rule) for _, other in candidates)
    ]


def _beats(score: list[float], floors: Sequence[float | None]) -> bool:
    return all(floor is None or value > floor for value, floor in zip(score, floors, strict=False))


def _pareto_front(signed: list[tuple[T, list[float]]]) -> list[tuple[T, list[float]]]:
    """Plain dominance (the first of equal trials stands for them), in trial order."""
    front: list[tuple[T, list[float]]] = []
    for item, score in signed:
        if any(_dominates(other, score) or other == score for _, other in front):
            continue
        front = [(t, s) for t, s in front if not _dominates(score, s)] + [(item, score)]
    return front


def _dominates(a: list[float], b: list[float]) -> bool:
    return all(x >= y for x, y in zip(a, b, strict=True)) and a != b


def _better_within_tolerance(
    a: list[float], b: list[float], quality: list[int], rule: FrontRule
) -> bool:
    """Whether `a` beats `b` on quality (as good on every quality objective, better on one)
    while `b`'s higher throughput, if any, is within the tolerance: noise, not a trade-off.
    Everything plain dominance decides stays as it was (this only adds dominated trials)."""
    if not rule.throughput or not quality:
        return False
    if not all(a[i] >= b[i] for i in quality) or not any(a[i] > b[i] for i in quality):
        return False
    return all(a[i] >= b[i] - rule.tolerance * abs(b[i]) for i in rule.throughput)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
