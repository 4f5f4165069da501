"""A trial that calls the user's training function (`training.entrypoint`) with a
TrainingContext, and how it ended turned into Optuna's terms (complete, pruned, stopped to
resume, failed with the user's traceback kept).
"""

from __future__ import annotations

import time
from typing import Any

import optuna

from hpo.plugins.context import ReportError, TrainingContext
from hpo.plugins.entrypoint import TrainingFunctionError, load_entrypoint, trial_values
from hpo.plugins.loading import record_failure
from hpo.plugins.protocols import TrialLike
from hpo.stopping import Interrupted, TrialTimedOut
from hpo.trainer import device as dev
from hpo.trainer.checkpoint import CheckpointStore, job_fingerprint
from hpo.trial.folders import trial_folder_maker
from hpo.trial.protocol import TrialValue
from hpo.trial.task import TrialTask
from hpo.trial.training import (
    TrainingClock,
    give_up_uploads,
    hand_over,
    last_upload_wait_s,
    raise_stopped,
    record_checkpoint_cost,
    record_uploads,
    start_uploader,
    take_cpu_share,
)


def train_with_entrypoint(trial: TrialLike, task: TrialTask) -> TrialValue:
    """The trial's target when the config names a training function: call it with a context,
    then return its metrics' values (one per objective)."""
    started = time.perf_counter()
    config = task.config
    spec = config.training.entrypoint or ""
    function = load_entrypoint(spec, config.base_dir)
    trial.set_user_attr("entrypoint", spec)
    take_cpu_share(trial, task, config.training.device)
    clock = TrainingClock(config.study.trial_timeout)
    store, uploader = _checkpoints(trial, task)
    context = _context(trial, task, store, clock)
    send = getattr(trial, "send_progress", None)
    if send is not None:
        send({})  # the worker's clock for study.trial_timeout starts too
    try:
        if clock.should_stop():  # asked to stop before the function began: nothing to save
            raise_stopped(clock)
        returned = function(context)
        if clock.should_stop():  # it returned because it was asked to stop: a retry resumes
            trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
            if store is not None:
                hand_over(trial, task, store, uploader)
            raise_stopped(clock)
        values = trial_values(returned, context, config.study.objectives, spec)
    except optuna.TrialPruned:
        give_up_uploads(uploader, task)
        raise
    except TrialTimedOut:  # it returned at ctx.should_stop past the timeout: pruned, not failed
        raise
    except TrainingFunctionError as e:  # what it returned: hpo's frames, no user traceback
        give_up_uploads(uploader, task)
        trial.set_user_attr("fail_reason", str(e))
        raise
    except ReportError as e:
        give_up_uploads(uploader, task)
        _record_failure(trial, spec, e, started)
        raise
    except (Exception, SystemExit) as e:
        give_up_uploads(uploader, task)
        _record_failure(trial, spec, e, started)
        if isinstance(e, SystemExit):  # sys.exit() in user code ends its trial, not the process
            raise TrainingFunctionError(f"{spec} raised SystemExit: {e}") from e
        raise  # as it is: `hpo status` counts failures by the user's own error
    except KeyboardInterrupt as e:
        if isinstance(e, Interrupted):  # hpo's own: the worker was asked to stop
            raise
        # The user's own raise: a real Ctrl-C never reaches the function (the trial process
        # ignores SIGINT; a worker that trains itself raises Interrupted).
        give_up_uploads(uploader, task)
        _record_failure(trial, spec, e, started)
        raise TrainingFunctionError(f"{spec} raised KeyboardInterrupt") from e
    _record_end(trial, context, started)
    if uploader is not None:
        uploader.discard("state")  # the trial is over: the state already stored will do
        done = uploader.close(timeout_s=last_upload_wait_s(task))
        record_uploads(trial, store, uploader, done)  # type: ignore[arg-type]
    if store is not None and (store.seconds or store.errors):  # it called ctx.save
        record_checkpoint_cost(trial, store)
    return values[0] if len(values) == 1 else values


def _checkpoints(trial: TrialLike, task: TrialTask) -> tuple[CheckpointStore | None, Any]:
    """The trial's checkpoint folder (and the artifact store's uploader), for ctx.save and
    ctx.restore; none when the study keeps no checkpoints."""
    if task.checkpoint_dir is None:
        return None, None
    remake = trial_folder_maker(task.study_name) if task.study_name else None
    store = CheckpointStore(task.checkpoint_dir, resume=task.resume, make_directory=remake)
    return store, start_uploader(trial, task, store)


def spec_of(config: Any) -> str:
    return str(config.training.entrypoint)


def _context(
    trial: TrialLike, task: TrialTask, store: CheckpointStore | None, clock: TrainingClock
) -> TrainingContext:
    config = task.config
    effective = task.params.get("effective_batch_size", config.training.effective_batch_size)
    context = TrainingContext(
        params=dict(task.params),
        device=dev.resolve_device(config.training.device),
        effective_batch_size=int(effective),
        trial_number=trial.number,
        metric=config.study.primary_metric,
        _trial=trial,
        _training=config.training,
        _should_stop=clock.should_stop,
        _store=store,
        _fingerprint=job_fingerprint({"entrypoint": spec_of(config), "params": task.params}),
        _prunes=config.study.pruned_metric is not None,
        _pruned_metric=config.study.pruned_metric or config.study.primary_metric,
    )
    return context


def _record_failure(trial: TrialLike, spec: str, error: BaseException, started: float) -> None:
    record_failure(trial, spec, error, started, "the training function")


def _record_end(trial: TrialLike, context: TrainingContext, started: float) -> None:
    trial.set_user_attr("metrics", context.last_metrics)
    trial.set_user_attr("physical_batch_size", context.physical_batch_size)
    trial.set_user_attr("grad_accum_steps", context.grad_accum_steps)
    trial.set_user_attr("wall_s", round(time.perf_counter() - started, 3))
