"""What the search space means for the size of the training set: hpo's default space fitted to
small data, and the warnings a worker gives at its start when trials would take too few steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from hpo.config import search_paths
from hpo.config.schema import Config
from hpo.config.space import DEFAULT_BATCH_CHOICES

BATCH = "effective_batch_size"
LEARNING_RATE = "learning_rate"
# The default space's batches leave an epoch at least this many optimizer steps: on 160
# examples its batch of 512 made one step per trial, which learns nothing.
MIN_STEPS_PER_EPOCH = 10
# A trial with fewer optimizer steps than this in all is warned of.
FEW_STEPS = 10
# The default learning rate's floor on small data: 1e-6 moves the weights by next to nothing in
# the few dozen steps such a trial takes.
SMALL_DATA_LR_LOW = 1e-5


def fit_default_space(config: Config, train_rows: int) -> str | None:
    """Where the default space's batch choices (searched because the config sets none) leave an
    epoch of `train_rows` examples fewer than MIN_STEPS_PER_EPOCH steps: the choices become the
    powers of two up to train_rows // MIN_STEPS_PER_EPOCH (as many as the default has) and the
    default learning rate starts at SMALL_DATA_LR_LOW. Returns the line that says so, or None
    (the space is left as it is: normal data, the user's own batches, a grid or an enqueued
    batch that the fitted choices could lose)."""
    batch = config.search_space.get(BATCH)
    if batch is None or BATCH not in config.default_params or not _may_fit(config):
        return None
    largest_fitting = max(1, train_rows // MIN_STEPS_PER_EPOCH)
    if max(int(choice) for choice in batch.choices or []) <= largest_fitting:
        return None
    choices = small_batch_choices(largest_fitting, len(DEFAULT_BATCH_CHOICES))
    ranks = config.training.world_size  # a trial across ranks splits each step evenly
    choices = [c for c in choices if c % ranks == 0] or [ranks]
    config.search_space[BATCH] = dataclasses.replace(batch, choices=list(choices))
    said = f"{BATCH} choices {choices} (at least {MIN_STEPS_PER_EPOCH} optimizer steps an epoch)"
    rate = config.search_space.get(LEARNING_RATE)
    if LEARNING_RATE in config.default_params and rate is not None and rate.low is not None:
        if rate.low < SMALL_DATA_LR_LOW:
            config.search_space[LEARNING_RATE] = dataclasses.replace(rate, low=SMALL_DATA_LR_LOW)
            said += f", {LEARNING_RATE} from {SMALL_DATA_LR_LOW:g} (it learns in few steps)"
    return (
        f"the default search space is fitted to the {train_rows} training examples: {said}; "
        f"set search_space.{BATCH} (and {LEARNING_RATE}) in the config to choose your own"
    )


def _may_fit(config: Config) -> bool:
    """A grid's size or an enqueued configuration's batch could change under it: not then."""
    if config.study.sampler.type == "grid":
        return False
    return not any(BATCH in params or LEARNING_RATE in params for params in config.study.enqueue)


def small_batch_choices(largest: int, count: int) -> list[int]:
    """The `count` largest powers of two up to `largest` (fewer when there are not as many)."""
    top = 1 << (max(1, largest).bit_length() - 1)
    choices = [top >> shift for shift in range(count) if top >> shift >= 1]
    return sorted(choices)


def largest_batch(config: Config) -> int:
    """The largest effective batch a trial can train with: the search space's largest choice
    or high end, else training.effective_batch_size."""
    return _searched_extreme(config, BATCH, max)


def fewest_epochs(config: Config) -> int:
    """The fewest epochs a trial can train for (training.epochs may be searched too)."""
    return _searched_extreme(config, "epochs", min)


def _searched_extreme(config: Config, field: str, pick: Callable[[list[int]], int]) -> int:
    """The largest or smallest (`pick`) value the search space gives training.`field`, else the
    config's own."""
    for name, spec in config.search_space.items():
        if search_paths.field_of(name) != ("training", field):
            continue
        if spec.choices is not None:
            return pick([int(choice) for choice in spec.choices])
        if spec.low is not None and spec.high is not None:
            return pick([int(spec.low), int(spec.high)])
    return int(getattr(config.training, field))


def step_warnings(config: Config, train_rows: int) -> list[str]:
    """One line per way the search space's largest effective batch leaves a trial too few
    optimizer steps on `train_rows` examples, naming the numbers and what to change: a batch
    larger than the training set, fewer than FEW_STEPS steps over the trial's epochs, or fewer
    steps an epoch
    than training.evals_per_epoch (its evaluations then fall on other fractions of an epoch
    than other trials', where the pruner compares them)."""
    if train_rows < 1:
        return []
    training = config.training
    largest = largest_batch(config)
    steps_per_epoch = math.ceil(train_rows / largest)
    # A short training.max_steps is taken as meant (a smoke test): only what the data and the
    # batch leave is warned of.
    epochs = fewest_epochs(config)
    steps = steps_per_epoch * epochs
    most_fitting = max(1, train_rows // MIN_STEPS_PER_EPOCH)
    change = (
        f"keep search_space.{BATCH} at most {most_fitting} ({MIN_STEPS_PER_EPOCH} steps an epoch)"
    )
    lines = []
    if largest > train_rows:
        lines.append(
            f"the training set has {train_rows} examples, but an effective batch can be "
            f"{largest} (search_space.{BATCH}): such a trial takes 1 optimizer step an epoch, "
            f"{steps} in all, and learns next to nothing; {change}"
        )
    elif steps < FEW_STEPS:
        lines.append(
            f"a trial with an effective batch of {largest} on the {train_rows} training examples "
            f"takes only {steps} optimizer steps ({steps_per_epoch} an epoch x {epochs} "
            f"epochs), fewer than {FEW_STEPS}; {change}, or raise training.epochs"
        )
    evals = training.evals_per_epoch
    if steps_per_epoch < evals:
        enough = max(1, train_rows // evals)  # a batch up to this leaves an epoch `evals` steps
        lines.append(
            f"an effective batch above {enough} (up to {largest}) leaves an epoch of "
            f"{train_rows} examples fewer optimizer steps than training.evals_per_epoch "
            f"({evals}): such trials evaluate after every step ({steps_per_epoch} an epoch), so "
            "their evaluation numbers fall later in training than other trials' and the pruner "
            f"compares unlike points; keep search_space.{BATCH} at most {enough} or lower "
            "training.evals_per_epoch"
        )
    return lines
