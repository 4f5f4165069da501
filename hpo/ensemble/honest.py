"""Honest scores for every candidate (the best member, soft voting, greedy selection, each
stacked learner): on a test split no trial saw, or else by K-fold cross-validated predictions on
the evaluation split, where whatever is fitted (a learner, a selection, the choice of the best
member) is fitted on the other folds only. What to save is chosen out of fold on the evaluation
split, never on the test split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import numpy as np

from hpo.ensemble.errors import EnsembleError
from hpo.ensemble.learners import Learner, resolve_learners
from hpo.ensemble.scoring import (
    average,
    check_predictions,
    direction_of,
    is_better,
    metric_for,
    score,
)
from hpo.ensemble.selection import DEFAULT_ROUNDS, Selection, best_member, greedy_selection
from hpo.ensemble.stacking import (
    PREDICTIONS,
    FeatureSettings,
    StackedModel,
    fit_stacked,
    fold_splitter,
)
from hpo.ensemble.stacking import stack_features as _stack
from hpo.trainer.metrics import Direction

CV_FOLDS = 5
MeasuredOn = Literal["test_split", "cross_validation"]


@dataclass(frozen=True)
class Split:
    """One split's rows: each member's predictions, the labels, and (optional) the stacking
    features when they are not the predictions (embeddings)."""

    predictions: Mapping[str, np.ndarray]
    labels: np.ndarray
    features: np.ndarray | None = None

    def stack_features(self, members: Sequence[str]) -> np.ndarray:
        return self.features if self.features is not None else _stack(self.predictions, members)


@dataclass(frozen=True)
class ChosenBy:
    """The out-of-fold scores on the evaluation split that decide what is saved: the chosen
    learner's stack against the best member (chosen on the other folds), by `folds`-fold
    cross-validation. With no test split, these are also the scores reported."""

    stacking: float
    best_member: float
    folds: int
    # The standard error of stacking's gain over the best member, from the folds' gains:
    # stacking must win by more (the one-standard-error rule: an ensemble costs its members'
    # inference, so a gain within the folds' noise is no reason to pay it).
    standard_error: float = 0.0

    @property
    def on(self) -> str:
        return f"{self.folds}-fold cross-validation on the evaluation split"

    def stacking_wins(self, direction: Direction) -> bool:
        gain = self.stacking - self.best_member
        return (gain if direction == "maximize" else -gain) > self.standard_error

    def score_of(self, choice: str) -> float:
        return self.stacking if choice == "stacking" else self.best_member

    def to_json(self) -> dict[str, Any]:
        return {
            "on": self.on,
            "stacking": self.stacking,
            "best_member": self.best_member,
            "folds": self.folds,
            "standard_error": self.standard_error,
        }


@dataclass
class EnsembleReport:
    """What each candidate scores, and how it was measured; `choice` is what to save."""

    task: str
    metric: str
    measured_on: MeasuredOn
    folds: int | None
    member_scores: dict[str, float]  # each member, as measured (no choice involved)
    best_member: str  # chosen on the evaluation split
    best_member_score: float
    soft_voting_score: float
    selection: Selection  # fitted on the whole evaluation split
    selection_score: float
    stacking_scores: dict[str, float]
    best_learner: str | None
    chosen_by: ChosenBy  # what `choice` is made on (never the test split)
    stacked: StackedModel | None = None  # the best learner, fitted on the whole evaluation split
    notes: list[str] = field(default_factory=list)

    @property
    def stacked_score(self) -> float:
        return self.stacking_scores[self.best_learner] if self.best_learner else float("nan")

    @property
    def stacking_beats_best_member(self) -> bool:
        """On the reported scores (the test split's, when there is one)."""
        direction = direction_of(self.task, self.metric)
        return is_better(self.stacked_score, self.best_member_score, direction)

    @property
    def choice(self) -> Literal["stacking", "best_member"]:
        """Stacking when it beats the best member out of fold on the evaluation split by more
        than the folds' standard error; else the best member is what to save. Never chosen on
        the test split: its scores stay honest."""
        wins = self.chosen_by.stacking_wins(direction_of(self.task, self.metric))
        return "stacking" if wins else "best_member"

    @property
    def saved_score(self) -> float:
        """The reported score of what is saved (the stack's or the best member's)."""
        return self.stacked_score if self.choice == "stacking" else self.best_member_score

    @property
    def how_measured(self) -> str:
        if self.measured_on == "test_split":
            return (
                "on the test split (data.test_file), which no trial and no fit saw; the "
                f"meta-learner, and stacking against the best member, were chosen by "
                f"{self.chosen_by.on}"
            )
        return (
            f"by {self.folds}-fold cross-validation on the evaluation split: each fold scored "
            "by what was fitted on the other folds (no test_file given)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "metric": self.metric,
            "measured_on": self.measured_on,
            "folds": self.folds,
            "how_measured": self.how_measured,
            "member_scores": self.member_scores,
            "best_member": {"name": self.best_member, "score": self.best_member_score},
            "soft_voting": {"score": self.soft_voting_score},
            "greedy_selection": {"score": self.selection_score, "weights": self.selection.weights},
            "stacking": {
                "scores": self.stacking_scores,
                "best_learner": self.best_learner,
                "params": self.stacked.params if self.stacked else [],
                "beats_best_member": self.stacking_beats_best_member,
            },
            "choice": self.choice,
            "chosen_by": self.chosen_by.to_json(),
            "saved_score": self.saved_score,
            "notes": self.notes,
        }


def evaluate_ensemble(
    task: str,
    evaluation: Split,
    test: Split | None = None,
    metric: str | None = None,
    learners: Sequence[str | Learner] | None = None,
    settings: FeatureSettings = PREDICTIONS,
    folds: int = CV_FOLDS,
    max_rounds: int = DEFAULT_ROUNDS,
    seed: int = 0,
) -> EnsembleReport:
    """Score every candidate honestly and fit the best learner on the whole evaluation split."""
    metric = metric_for(task, metric)
    check_predictions(task, evaluation.predictions, evaluation.labels, "evaluation")
    members = list(evaluation.predictions)
    chosen = resolve_learners(task, learners)
    fit = partial(_fit_on_evaluation, task, evaluation, metric, members, settings, seed)
    selection = greedy_selection(
        task, evaluation.predictions, evaluation.labels, metric, max_rounds
    )
    best = best_member(task, metric, evaluation.predictions, evaluation.labels)
    # Every choice (the learner; stacking or the best member) is made out of fold on the
    # evaluation split, never on the test split: a choice made there would make the score it
    # reports optimistic.
    out_of_fold = _cross_validated(
        task, metric, evaluation, members, chosen, settings, folds, max_rounds, seed
    )
    scores, fitted = out_of_fold, {}
    if test is not None:  # every learner fitted on the whole evaluation split, scored on test
        fitted = {lr.name: fit(lr) for lr in chosen}
        scores = _on_test(task, metric, test, members, fitted, selection, best)
    best_learner, chosen_by = _choose_learner(task, metric, chosen, out_of_fold, fitted, fit)
    report = EnsembleReport(
        task,
        metric,
        "cross_validation" if test is None else "test_split",
        chosen_by.folds if test is None else None,
        scores["_members"],
        best,
        float(scores["best_member"]),
        float(scores["soft_voting"]),
        selection,
        float(scores["selection"]),
        {lr.name: float(scores[f"stack:{lr.name}"]) for lr in chosen},
        best_learner,
        chosen_by,
        fitted[best_learner],
    )
    report.notes += _choice_notes(report)
    return report


def _fit_on_evaluation(
    task: str,
    evaluation: Split,
    metric: str,
    members: list[str],
    settings: FeatureSettings,
    seed: int,
    learner: Learner,
) -> StackedModel:
    features = evaluation.stack_features(members)
    outputs = _num_outputs(task, evaluation)
    return fit_stacked(
        task, learner, features, evaluation.labels, metric, members, settings, outputs, seed
    )


def _choose_learner(
    task: str,
    metric: str,
    learners: list[Learner],
    out_of_fold: Mapping[str, Any],
    fitted: dict[str, StackedModel],
    fit: Callable[[Learner], StackedModel],
) -> tuple[str, ChosenBy]:
    """The learner best out of fold, fitted on the whole evaluation split (into `fitted`),
    and what the choice between stacking and the best member is made on."""
    stacking = {lr.name: float(out_of_fold[f"stack:{lr.name}"]) for lr in learners}
    best_learner = _best_of(stacking, direction_of(task, metric))
    if best_learner not in fitted:  # cross-validation: only the best is fitted on every row
        fitted[best_learner] = fit(next(lr for lr in learners if lr.name == best_learner))
    chosen_by = ChosenBy(
        stacking[best_learner],
        float(out_of_fold["best_member"]),
        int(out_of_fold["_folds"]),
        _standard_error(out_of_fold["_fold_gains"][best_learner]),
    )
    return best_learner, chosen_by


def _standard_error(gains: Sequence[float]) -> float:
    """Of the mean of the folds' gains (0 with one fold, or folds that agree exactly)."""
    kept = np.asarray([g for g in gains if not np.isnan(g)], dtype=np.float64)
    return float(kept.std(ddof=1) / np.sqrt(len(kept))) if len(kept) > 1 else 0.0


def _choice_notes(report: EnsembleReport) -> list[str]:
    """Why the best member is saved; and, with a test split, where it disagrees with the
    choice made on the evaluation split (said, never acted on)."""
    notes = []
    cv = report.chosen_by
    if report.choice == "best_member":
        where = "" if report.measured_on == "cross_validation" else f" by {cv.on}"
        notes.append(
            f"stacking ({report.best_learner}, {cv.stacking:.4f}) is not better than the best "
            f"member ({report.best_member}, {cv.best_member:.4f}) by more than the folds' "
            f"standard error ({cv.standard_error:.4f}){where}: the best member is the choice"
        )
    if report.measured_on == "test_split" and report.stacking_beats_best_member != (
        report.choice == "stacking"
    ):
        chosen, verdict = (
            ("stacking", "it does not beat the best member")
            if report.choice == "stacking"
            else ("the best member", "stacking beats it")
        )
        notes.append(
            f"chosen by cross-validation on the evaluation split: {chosen}; on the test split "
            f"{verdict} ({report.stacked_score:.4f} against {report.best_member_score:.4f})"
        )
    return notes


def _best_of(scores: Mapping[str, float], direction: Direction) -> str:
    """The best-scoring name (the first of equals)."""
    best = next(iter(scores))
    for name, value in scores.items():
        if is_better(value, scores[best], direction):
            best = name
    return best


def _num_outputs(task: str, split: Split) -> int:
    first = np.asarray(next(iter(split.predictions.values())))
    return 1 if task == "regression" else int(first.shape[1])


def _on_test(
    task: str,
    metric: str,
    test: Split,
    members: list[str],
    fitted: Mapping[str, StackedModel],
    selection: Selection,
    best: str,
) -> dict[str, Any]:
    check_predictions(task, test.predictions, test.labels, "test")
    missing = [m for m in members if m not in test.predictions]
    if missing:
        raise EnsembleError(f"member {missing[0]!r} has no predictions on the test split")
    preds, labels = test.predictions, test.labels
    features = test.stack_features(members)
    scores: dict[str, Any] = {
        "_members": {m: score(task, metric, np.asarray(preds[m]), labels) for m in members},
        "best_member": score(task, metric, np.asarray(preds[best]), labels),
        "soft_voting": score(task, metric, average(preds, dict.fromkeys(members, 1.0)), labels),
        "selection": score(task, metric, average(preds, selection.weights), labels),
    }
    for name, model in fitted.items():
        scores[f"stack:{name}"] = score(task, metric, model.predict(features), labels)
    return scores


def _cross_validable(labels: Any) -> np.ndarray:
    labels = np.asarray(labels)
    if len(labels) < 2:
        raise EnsembleError(
            f"the evaluation split has {len(labels)} row(s): cross-validation needs 2 at least "
            "(more to mean anything); give a larger evaluation file"
        )
    return labels


def _cross_validated(
    task: str,
    metric: str,
    evaluation: Split,
    members: list[str],
    learners: list[Learner],
    settings: FeatureSettings,
    folds: int,
    max_rounds: int,
    seed: int,
) -> dict[str, Any]:
    """Out-of-fold outputs of every candidate: each fold predicted by what the other folds fit
    (the learner and its grid point, the selection, the choice of best member)."""
    labels = _cross_validable(evaluation.labels)
    preds = {m: np.asarray(evaluation.predictions[m], dtype=np.float64) for m in members}
    features = evaluation.stack_features(members)
    outputs = _num_outputs(task, evaluation)
    strata = labels if task == "sequence_classification" else np.zeros(len(labels))
    stratified = task if task == "sequence_classification" else "regression"  # plain K-fold
    splitter = fold_splitter(stratified, strata, folds, seed)
    shape = preds[members[0]].shape
    out: dict[str, np.ndarray] = {k: np.zeros(shape) for k in ("best_member", "selection")}
    out.update({f"stack:{lr.name}": np.zeros(shape) for lr in learners})
    held: list[np.ndarray] = []
    for fit_rows, held_rows in splitter.split(features, strata):
        held.append(held_rows)
        fit_preds = {m: p[fit_rows] for m, p in preds.items()}
        held_preds = {m: p[held_rows] for m, p in preds.items()}
        best = best_member(task, metric, fit_preds, labels[fit_rows])
        out["best_member"][held_rows] = held_preds[best]
        chosen = greedy_selection(task, fit_preds, labels[fit_rows], metric, max_rounds)
        out["selection"][held_rows] = average(held_preds, chosen.weights)
        fit_x, fit_y = features[fit_rows], labels[fit_rows]
        for lr in learners:
            model = fit_stacked(task, lr, fit_x, fit_y, metric, members, settings, outputs, seed)
            out[f"stack:{lr.name}"][held_rows] = model.predict(features[held_rows])
    scores: dict[str, Any] = {k: score(task, metric, v, labels) for k, v in out.items()}
    # Soft voting and single members fit nothing here: scored on every evaluation row.
    scores["soft_voting"] = score(task, metric, average(preds, dict.fromkeys(members, 1.0)), labels)
    scores["_members"] = {m: score(task, metric, p, labels) for m, p in preds.items()}
    scores["_folds"] = splitter.get_n_splits()
    gains = partial(_fold_gains, task, metric, best=out["best_member"], labels=labels, folds=held)
    scores["_fold_gains"] = {lr.name: gains(out[f"stack:{lr.name}"]) for lr in learners}
    return scores


def _fold_gains(
    task: str,
    metric: str,
    stacked: np.ndarray,
    best: np.ndarray,
    labels: np.ndarray,
    folds: list[np.ndarray],
) -> list[float]:
    """Stacking's score minus the best member's, on each fold's held-out rows."""
    return [
        score(task, metric, stacked[rows], labels[rows])
        - score(task, metric, best[rows], labels[rows])
        for rows in folds
    ]
