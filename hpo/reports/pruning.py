"""What pruning did in a finished study: how many trials it stopped, and the study's own learning
curves replayed under other pruners, so a user sees whether pruning paid on their task."""

from __future__ import annotations

import math
from dataclasses import dataclass

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpo.config.schema import PrunerConfig
from hpo.study.sampling import build_pruner

# The pruners a study's curves are replayed under, with hpo's settings of each.
ALTERNATIVES: list[tuple[str, PrunerConfig]] = [
    ("hpo's default (the median rule, margin 0.02, from evaluation 2)", PrunerConfig()),
    ("successive halving", PrunerConfig(type="successive_halving")),
    ("the median rule without a margin", PrunerConfig(type="median", n_warmup_steps=1, margin=0)),
    ("hyperband", PrunerConfig(type="hyperband")),
    ("no pruning", PrunerConfig(type="none")),
]


@dataclass
class Outcome:
    """The study's trials, in order, under one pruner."""

    evaluations: int  # evaluations run; a trial stopped at evaluation k counts k
    pruned: int
    best: FrozenTrial | None  # the best trial it lets finish
    # Trials the study pruned that this pruner would have let go on: their later curve is not
    # known, so they count as stopping where the study stopped them, with no final value.
    unknown: int


def replay(
    trials: list[FrozenTrial], direction: StudyDirection, pruner: PrunerConfig, name: str
) -> Outcome:
    """The trials' recorded evaluations, one trial after another in the study's order, each
    evaluation shown to `pruner` as a real trial reports it. `name`: the study's, which
    Hyperband draws each trial's bracket from (the same brackets as the study's own)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=name,
        direction=direction,
        pruner=build_pruner(pruner),
        sampler=optuna.samplers.RandomSampler(0),
    )
    evaluations = pruned = unknown = 0
    best: FrozenTrial | None = None
    for trial in trials:
        replayed = study.ask()
        stopped = False
        for step, value in sorted(trial.intermediate_values.items()):
            replayed.report(value, step)
            evaluations += 1
            if replayed.should_prune():
                stopped = True
                break
        if stopped or trial.state != TrialState.COMPLETE:
            study.tell(replayed, state=TrialState.PRUNED)
            pruned += stopped
            unknown += not stopped  # the study stopped it; this pruner would not have
            continue
        study.tell(replayed, trial.value)
        if best is None or _better(trial, best, direction):
            best = trial
    return Outcome(evaluations, pruned, best, unknown)


def _better(trial: FrozenTrial, than: FrozenTrial, direction: StudyDirection) -> bool:
    assert trial.value is not None and than.value is not None
    if direction == StudyDirection.MAXIMIZE:
        return trial.value > than.value
    return trial.value < than.value


def lines(study: optuna.Study, trials: list[FrozenTrial]) -> list[str]:
    """What pruning did, and what the other pruners would have done with the same curves; no
    lines for a study of several objectives (hpo does not prune those) or without curves."""
    if len(study.directions) != 1:
        return []
    finished = sorted(
        (
            t
            for t in trials
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and t.intermediate_values
        ),
        key=lambda t: t.number,
    )
    if not finished:
        return []
    direction = study.direction
    pruned = sum(t.state == TrialState.PRUNED for t in finished)
    used = sum(len(t.intermediate_values) for t in finished)
    # Unpruned, each pruned trial would have run as long as the study's longest complete trial.
    longest = max(
        (len(t.intermediate_values) for t in finished if t.state == TrialState.COMPLETE), default=0
    )
    whole = sum(
        len(t.intermediate_values) if t.state == TrialState.COMPLETE else longest for t in finished
    )
    found = [
        f"pruning: {pruned} of {len(finished)} trials pruned; the study ran {used} "
        f"evaluations{_share(used, whole)}"
    ]
    own = _best(finished, direction)
    for name, config in ALTERNATIVES:
        outcome = replay(finished, direction, config, study.study_name)
        if name == "no pruning":
            outcome.evaluations = whole  # the pruned trials' full length, not where they stopped
        found.append(
            f"{name} would have used {_share(outcome.evaluations, used, 'this')}: "
            f"{_said(outcome, own)}"
        )
    found.append(
        "(the study's own curves replayed, trial by trial in its order: the same trials, as if "
        "the sampler had proposed them again; a trial the study pruned has no later curve)"
    )
    return found


def _best(trials: list[FrozenTrial], direction: StudyDirection) -> FrozenTrial | None:
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    if not complete:
        return None
    pick = max if direction == StudyDirection.MAXIMIZE else min
    return pick(complete, key=lambda t: t.value if t.value is not None else math.nan)


def _share(part: int, whole: int, of: str = "unpruned") -> str:
    if of == "this":
        return f"{part / whole:.0%} of this study's evaluations" if whole else f"{part} evaluations"
    return (
        f", {part / whole:.0%} of the {whole} the same trials would run unpruned" if whole else ""
    )


def _said(outcome: Outcome, own: FrozenTrial | None) -> str:
    if outcome.best is None:
        found = "no trial finished"
    elif own is not None and outcome.best.number == own.number:
        found = f"the same best (trial #{own.number}, {own.value:.4f})"
    else:
        found = f"a different best: trial #{outcome.best.number}, {outcome.best.value:.4f}"
    if outcome.pruned:
        found += f"; {_trials(outcome.pruned)} pruned"
    if outcome.unknown:
        found += (
            f"; {_trials(outcome.unknown)} this study pruned would have gone on (their later "
            "evaluations are unknown: counted as stopping where they stopped)"
        )
    return found


def _trials(count: int) -> str:
    return f"{count} trial" if count == 1 else f"{count} trials"
