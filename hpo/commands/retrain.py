"""hpo retrain: a final model from a study (the plan and its results are hpo.study.retrain's),
trained by the same workers as hpo run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shlex
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpo.commands.requests import RetrainRequest
from hpo.commands.run import (
    WorkerInputs,
    check_inputs,
    stopped_before_first_trial,
    work_on_study,
    worker_inputs,
)
from hpo.config.loader import DEMO_CONFIG
from hpo.config.schema import Config
from hpo.errors import HPOError
from hpo.stopping import Interrupted, StopRequest
from hpo.storage.url import StorageURL
from hpo.study.names import checked_study_name

log = logging.getLogger("hpo")


def retrain_command(request: RetrainRequest) -> int:
    """`hpo retrain`: see hpo.study.retrain."""
    import optuna

    from hpo.reports import model_card
    from hpo.storage import open_storage
    from hpo.study import retrain
    from hpo.study.join import open_study
    from hpo.tracking import registry

    name = checked_study_name(request.run.study)  # NFC before --out's default is named for it
    # Its worker processes (several GPUs) run the same command as workers of this retrain.
    run = dataclasses.replace(request.run, study=name, worker_flags=("--as-worker",))
    request = dataclasses.replace(request, run=run)
    stop = StopRequest(interrupt_at_once=True, doing=StopRequest.BEFORE_FIRST_TRIAL)
    stop.install()
    out = request.out if request.out is not None else retrain.default_out(name)
    inputs = None
    opened: list[Any] = []

    def open_source(config: Config, storage_url: StorageURL) -> None:
        """The study to retrain, found before the data is prepared; --out checked first."""
        if not request.as_worker:  # before any training: a bad --out is found in seconds
            retrain.check_out(out, name, storage_url.masked)
            if request.register is not None:
                registry.check_register(config, request.register)
        on_demand = config.study.database_connections == "on_demand"
        storage = open_storage(
            storage_url, config.study.database_patience, must_exist=True, on_demand=on_demand
        )
        try:
            study_id = storage.get_study_id_from_name(name)
        except KeyError as e:
            raise HPOError(f"no study {name!r} in {storage_url.masked}; see `hpo studies`") from e
        if run.config is None:  # the demo's config: refused at once unless the study ran with it
            retrain.check_demo_config(storage.get_study_user_attrs(study_id), config, name)
            log.warning(
                "no --config given: using the demo config %s, which study %r ran with",
                DEMO_CONFIG,
                name,
            )
        # Its pool closed again: the worker may copy itself next (hpo.trial.worker_copy), and
        # the copy and its trial processes would hold a connection of the worker's open.
        storage.engine.dispose()
        opened.append(storage)

    with contextlib.suppress(Interrupted):
        inputs = worker_inputs(check_inputs(run, before_data=open_source, say_demo=False))
    stop.interrupt_at_once = False  # a signal is only noted now; the loop stops the trial
    if inputs is None or stop.requested:
        return stopped_before_first_trial(stop)
    config, storage_url, storage = inputs.config, inputs.storage_url, opened[0]
    source = optuna.load_study(study_name=name, storage=storage)
    plan = retrain.make_plan(source, config, request.top, request.seeds, run.config is not None)
    plan = retrain.stored_plan(storage, plan.study_name) or plan  # a resumed retrain
    retrain_config = retrain.study_config(config, plan)
    print(
        f"hpo: retraining {len(plan.configs)} configurations of study {name!r} with "
        f"{len(plan.seeds)} seeds each, in study {plan.study_name!r} in "
        f"{storage_url.describe()}",
        file=sys.stderr,
    )
    if stop.requested:
        return stopped_before_first_trial(stop)
    study = open_study(storage, plan.study_name, retrain_config)
    retrain.queue_runs(storage, study, plan)
    work = dataclasses.replace(inputs, config=retrain_config)
    code = _retrain_runs(study, storage, work, stop, request)
    if request.as_worker and code is None and request.full_data:
        # A worker of several GPUs also runs the full-data run, once the winner's is queued.
        with contextlib.suppress(KeyError):
            storage.get_study_id_from_name(plan.full_data_study_name)
            full = open_study(storage, plan.full_data_study_name, retrain_config)
            code = _retrain_runs(full, storage, work, stop, request)
    if code is not None or request.as_worker:
        return code or 0
    found = retrain.results(study, plan)
    direction = study.directions[0]
    winner = retrain.pick_winner(found, direction, len(plan.seeds))
    if winner is None:
        print(
            f"hpo: no retrain run of study {plan.study_name!r} completed; see "
            f"`hpo status --study {shlex.quote(plan.study_name)}`",
            file=sys.stderr,
        )
        return 1
    chosen = retrain.best_run(winner, direction)
    model_study, model_trial = study, chosen["trial"]
    full_data_trial = None
    if request.full_data:
        model_study = open_study(storage, plan.full_data_study_name, retrain_config)
        retrain.queue_full_data_run(storage, model_study, plan, winner)
        code = _retrain_runs(model_study, storage, work, stop, request)
        if code is not None:
            return code
        full_data_trial = retrain.full_data_trial(model_study, winner)
        if full_data_trial is None:
            print(
                "hpo: the full-data run did not complete; see `hpo status --study "
                f"{shlex.quote(plan.full_data_study_name)}`",
                file=sys.stderr,
            )
            return 1
        model_trial = full_data_trial
    metric = config.study.primary_metric
    card = model_card.model_card(
        plan, found, winner, chosen, config, metric, full_data_trial, storage_url.masked
    )
    if config.training.entrypoint is not None:
        # A training function keeps its own model: the runs' values over seeds are the outcome.
        print(model_card.summary(card, None))
        return 0
    with winner_model(model_study, model_trial, config, out) as model_dir:
        retrain.save_final_model(model_dir, out, card, model_card.card_markdown(card))
    source.set_user_attr(retrain.OUTCOME_ATTR, retrain.outcome(card, out))
    print(model_card.summary(card, out))
    if request.register is not None:
        trial = next(t for t in model_study.get_trials(deepcopy=False) if t.number == model_trial)
        try:
            registered = registry.register_winner(
                config,
                request.register,
                model_study.study_name,
                trial,
                out,
                card,
                model_card.card_markdown(card),
            )
        except HPOError as e:  # the model is saved: a rerun registers it, training nothing
            print(f"hpo: {e}", file=sys.stderr)
            return 1
        print(f"registered in MLflow's model registry: {registered}")
    if stop.requested:  # exit 0 all the same: nothing is left to do, a rerun would redo nothing
        print(
            f"hpo: {stop.signal_name} came during the final save, which was finished first",
            file=sys.stderr,
        )
    return 0


@contextlib.contextmanager
def winner_model(study: Any, number: int, config: Config, out: Path) -> Iterator[Path]:
    """The winning run's model folder: on this host, or (trained on another host) fetched from
    the artifact store beside `out`, checked against its sha256, and removed afterwards."""
    import tempfile

    from hpo.storage.artifacts import ArtifactStore, ArtifactStoreError
    from hpo.study import retrain
    from hpo.trial.folders import folder_name, study_folder_name

    local = retrain.model_folder(study, number)
    if (local / "config.json").is_file() or config.study.artifact_store is None:
        yield local
        return
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    scratch = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".fetch"))
    try:
        store = ArtifactStore(config.study.artifact_store)
        slug = study_folder_name(study.study_name)
        if store.fetch(slug, folder_name(trial), "best-model", scratch / "model") is None:
            yield local  # not in the store either: save_final_model says so
        else:
            yield scratch / "model"
    except ArtifactStoreError as e:
        raise HPOError(
            f"the winning run's model is not on this host and not fetched from "
            f"{config.study.artifact_store}: {e}"
        ) from e
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _retrain_runs(
    study: Any, storage: Any, work: WorkerInputs, stop: StopRequest, request: RetrainRequest
) -> int | None:
    """Run a retrain study's queued runs (here, or on the workers of several GPUs) until none
    is left, none running anywhere; None when done, else the exit code (stopped, or a worker
    failed)."""
    from hpo.study import retrain

    while True:
        code = work_on_study(study, storage, work, stop, request.run, queued_only=True)
        if stop.requested or code != 0:
            return _retrain_stopped(stop, code, request)
        if request.as_worker or not retrain.unfinished(study):
            return None
        # Runs are still unfinished: one was handed back, or queued again by a sweep, after
        # this worker's loop had ended. Run the loop again.


def _retrain_stopped(stop: StopRequest, code: int, request: RetrainRequest) -> int:
    if stop.signal_name is not None and not request.as_worker:
        print(
            f"hpo: stopped by {stop.signal_name}; run the same hpo retrain again to resume",
            file=sys.stderr,
        )
    return stop.exit_code if stop.requested else code
