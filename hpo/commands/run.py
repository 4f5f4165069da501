"""hpo run: every input checked before anything is written, then the worker's trials, in this
process or in one worker process per GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo import live, tracking
from hpo.commands.follow import FollowersTold, follow, following_place, leading_place
from hpo.commands.requests import RunRequest
from hpo.config.budget import budget_problems
from hpo.config.loader import DEMO_CONFIG, load_config, parse_config, with_entrypoint
from hpo.config.schema import Config
from hpo.errors import ConfigError, HPOError
from hpo.logs import set_optuna_verbosity, setup_logging
from hpo.services import ARTIFACT_STORE_ATTR
from hpo.stopping import Interrupted, StopRequest
from hpo.storage.url import StorageURL
from hpo.study.names import checked_study_name, quoted_study_name

if TYPE_CHECKING:
    from hpo.storage.artifacts import ArtifactURL
log = logging.getLogger("hpo")


def configure_logging(debug: bool, quiet: bool) -> None:
    setup_logging(logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO)


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """How a worker's run ended: its study (None when stopped before it was opened) and
    storage, the trials this worker finished (None: its worker processes ran them), the signal
    that stopped it and the exit code the CLI gives."""

    study: Any
    storage: Any
    config: Config | None
    trials_run: int | None
    stopped_by: str | None
    exit_code: int
    where: str | None = None
    """The study's database as a user reads it (a password masked)."""
    followed: bool = False
    """This host followed another host's trials (training.distributed.nodes)."""


def run_command(request: RunRequest) -> int:
    outcome = run_study(request)
    if outcome.followed:
        return outcome.exit_code
    if outcome.study is not None and outcome.config is not None:
        from hpo.reports.summary import summary_lines

        print("\n".join(summary_lines(outcome.study, outcome.config.study.objectives)))
    if outcome.study is None:
        print(f"hpo: stopped by {outcome.stopped_by} before the first trial", file=sys.stderr)
    elif outcome.stopped_by is not None:
        print(f"hpo: stopped by {outcome.stopped_by}", file=sys.stderr)
    return outcome.exit_code


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def run_study(request: RunRequest, say: Callable[[str], None] = _to_stderr) -> RunOutcome:
    """`hpo run` and hpo.run: check every input, create or join the study, run the worker's
    trials. `say` gets the lines a user reads as the run starts (the CLI prints them)."""
    with FollowersTold(say) as told:  # on the first host of trials across hosts
        outcome = _run_study(request, say, told)
        told.ended(outcome.exit_code, stopped=outcome.stopped_by is not None)
    return outcome


def _run_study(request: RunRequest, say: Callable[[str], None], told: FollowersTold) -> RunOutcome:
    # From the start: a SIGTERM or Ctrl-C while torch loads and the data is prepared stops
    # the worker at once, before anything is written: no traceback, no signal's exit code.
    stop = StopRequest(interrupt_at_once=True, doing=StopRequest.BEFORE_FIRST_TRIAL)
    stop.exit_on_second = not request.in_notebook
    stop.install()
    inputs, place = None, None
    with contextlib.suppress(Interrupted):
        checked = check_inputs(request)
        place = following_place(checked.config, checked.gpus)
        told.place = leading_place(checked.config)
        inputs = worker_inputs(checked) if place is None else None
    if place is not None and not stop.requested:  # a host that follows: no study, no data
        stop.interrupt_at_once = False
        code = follow(checked.config, place, stop, say)
        return RunOutcome(None, None, checked.config, None, stop.signal_name, code, followed=True)
    # From here a signal is only noted, never raised: the study is not left half-written. The
    # loop says "stopping the running trial" once it starts one (hpo.study.loop).
    stop.interrupt_at_once = False
    if inputs is None or stop.requested:
        return RunOutcome(None, None, None, 0, stop.signal_name, stop.exit_code)
    config, storage_url = inputs.config, inputs.storage_url
    from hpo.storage import open_storage
    from hpo.study.join import open_study

    say(f"hpo: study {quoted_study_name(inputs.study)} in {storage_url.describe()}")
    on_demand = config.study.database_connections == "on_demand"
    storage = open_storage(storage_url, config.study.database_patience, on_demand=on_demand)
    if stop.requested:  # a signal came while the database opened: no study is created
        return RunOutcome(None, storage, config, 0, stop.signal_name, stop.exit_code)
    allow_changed = request.allow_changed_setup
    study = open_study(storage, inputs.study, config, allow_changed, request.from_python)
    if config.study.artifact_store is not None:
        from hpo.storage.artifacts import ArtifactStore

        ArtifactStore(config.study.artifact_store).create()  # a file store's folder, if missing
        # For `hpo best` and `hpo status`, which have no config.
        study.set_user_attr(ARTIFACT_STORE_ATTR, config.study.artifact_store)
        say(f"hpo: checkpoints and best models go to {config.study.artifact_store}")
    code, finished = work_and_count(study, storage, inputs, stop, request)
    where = storage_url.describe()
    return RunOutcome(study, storage, config, finished, stop.signal_name, code, where)


def stopped_before_first_trial(stop: StopRequest) -> int:
    print(f"hpo: stopped by {stop.signal_name} before the first trial", file=sys.stderr)
    return stop.exit_code


def work_on_study(
    study: Any,
    storage: Any,
    inputs: WorkerInputs,
    stop: StopRequest,
    request: RunRequest,
    queued_only: bool = False,
) -> int:
    """Run the study's trials (`queued_only`: its queued ones): in this process, or in one
    worker process per GPU (each runs the same command with the request's worker_flags
    added)."""
    return work_and_count(study, storage, inputs, stop, request, queued_only)[0]


def work_and_count(
    study: Any,
    storage: Any,
    inputs: WorkerInputs,
    stop: StopRequest,
    request: RunRequest,
    queued_only: bool = False,
) -> tuple[int, int | None]:
    """work_on_study's exit code, and the trials this worker finished (None: its worker
    processes ran them)."""
    from hpo.commands.launcher import run_workers
    from hpo.storage.batch_cache import BatchSizeCache
    from hpo.study.loop import run_trials
    from hpo.trial.objective import Objective

    config, gpus, per_gpu = inputs.config, inputs.gpus, inputs.workers_per_gpu
    if len(gpus) * per_gpu > 1:
        storage.engine.dispose()  # its workers connect; this process holds none meanwhile
        argv = [*request.argv, *request.worker_flags]
        env = dict(request.worker_env) if request.worker_env is not None else None
        return run_workers(gpus, argv, per_gpu, stop, env), None
    stop.interrupt_at_once = config.study.trial_isolation == "none"
    if not request.quiet:
        live.start()  # a progress line below the log, on a terminal only
    cache = BatchSizeCache(storage.engine)  # the worker's pool: no connection of its own
    objective = Objective(
        config, inputs.data, inputs.storage_url, stop, batch_cache=cache, prepared=inputs.prepared
    )
    try:
        finished = run_trials(study, storage, objective, stop, queued_only, started=request.started)
    finally:
        live.stop()
        stop.interrupt_at_once = False
    return (stop.exit_code if stop.requested else 0), finished


@dataclasses.dataclass(frozen=True)
class CheckedInputs:
    """What check_inputs found good: the study's name (NFC), the config with the request's
    overrides, the database, the worker's GPUs (none: the CPU or the one GPU set up in this
    process) and workers per GPU as asked, and how its trial processes start."""

    study: str
    config: Config
    config_path: Path | None
    """The config's file (None: hpo.run's mapping)."""
    storage_url: StorageURL
    gpus: list[str]
    workers_per_gpu: int | str | None
    copy_worker: bool
    """Its trial processes come from a copy of this worker (see copies_itself)."""
    native_threads: int | None
    """With copy_worker: the native threads running before the user's modules were loaded."""


@dataclasses.dataclass(frozen=True)
class WorkerInputs:
    """What a worker runs its trials with: the checked inputs, the prepared data (None: the
    user's training function reads its own), the workers per GPU decided, and the data of
    every other model the search may choose (by hpo.trial.task.data_key)."""

    study: str
    config: Config
    storage_url: StorageURL
    gpus: list[str]
    data: Any
    workers_per_gpu: int
    prepared: dict[str, Any]


def worker_inputs(checked: CheckedInputs) -> WorkerInputs:
    """Where a worker's work starts, once its inputs are checked: the fork server of its trial
    processes (a copy of this worker, before the data's tokenizer threads, the study or any
    thread), then the data prepared and checked against the config (a bad one writes nothing
    yet: the study is opened after)."""
    config, per_gpu = checked.config, checked.workers_per_gpu
    user_function = config.training.entrypoint is not None
    if checked.copy_worker:
        from hpo.trainer.device import resolve_device
        from hpo.trial.fork_start import start_fork_server

        start_fork_server(user_function, checked.native_threads)
        # torch's own check now: a driver that NVML sees and CUDA cannot use (older than
        # torch's CUDA) is reported here, not by every trial.
        resolve_device(config.training.device)
    if user_function:
        # --workers-per-gpu auto measures hpo's own model: one worker per GPU for a function
        per = per_gpu if isinstance(per_gpu, int) else 1
        return WorkerInputs(checked.study, config, checked.storage_url, checked.gpus, None, per, {})
    data, prepared = _prepare_every_model(config)
    named = f", labels {data.label_names}" if data.label_names else ""
    log.info(
        "data: %d training and %d evaluation examples%s", len(data.train), len(data.eval), named
    )
    problems = config.training.data_problems(data.label_names)
    if problems:
        raise ConfigError([f"training.{k}: got {value!r}; {rule}" for k, value, rule in problems])
    _fit_to_data_size(config, len(data.train))
    workers = per_gpu if isinstance(per_gpu, int) else None
    if per_gpu == "auto":
        workers = _auto_workers_per_gpu(config, checked.config_path, checked.gpus)
    return WorkerInputs(
        checked.study, config, checked.storage_url, checked.gpus, data, workers or 1, prepared
    )


def check_inputs(
    request: RunRequest,
    before_data: Callable[[Config, StorageURL], None] | None = None,
    say_demo: bool = True,
) -> CheckedInputs:
    """Every input of `hpo run` but the data, checked before anything is written: a bad one
    writes nothing. The cheap checks first: the database and the artifact store are reached
    once, the device found, the user's modules loaded. The data is prepared and checked next,
    by worker_inputs (it takes seconds, minutes on a real set). `before_data` checks what it
    must (retrain: that the study exists) before the data is prepared. `say_demo`: say here
    that the demo config is used when no --config is given (retrain says it once it knows the
    study ran with it)."""
    from hpo.storage.artifacts import resolve_artifact_url
    from hpo.storage.url import resolve_storage_url

    study = checked_study_name(request.study, request.option("study"))
    config_path = request.config if request.config is not None else DEMO_CONFIG
    if request.config is None and not DEMO_CONFIG.is_file():
        raise HPOError("no --config given and the demo config is not installed; pass --config FILE")
    config = config_from(config_path, request.entrypoint)
    _apply_overrides(config, request)
    tracking.resolve(config, request.tracking, request.option("tracking"))
    storage_url = resolve_storage_url(
        request.storage, config.study.storage, request.option("storage")
    )
    artifacts = resolve_artifact_url(request.artifact_store, config.study.artifact_store)
    config.study.artifact_store = artifacts.url if artifacts is not None else None
    _check_memory_share()
    per_gpu = request.workers_per_gpu
    spec = "auto" if request.gpus is None and per_gpu is not None else request.gpus
    gpus = _worker_gpus(config, spec, request.option("gpus"))
    _check_gpu_layout(config, gpus, per_gpu, request)
    _check_stores(storage_url, artifacts)
    if before_data is not None:
        before_data(config, storage_url)
    if request.config is None and say_demo:  # once the input is known good: bad input, one line
        # A user in their own folder who forgot --config would otherwise train the demo's data
        # into their ./hpo.db without a word.
        log.warning(
            "no --config given: using the demo config %s (synthetic review sentiment); "
            "pass --config FILE to train on your own data",
            DEMO_CONFIG,
        )
    copy_worker = copies_itself(request, config, gpus, per_gpu)
    threads = _load_user_code(config, copy_worker)
    path = Path(config_path) if isinstance(config_path, (str, os.PathLike)) else None
    return CheckedInputs(study, config, path, storage_url, gpus, per_gpu, copy_worker, threads)


def _load_user_code(config: Config, copy_worker: bool) -> int | None:
    """The device found and the user's modules loaded (each one line if it cannot be); with
    `copy_worker`, what the fork server preloads imported first. Returns the native threads
    running before the user's modules (None without copy_worker)."""
    # Only now the heavy imports: a config or URL error is reported in well under a second.
    from hpo.trainer.device import resolve_device
    from hpo.trial.worker_copy import use_nvml_for_cuda_checks

    if copy_worker:
        use_nvml_for_cuda_checks()  # torch's CUDA check leaves the driver unloaded until the copy
    set_optuna_verbosity(logging.getLogger().level)
    # The device first: `cuda` on a host without CUDA is reported before the data is prepared.
    resolve_device(config.training.device)
    from hpo.plugins.loading import check_trial_processes_import, load_plugin, load_user_code
    from hpo.trial.fork_start import prepare_fork_server

    user_function = config.training.entrypoint is not None
    threads = prepare_fork_server(user_function) if copy_worker else None
    if config.search_space_function is not None:  # the user's define-by-run search space
        load_plugin(config.search_space_function, config.base_dir, "search_space")  # one line
    load_user_code(config)  # metrics, task, model.factory: imported again in each trial process
    check_trial_processes_import(config)
    if config.training.entrypoint is not None:  # the user's function reads its own data
        from hpo.plugins.entrypoint import load_entrypoint

        load_entrypoint(config.training.entrypoint, config.base_dir)  # one line if it cannot
    return threads


def _fit_to_data_size(config: Config, train_rows: int) -> None:
    """Before the study records its search space: the default space fitted to a small training
    set, and a WARNING line for each way a trial would still take too few steps (issue 42: 160
    examples, a batch of 512, one optimizer step per trial and not a word)."""
    from hpo.config.data_size import fit_default_space, step_warnings

    fitted = fit_default_space(config, train_rows)
    if fitted is not None:
        log.warning(fitted)
    for line in step_warnings(config, train_rows):
        log.warning(line)


def copies_itself(
    request: RunRequest, config: Config, gpus: list[str], per_gpu: int | str | None
) -> bool:
    """Whether this worker's trial processes come from a copy of it (hpo.trial.worker_copy):
    only in a process that is the `hpo` command alone (a user's process, hpo.run's or a test's,
    may have run torch's OpenMP pool or started threads of its own) and runs its trial
    processes itself (not one worker process per GPU)."""
    if not request.own_process or config.study.trial_isolation != "process":
        return False
    return isinstance(per_gpu, int | None) and len(gpus) * (per_gpu or 1) <= 1


def config_from(
    source: str | os.PathLike[str] | Mapping[str, Any], entrypoint: str | None = None
) -> Config:
    """The config of a file, or of a mapping as `yaml.safe_load` gives it (hpo.run's dict):
    checked by the same rules, its relative paths taken from the working folder.
    `entrypoint`: training.entrypoint set over the config's (hpo.run's argument)."""
    if isinstance(source, (str, os.PathLike)):
        path = source if isinstance(source, (str, Path)) else Path(source)
        return load_config(path, entrypoint)
    if not isinstance(source, Mapping):
        raise ConfigError(
            [
                f"the config must be a file path or a mapping of sections, got "
                f"{type(source).__name__}"
            ]
        )
    raw = with_entrypoint(_as_yaml_values(source), entrypoint)
    return parse_config(raw, Path.cwd(), paths_from="the working folder")


def _as_yaml_values(value: Any) -> Any:
    """`value` as YAML would hand it over: a path as its text, a tuple as a list; a copy, so
    that nothing of the caller's is changed."""
    if isinstance(value, Mapping):
        return {key: _as_yaml_values(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_yaml_values(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _prepare_every_model(config: Config) -> tuple[Any, dict[str, Any]]:
    """The config's data, and that of each other model the search may choose, each checked
    against its model before the first trial (its config loads, it holds the longest
    data.max_length, its dropout settings exist, every token id has an embedding): a bad
    choice is one line now, not a failure in every trial that draws it."""
    from hpo.config.search_paths import with_params
    from hpo.trainer.errors import TrainerError
    from hpo.trainer.model import check_data_fits_model, check_model_config, load_tokenizer
    from hpo.trainer.tasks import prepare_data
    from hpo.trial.task import data_key

    prepared: dict[str, Any] = {}
    for params in model_choices(config):
        job = with_params(config, params)
        try:
            model_config = check_model_config(job.model, job.data.max_length, job.task)
            key = data_key(job)
            if key not in prepared:
                tokenizer = load_tokenizer(job.model, job.task)
                prepared[key] = prepare_data(job.data, tokenizer, job.task, job.training)
            check_data_fits_model(job.model, model_config, prepared[key])
        except TrainerError as e:
            if not params:
                raise
            choice = ", ".join(f"{name}: {value}" for name, value in params.items())
            raise HPOError(f"{e} (with the search's {choice})") from e
    data = prepared.pop(data_key(with_params(config, {})), None)
    if data is None:  # the config's own data settings are not among the choices' (max_length)
        data = prepare_data(
            config.data, load_tokenizer(config.model, config.task), config.task, config.training
        )
    return data, prepared


def model_choices(config: Config) -> list[dict[str, Any]]:
    """A configuration per model the search may choose, with what makes a model fail at once:
    the longest data.max_length searched, and a model.dropout (where it applies) to be set."""
    from hpo.config.schema import applies

    space = config.search_space
    models = space.get("model.name_or_path")
    choices: list[dict[str, Any]] = (
        [{"model.name_or_path": model} for model in models.choices or []] if models else [{}]
    )
    for params in choices:
        for name in ("data.max_length", "model.dropout"):
            spec = space.get(name)
            if spec is not None and _may_apply(spec, params, applies):
                params[name] = max(spec.values_for_bounds())
    return choices


def _may_apply(spec: Any, params: dict[str, Any], applies: Callable[..., bool]) -> bool:
    """Whether `spec` can apply to a trial with `params`: its conditions on other parameters
    (not decided here) are taken to hold."""
    known = {name: values for name, values in (spec.when or {}).items() if name in params}
    return applies(dataclasses.replace(spec, when=known), params)


def _check_stores(storage_url: StorageURL, artifacts: ArtifactURL | None) -> None:
    """The study database reached (credentials, Optuna's tables or the right to create them)
    and the artifact store tried (a probe written, read and deleted), writing nothing: a
    permanent refusal is one line now, not a wait of study.artifact_patience in every trial."""
    from hpo.storage.artifacts import ArtifactStore
    from hpo.storage.preflight import check_database

    check_database(storage_url)
    if artifacts is not None:
        ArtifactStore(artifacts.url).check()


def _check_memory_share() -> None:
    from hpo.trainer.memory_share import memory_share

    try:
        memory_share()
    except ValueError as e:
        raise HPOError(f"{e}, or unset it") from e


def _check_gpu_layout(
    config: Config, gpus: list[str], per_gpu: int | str | None, request: RunRequest
) -> None:
    """Workers per GPU need a GPU to share; a trial across GPUs needs enough of them."""
    if config.training.world_size > 1:
        _check_gpus_per_trial(config, gpus, per_gpu, request)
    if not gpus and isinstance(per_gpu, int) and per_gpu > 1:
        raise HPOError(
            f"{request.option('workers_per_gpu')} {per_gpu}: no GPU to share on this host; "
            "leave it out to run one worker on the CPU"
        )


def _check_gpus_per_trial(
    config: Config, gpus: list[str], per_gpu: int | str | None, request: RunRequest
) -> None:
    """A trial across GPUs owns them whole (no --workers-per-gpu); a worker on CUDA without
    --gpus (which groups them) trains each trial on the GPUs it sees: enough of them."""
    from hpo.commands.launcher import FAKE_GPUS_ENV, visible_gpus

    if per_gpu not in (None, 1):
        raise HPOError(
            f"{request.option('workers_per_gpu')} {per_gpu}: a trial across GPUs "
            "(training.distributed) owns its GPUs whole; leave it out"
        )
    device = config.training.device
    if gpus:
        return
    if device == "cpu" or device.startswith("cuda:") or os.environ.get(FAKE_GPUS_ENV):
        return  # a CPU run (gloo ranks), or cuda:N, which the device check refuses as it is
    visible = visible_gpus()  # NVML's count: this process initialises no CUDA
    wanted = config.training.ranks_per_node
    if (device == "cuda" or visible) and len(visible) < wanted:
        raise ConfigError(
            [
                f"training.distributed.gpus_per_trial: {wanted} GPUs per trial, but this worker "
                f"sees {len(visible)}; lower it, or run where {wanted} GPUs are visible"
            ]
        )


def _auto_workers_per_gpu(config: Config, config_path: Path | None, gpus: list[str]) -> int:
    """`--workers-per-gpu auto` on the first GPU (the others are taken to be alike)."""
    from hpo.commands.launcher import choose_workers_per_gpu

    if not gpus:  # said, since --workers-per-gpu 2 is refused here
        log.info("--workers-per-gpu auto: 1 worker, on the CPU (no GPU on this host to share)")
        return 1
    from hpo.config.search_paths import batch_search_bound, largest_effective_batch

    largest = largest_effective_batch(config)
    bound = batch_search_bound(config)
    if config_path is None:  # hpo.run refuses it first: its workers read the config's file
        raise HPOError("workers_per_gpu 'auto': give the config as a file path")
    workers, why = choose_workers_per_gpu(str(config_path), gpus[0], largest, bound)
    log.info("--workers-per-gpu auto: %d workers per GPU (%s)", workers, why)
    return workers


def _worker_gpus(config: Config, spec: str | None, flag: str = "--gpus") -> list[str]:
    """With --gpus, the GPUs to start workers on; one of them (or the CPU) is set up to run in
    this very process."""
    from hpo.commands.launcher import FAKE_GPUS_ENV, gpu_groups, select_gpus, visible_gpus
    from hpo.logs import WORKER_LABEL_ENV

    if spec is None:
        return []
    per_trial = config.training.ranks_per_node
    gpus = gpu_groups(select_gpus(spec, visible_gpus(), flag), per_trial, flag)
    if not gpus:
        if spec.strip().lower() == "auto":
            log.info("no GPU visible on this host: one worker on the CPU")
        config.training.device = "cpu"
    elif len(gpus) == 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]  # before anything initialises CUDA
        os.environ[WORKER_LABEL_ENV] = f"gpu{gpus[0].replace(',', '+')}"
        setup_logging(logging.getLogger().level)  # log lines now name the GPU
        config.training.device = "cpu" if os.environ.get(FAKE_GPUS_ENV) else "cuda"
    return gpus


def _apply_overrides(config: Config, request: RunRequest) -> None:
    problems = []
    if request.n_trials is not None:
        if request.n_trials < 1:
            flag = request.option("n_trials")
            problems.append(f"{flag}: got {request.n_trials}; must be a positive integer")
        config.study.n_trials = request.n_trials
    if request.budget_device_hours is not None:
        for _, value, rule in budget_problems(request.budget_device_hours):
            problems.append(f"{request.option('budget_device_hours')}: got {value}; {rule}")
        config.study.budget_device_hours = request.budget_device_hours
    if request.timeout is not None:
        if not 0 < request.timeout < math.inf:
            flag = request.option("timeout")
            problems.append(f"{flag}: got {request.timeout}; must be a finite number > 0 seconds")
        config.study.timeout = request.timeout
    if request.trial_timeout is not None:
        if not 0 < request.trial_timeout < math.inf:
            problems.append(
                f"{request.option('trial_timeout')}: got {request.trial_timeout}; must be a finite "
                "number > 0 seconds"
            )
        config.study.trial_timeout = request.trial_timeout
    for name in ("gpus", "workers_per_gpu"):
        if getattr(request, name) is not None and request.device is not None:
            problems.append(
                f"{request.option('device')}: cannot be combined with "
                f"{request.option(name)}, which sets the GPU"
            )
    if request.device is not None:
        config.training.device = request.device
        for key, value, rule in config.training.problems():
            if key == "device":
                problems.append(f"{request.option('device')}: got {value!r}; {rule}")
    if problems:
        raise ConfigError(problems, "hpo.run" if request.from_python else "command line")
    if request.device is not None and request.device.startswith("cuda"):
        from hpo.trainer.device import resolve_device

        resolve_device(request.device, request.option("device"))  # as typed, not training.device
