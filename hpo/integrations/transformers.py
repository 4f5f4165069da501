"""A transformers Trainer script tuned by hpo, as `Trainer.hyperparameter_search` users know it,
on hpo's workers: pruning at each evaluation, hpo's batch split, checkpoints in hpo's store.

Two forms. Your own Trainer, in a training function (`training.entrypoint`)::

    def train(ctx):
        args = trial_arguments(TrainingArguments(output_dir="out", eval_strategy="epoch"), ctx)
        trainer = Trainer(model=..., args=args, ..., callbacks=[HpoCallback(ctx)])
        trainer.train(resume_from_checkpoint=resume_checkpoint(ctx, args.output_dir))

or a Trainer built with `model_init`, searched as `hyperparameter_search` does::

    train = trainer_entrypoint(make_trainer, compute_objective=compute_objective)

    if __name__ == "__main__":
        best = hyperparameter_search(train, hp_space=hp_space, n_trials=20, study="mine")

Each evaluation is reported with step = its number in the trial (1, 2, ...), as hpo's own
trainer does, not the optimizer step: trials of different sampled batch sizes take different
numbers of steps, and the pruner compares trials at the same step. Evaluate at the same points
of every trial (eval_strategy="epoch", or eval_steps as a fraction of training, below 1).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import BestRun, HPSearchBackend, default_compute_objective

from hpo.errors import ConfigError
from hpo.plugins.context import TrainingContext

log = logging.getLogger(__name__)

OBJECTIVE = "objective"
"""The metric hyperparameter_search's study optimizes: compute_objective's value."""
DEFAULT_HP_SPACE = "transformers.trainer_utils:default_hp_space_optuna"
"""The search space when hyperparameter_search gets none: transformers' own default."""

ObjectiveFunction = Callable[[dict[str, float]], float]
# Sampled names that set the batch: hpo splits the effective batch into the per-device batch
# and the accumulation steps itself.
_BATCH_PARAMS = (
    "effective_batch_size",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
)
_CHECKPOINT = re.compile(r"checkpoint-\d+")
_RESTORED = "hpo-restored"  # the folder (under output_dir) hpo writes a restored checkpoint to


def exact_split(effective_batch_size: int, physical_batch_size: int) -> tuple[int, int]:
    """(per-device batch, accumulation steps) whose product is exactly the effective batch,
    with the per-device batch at most `physical_batch_size`. The Trainer's passes all have
    the same size, so the per-device batch must divide the effective batch: 64 with 36 that
    fit is 2 passes of 32; an effective batch with few divisors may give far smaller passes
    (a prime: passes of 1), so sample batch sizes such as powers of two."""
    if effective_batch_size < 1 or physical_batch_size < 1:
        raise ValueError(
            f"batch sizes must be >= 1, got effective {effective_batch_size} and "
            f"physical {physical_batch_size}"
        )
    steps = math.ceil(effective_batch_size / physical_batch_size)
    while effective_batch_size % steps:
        steps += 1
    return effective_batch_size // steps, steps


def effective_batch_size(args: TrainingArguments, params: Mapping[str, Any]) -> int:
    """Examples per optimizer step in this trial: the sampled effective_batch_size; else the
    sampled (or the arguments') per_device_train_batch_size times gradient_accumulation_steps,
    the batch a hyperparameter_search space meant."""
    if "effective_batch_size" in params:
        return int(params["effective_batch_size"])
    per_device = params.get("per_device_train_batch_size", args.per_device_train_batch_size)
    steps = params.get("gradient_accumulation_steps", args.gradient_accumulation_steps)
    return int(per_device) * int(steps)


def trial_settings(
    args: TrainingArguments, ctx: TrainingContext, probe: Callable[[int], Any] | None = None
) -> dict[str, Any]:
    """The TrainingArguments values of this trial: each sampled parameter that names a field
    (cast to the field's type, as Trainer.hyperparameter_search does), the device hpo gives,
    and the batch: per_device_train_batch_size = what fits, gradient_accumulation_steps =
    effective / that, exactly. `probe`: one training step at a given size, for hpo's batch
    finder (ctx.find_batch_size); without it, training.physical_batch_size or the whole
    effective batch. Parameters that name no field are left to your code (ctx.params)."""
    fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    settings: dict[str, Any] = {}
    for name, value in ctx.params.items():
        if name in fields and name not in _BATCH_PARAMS:
            settings[name] = _cast(name, getattr(args, name), value)
    others = [n for n in ctx.params if n not in fields and n not in _BATCH_PARAMS]
    if others:
        log.debug(
            "trial %d: %s name no TrainingArguments field (read them from ctx.params)",
            ctx.trial_number,
            ", ".join(others),
        )
    ctx.effective_batch_size = effective_batch_size(args, ctx.params)
    if probe is not None:
        ctx.find_batch_size(probe)
    per_device, steps = exact_split(ctx.effective_batch_size, ctx.physical_batch_size)
    ctx.use_physical_batch_size(per_device)
    settings["per_device_train_batch_size"] = per_device
    settings["gradient_accumulation_steps"] = steps
    if "use_cpu" in fields:  # training.device: cpu must hold even where CUDA is present
        settings["use_cpu"] = ctx.device.type == "cpu"
    return settings


def trial_arguments(
    args: TrainingArguments, ctx: TrainingContext, probe: Callable[[int], Any] | None = None
) -> TrainingArguments:
    """A copy of `args` with this trial's settings (see trial_settings)."""
    return dataclasses.replace(args, **trial_settings(args, ctx, probe))


def _cast(name: str, current: Any, value: Any) -> Any:
    """`value` as the type of the field's current value (an enum from its value, an int from a
    float), as Trainer.hyperparameter_search does; as it is when the field is None."""
    if current is None or isinstance(value, type(current)):
        return value
    kind = type(current)  # an enum is made from its value: SchedulerType("cosine")
    try:
        return kind(value)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"the sampled {name}={value!r} is no {kind.__name__}, the type of "
            f"TrainingArguments.{name}"
        ) from e


def probe_step(model: torch.nn.Module, batch: Mapping[str, Any]) -> Callable[[int], None]:
    """A step function for hpo's batch finder: one forward, backward and optimizer step of a
    copy of `model` (the run's own stays untouched) on `size` rows of `batch` (a batch as the
    Trainer's collator makes it, its rows repeated to reach the size)."""
    import copy

    def step(size: int) -> None:
        probe = copy.deepcopy(model)
        device = next(probe.parameters()).device
        rows = None
        inputs: dict[str, Any] = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                rows = torch.arange(size) % value.shape[0] if rows is None else rows
                inputs[key] = value[rows].to(device)
        output = probe(**inputs)
        loss = output["loss"] if isinstance(output, Mapping) else output[0]
        loss.backward()
        torch.optim.AdamW(probe.parameters()).step()

    return step


class HpoCallback(TrainerCallback):
    """Add it to your Trainer: each evaluation goes to hpo (ctx.report: the pruner may end the
    trial there, raising optuna.TrialPruned out of trainer.train()), a stop that hpo asks for
    (SIGTERM, the trial timeout) saves a checkpoint and ends training cleanly, and every
    checkpoint the Trainer writes is kept through hpo's store (ctx.save), where a retry of the
    trial finds it (resume_checkpoint).

    `compute_objective`: when given, its value is reported too, as metric "objective" (name it
    in study.metric). `checkpoint_root`: where the Trainer writes its checkpoint-N folders,
    when not args.output_dir."""

    def __init__(
        self,
        ctx: TrainingContext,
        compute_objective: ObjectiveFunction | None = None,
        checkpoint_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self.ctx = ctx
        self.compute_objective = compute_objective
        self.checkpoint_root = checkpoint_root
        self.reports = 0
        """Evaluations reported in this attempt of the trial."""
        self.saved_step: int | None = None
        """The optimizer step of the last checkpoint kept in hpo's store."""

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not metrics:
            return
        reported = reported_metrics(metrics, self.compute_objective)
        self.ctx.report(reported, step=evaluation_number(state, metrics, self.reports))
        self.reports += 1
        self._stop_if_asked(control)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._stop_if_asked(control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # A stopped Trainer still ends its epoch, and eval_strategy="epoch" would evaluate
        # there: a partial epoch's evaluation, compared by the pruner with other trials' full
        # ones. The checkpoint is written once.
        if self.ctx.should_stop:
            control.should_evaluate = False
            control.should_save = self.saved_step != state.global_step

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        root = Path(self.checkpoint_root or str(args.output_dir))
        folder = root / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            self.ctx.save(pack_checkpoint(folder))
            self.saved_step = state.global_step

    def _stop_if_asked(self, control: TrainerControl) -> None:
        if self.ctx.should_stop:  # save now (on_save keeps it in hpo's store), then stop
            control.should_save = True
            control.should_training_stop = True


def reported_metrics(
    metrics: Mapping[str, Any], compute_objective: ObjectiveFunction | None
) -> dict[str, float]:
    """The numbers among an evaluation's metrics, with compute_objective's value as
    "objective" when there is one."""
    numbers = {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    if compute_objective is not None:
        numbers[OBJECTIVE] = float(compute_objective(dict(metrics)))
    return numbers


def evaluation_number(state: TrainerState, metrics: Mapping[str, Any], reported: int) -> int:
    """This evaluation's number in the trial, from 1: the evaluations in the Trainer's log
    (which a resumed trial restores with its checkpoint, so it goes on counting); `reported`
    plus one when the metrics carry no runtime to recognise them by."""
    runtime = next((key for key in metrics if key.endswith("_runtime")), None)
    if runtime is None:
        return reported + 1
    return max(sum(1 for entry in state.log_history if runtime in entry), reported + 1)


def pack_checkpoint(folder: Path) -> dict[str, Any]:
    """A Trainer checkpoint folder as a state ctx.save can keep: its name and each file's
    bytes by path. Small models' checkpoints only: the whole folder is held in memory."""
    files = {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    return {"checkpoint": folder.name, "files": files}


def resume_checkpoint(ctx: TrainingContext, output_dir: str | os.PathLike[str]) -> str | None:
    """The checkpoint folder a retry of this trial resumes from (trainer.train's
    resume_from_checkpoint): the last one HpoCallback saved, written back from hpo's store
    under output_dir/hpo-restored; None on a first attempt."""
    state = ctx.restore()
    if state is None:
        return None
    name, files = state.get("checkpoint"), state.get("files")
    if not isinstance(name, str) or not _CHECKPOINT.fullmatch(name) or not isinstance(files, dict):
        raise ValueError(
            f"trial {ctx.trial_number}: the state in hpo's store is no Trainer "
            "checkpoint that HpoCallback saved"
        )
    restored = Path(output_dir) / _RESTORED
    folder = restored / name
    if restored.exists():  # hpo's own folder, from an earlier attempt
        shutil.rmtree(restored)
    for relative, data in files.items():
        path = (folder / relative).resolve()
        if not path.is_relative_to(folder.resolve()) or not isinstance(data, bytes):
            raise ValueError(
                f"trial {ctx.trial_number}: checkpoint file {relative!r} in hpo's "
                "store is not one HpoCallback saved"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    log.info("trial %d resumes from %s", ctx.trial_number, name)
    return str(folder)


@dataclasses.dataclass(frozen=True)
class TrainerEntrypoint:
    """A training function (`training.entrypoint`) that runs the Trainer `make_trainer` builds
    (with model_init) as Trainer.hyperparameter_search runs it: the trial's parameters set on
    its TrainingArguments by transformers' own search hooks, model_init(trial) given an
    optuna.trial.FixedTrial of them, each evaluation reported, and an evaluation at the end
    when training had none. Make it with trainer_entrypoint, at the top of your module."""

    make_trainer: Callable[[], Trainer]
    compute_objective: ObjectiveFunction = default_compute_objective
    module: str = ""  # where make_trainer lives: hyperparameter_search looks the object up there

    def __call__(self, ctx: TrainingContext) -> None:
        trainer = self.make_trainer()
        if not isinstance(trainer, Trainer) or trainer.model_init is None:
            raise TypeError(
                f"{_name(self.make_trainer)} must return a transformers Trainer "
                "built with model_init=, as for hyperparameter_search; got "
                f"{type(trainer).__name__}"
            )
        # model_init(trial) may read the parameters, or suggest them: a FixedTrial answers
        trial: Any = optuna.trial.FixedTrial(dict(ctx.params), number=ctx.trial_number)
        probe = _trainer_probe(trainer, trial) if ctx.device.type == "cuda" else None
        settings = trial_settings(trainer.args, ctx, probe)
        del probe  # its model and batch: the GPU memory goes back before training
        # What Trainer.hyperparameter_search sets: train() then applies hp_space's values to
        # the arguments (and remakes its accelerator), and writes checkpoints to run-<number>.
        trainer.hp_search_backend = HPSearchBackend.OPTUNA  # type: ignore[assignment]
        trainer.hp_space = lambda _trial: settings
        trainer.compute_objective = self.compute_objective
        run_dir = os.path.join(str(trainer.args.output_dir), f"run-{ctx.trial_number}")
        callback = HpoCallback(ctx, self.compute_objective, checkpoint_root=run_dir)
        trainer.add_callback(callback)
        trainer.train(resume_from_checkpoint=resume_checkpoint(ctx, run_dir), trial=trial)
        if callback.reports == 0 and not ctx.should_stop:
            trainer.evaluate()  # as hyperparameter_search: the value of a trial without any


def trainer_entrypoint(
    make_trainer: Callable[[], Trainer], compute_objective: ObjectiveFunction | None = None
) -> TrainerEntrypoint:
    """Each trial's training function for a Trainer built with model_init: assign it to a name
    at the top of your module (`train = trainer_entrypoint(make_trainer)`), which hpo imports
    in each trial process. `compute_objective`: an evaluation's metrics to the value the study
    optimizes (default: transformers' own, the eval loss, or the sum of the metrics)."""
    objective = compute_objective or default_compute_objective
    return TrainerEntrypoint(make_trainer, objective, getattr(make_trainer, "__module__", ""))


def hyperparameter_search(
    train: TrainerEntrypoint,
    hp_space: Callable[[optuna.Trial], dict[str, Any]] | None = None,
    n_trials: int = 20,
    direction: str = "minimize",
    *,
    study: str,
    storage: str | None = None,
    backend: str | None = None,
    timeout: float | None = None,
    device: str | None = None,
    **study_settings: Any,
) -> BestRun | None:
    """Trainer.hyperparameter_search on hpo: a worker on `study` (created, or joined: start one
    per GPU or host for more) runs trials until the study holds `n_trials`, each trial in a
    process of its own calling `train` (made by trainer_entrypoint); returns the study's best
    as transformers' BestRun (None before a trial completes).

    `hp_space`: a function of the Optuna trial returning the parameters (default: transformers'
    own); it and `train` must be defined at the top of a module hpo can import (your script,
    run as `python script.py`). `study_settings`: hpo's study: keys, e.g.
    pruner={"type": "median", "n_startup_trials": 2}, sampler=..., enqueue=[...]."""
    import hpo.api

    if backend not in (None, "optuna"):
        raise ConfigError(
            [f"backend: got {backend!r}; hpo's search is Optuna's: leave it out"],
            "hyperparameter_search",
        )
    if not isinstance(train, TrainerEntrypoint):
        raise ConfigError(
            [
                f"train: got {type(train).__name__}; give what trainer_entrypoint("
                "make_trainer) returned"
            ],
            "hyperparameter_search",
        )
    config = search_config(train, hp_space, n_trials, direction, device, study_settings)
    result = hpo.api.run(config, study=study, storage=storage, n_trials=n_trials, timeout=timeout)
    best = result.best
    if best is None or best.value is None:
        return None
    return BestRun(str(best.number), best.value, best.params)


def search_config(
    train: TrainerEntrypoint,
    hp_space: Callable[..., Any] | None,
    n_trials: int,
    direction: str,
    device: str | None,
    study_settings: Mapping[str, Any],
) -> dict[str, Any]:
    """hpo's config for hyperparameter_search: `train` and `hp_space` by import path, the
    study optimizing compute_objective's value ("objective") in `direction`."""
    if not isinstance(direction, str):
        raise ConfigError(
            [f"direction: got {direction!r}; give minimize or maximize (one objective)"],
            "hyperparameter_search",
        )
    training: dict[str, Any] = {"entrypoint": _spec_of(train, train.module, "train")}
    if device is not None:
        training["device"] = device
    space = DEFAULT_HP_SPACE if hp_space is None else _function_spec(hp_space, "hp_space")
    study = {**study_settings, "metric": OBJECTIVE, "direction": direction, "n_trials": n_trials}
    return {"training": training, "study": study, "search_space": space}


def _function_spec(function: Callable[..., Any], what: str) -> str:
    return _spec_of(function, getattr(function, "__module__", ""), what)


def _spec_of(value: object, module_name: str, what: str) -> str:
    """`module:name` of `value`, a name at the top of its module, as a trial process imports
    it: a script run as __main__ by its file's name (its folder is first on the path)."""
    module = sys.modules.get(module_name)
    name = next((k for k, v in vars(module).items() if v is value), None) if module else None
    if module is None or name is None:
        raise ConfigError(
            [
                f"{what}: {_name(value)} is not a name at the top of a module; hpo "
                "imports it in each trial process: define it there"
            ],
            "hyperparameter_search",
        )
    if module_name != "__main__":
        return f"{module_name}:{name}"
    file = getattr(module, "__file__", None)
    stem = Path(file).stem if file else ""
    if not stem.isidentifier():
        raise ConfigError(
            [
                f"{what}: defined in {file or 'an interactive session'}, which a "
                "trial process cannot import: put it in a .py file whose name is a "
                "Python identifier"
            ],
            "hyperparameter_search",
        )
    return f"{stem}:{name}"


def _name(value: object) -> str:
    return str(getattr(value, "__qualname__", None) or type(value).__name__)


def _trainer_probe(trainer: Trainer, trial: Any) -> Callable[[int], None]:
    """hpo's batch finder's step for this Trainer: its model_init's model on a batch of its
    training data, as its collator pads it."""
    model = trainer.call_model_init(trial).to(trainer.args.device)
    batch = next(iter(trainer.get_train_dataloader()))
    return probe_step(model, batch)
