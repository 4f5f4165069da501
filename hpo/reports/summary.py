"""The worker's summary at the end of a run: trials by state, the best trial (or the Pareto front)
with its parameters and throughput, and loudly what left the study without checkpoints or a best
model.
"""

from __future__ import annotations

import optuna
from optuna.trial import FrozenTrial

from hpo.numbers import number_text
from hpo.reports import status as report
from hpo.study.front import rule_for
from hpo.study.kept_models import best_trials
from hpo.study.loop import values_text
from hpo.study.names import quoted_study_name


def summary_lines(study: optuna.Study, objectives: list[str]) -> list[str]:
    """What the user wants at the end: counts by state and the best trial (the Pareto front's
    trials for several objectives), and loudly what left the study without checkpoints or
    without its best model."""
    trials = study.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    state_text = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())) or "no trials"
    lines = [f"study {quoted_study_name(study.study_name)}: {len(trials)} trials ({state_text})"]
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not complete:
        lines.append("no completed trial yet, so no best trial")
    elif len(study.directions) > 1:
        lines += _front_lines(study, trials, objectives)
    else:
        lines += _best_lines(study.best_trial, objectives)
    best = report.best_trials(study, trials)
    return lines + report.checkpoint_warnings(best, report.lost_checkpoints(trials))


def _front_lines(
    study: optuna.Study, trials: list[FrozenTrial], objectives: list[str]
) -> list[str]:
    front = sorted(best_trials(trials, rule_for(study)), key=lambda t: t.number)
    lines = [f"Pareto front: {len(front)} trials"]
    for best in front:
        lines.append(f"  trial #{best.number}: {values_text(objectives, best.values)}")
    return lines


def _best_lines(best: FrozenTrial, objectives: list[str]) -> list[str]:
    lines = [f"best trial #{best.number}: {values_text(objectives, best.value)}"]
    for key, value in best.params.items():
        lines.append(f"  {key}: {number_text(value)}")
    attrs = best.user_attrs
    if "physical_batch_size" in attrs:
        line = (
            f"  physical batch {attrs['physical_batch_size']} x "
            f"{attrs.get('grad_accum_steps')} accumulation steps"
        )
        if "samples_per_s" in attrs:  # measured by hpo's trainer, not by a training function
            line += f", {attrs['samples_per_s']:.1f} samples/s on {attrs.get('device_name', '?')}"
        lines.append(line)
    return lines
