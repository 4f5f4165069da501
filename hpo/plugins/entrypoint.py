"""A user's own training function (`training.entrypoint: package.module:name`): imported and
checked before any trial, and what it may return (its metrics, a number, or None: the last
ctx.report) turned into the trial's values. hpo.trial.own_function calls it in a trial.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpo.plugins.context import TrainingContext, checked_metrics, number_of
from hpo.plugins.loading import load_plugin

TrainingFunction = Callable[[TrainingContext], Any]


class TrainingFunctionError(Exception):
    """The user's training function raised, or returned what cannot be the trial's value."""


def load_entrypoint(spec: str, base_dir: str) -> TrainingFunction:
    """The function `spec` names (`package.module:name`); one line (ConfigError) when the
    module does not import, lacks the name, or the name is not callable."""
    return load_plugin(spec, base_dir, "training.entrypoint")


def trial_values(
    returned: Any, context: TrainingContext, objectives: list[str], spec: str
) -> list[float]:
    """The trial's value of each objective: from the metrics the function returned, or (it
    returned None) from its last ctx.report."""
    metric = objectives[0]
    if returned is None:
        if context.last_metrics is None:
            example = f"{{{metric!r}: value}}"
            raise TrainingFunctionError(
                f"{spec} returned None and never called ctx.report: "
                f"return the metrics, e.g. {example}"
            )
        metrics = context.last_metrics
    elif (number := number_of(returned)) is not None:  # a numpy scalar, a 1-element tensor...
        if len(objectives) > 1:
            raise TrainingFunctionError(
                f"{spec} returned a number; with several objectives "
                f"return a dict with {', '.join(objectives)}"
            )
        metrics = {metric: number}
    elif isinstance(returned, dict):
        metrics = checked_metrics(returned, metric, f"the dict {spec} returned")
    else:
        raise TrainingFunctionError(
            f"{spec} returned {type(returned).__name__}; expected a dict of metrics with "
            f"{metric!r}, a number, or None (the last ctx.report counts)"
        )
    missing = [name for name in objectives if name not in metrics]
    if missing:
        raise TrainingFunctionError(
            f"{spec}: no {', '.join(missing)} among the final metrics "
            f"({', '.join(metrics)}); study.metric names them"
        )
    context.last_metrics = metrics
    return [metrics[name] for name in objectives]
