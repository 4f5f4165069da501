"""Create or join a study and run trials on it, ask-and-tell, until the study's own trial
budget is spent. The budget (`n_trials`) counts the study's trials in storage, not this
process's; see hpo/trials.py for how many workers share it.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from hpo import cpu_share, report
from hpo import progress as live
from hpo.checkpoints import best_trials, checkpoint_root, folder_name
from hpo.config import (
    Config,
    ParamSpec,
    PrunerConfig,
    SamplerConfig,
    StudyConfig,
    grid_points,
    objective_list,
    space_record,
)
from hpo.errors import ConfigError
from hpo.front import CHANCE_ATTR, TOLERANCE_ATTR, rule_for
from hpo.objective import Objective, worker_id
from hpo.pruners import MarginPruner
from hpo.stopping import HandBack, Interrupted, StopRequest, TakenOver
from hpo.trials import StudyTrials, counted_trials
from storage.artifacts import ArtifactStore
from storage.engine import StudyStorage
from storage.tables import check_version
from trainer.files import STATE_FILE

log = logging.getLogger(__name__)
# How long a worker done with its trials lets its last cleanup of the artifact store go on.
ARTIFACT_CLEANUP_WAIT_S = 60.0

# How many workers have joined the study: the next one's index, for its sampler seed.
WORKERS_ATTR = "hpo:workers_joined"
QUEUED_BY_ATTR = "queued_by"  # study.enqueue or hpo enqueue, on a queued trial


def build_sampler(
    cfg: SamplerConfig, worker_index: int = 0, space: dict[str, ParamSpec] | None = None
) -> optuna.samplers.BaseSampler:
    """The study's sampler for the `worker_index`-th worker to join the study; the grid
    sampler needs the search `space`."""
    seed = worker_seed(cfg.seed, worker_index)
    if cfg.type == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if cfg.type == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=cfg.n_startup_trials)
    if cfg.type == "cmaes":
        return optuna.samplers.CmaEsSampler(
            seed=seed, n_startup_trials=cfg.n_startup_trials, warn_independent_sampling=False
        )
    if cfg.type == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if cfg.type == "qmc":
        return optuna.samplers.QMCSampler(seed=seed, warn_independent_sampling=False)
    if cfg.type == "grid":
        grid = {name: grid_points(spec) for name, spec in (space or {}).items()}
        if not grid or any(points is None for points in grid.values()):
            raise ValueError("the grid sampler needs a finite search space")  # config checks it
        return optuna.samplers.GridSampler(grid, seed=seed)  # type: ignore[arg-type]
    with _experimental_features():
        return optuna.samplers.TPESampler(
            seed=seed,
            n_startup_trials=cfg.n_startup_trials,
            multivariate=cfg.multivariate is not False,
            group=cfg.group,
            constant_liar=cfg.constant_liar,
        )


def worker_seed(seed: int | None, worker_index: int) -> int | None:
    """Workers that share a sampler seed draw the same random trials: each worker of a study
    gets its own seed, derived from the configured one and the order it joined the study in.
    The first worker uses the configured seed itself, so a single worker stays reproducible."""
    if seed is None or worker_index == 0:
        return seed
    digest = hashlib.sha256(f"hpo-worker-seed/{seed}/{worker_index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def build_pruner(cfg: PrunerConfig) -> optuna.pruners.BasePruner:
    pruner = _base_pruner(cfg)
    if cfg.patience is None:
        return pruner
    wrapped = None if isinstance(pruner, optuna.pruners.NopPruner) else pruner
    with _experimental_features():
        return optuna.pruners.PatientPruner(wrapped, patience=cfg.patience, min_delta=cfg.min_delta)


@contextlib.contextmanager
def _experimental_features() -> Iterator[None]:
    """TPE's multivariate, group and constant_liar, the PatientPruner and metric names are
    "experimental" in Optuna (for years now): one warning per worker that tells a user of hpo
    nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def _base_pruner(cfg: PrunerConfig) -> optuna.pruners.BasePruner:
    if cfg.type in ("median", "percentile") and cfg.margin > 0:
        percentile = 50.0 if cfg.type == "median" else cfg.percentile
        return MarginPruner(percentile, cfg.n_startup_trials, cfg.n_warmup_steps, cfg.margin)
    if cfg.type == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=cfg.n_startup_trials, n_warmup_steps=cfg.n_warmup_steps
        )
    if cfg.type == "percentile":
        return optuna.pruners.PercentilePruner(
            cfg.percentile, n_startup_trials=cfg.n_startup_trials, n_warmup_steps=cfg.n_warmup_steps
        )
    min_resource = cfg.min_resource if cfg.min_resource is not None else "auto"
    if cfg.type == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=min_resource, reduction_factor=cfg.reduction_factor
        )
    if cfg.type == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=cfg.min_resource or 1, reduction_factor=cfg.reduction_factor
        )
    return optuna.pruners.NopPruner()


def open_study(storage: StudyStorage, name: str, config: Config) -> optuna.Study:
    """Create the study, or join it if it exists with the same direction and search space.
    The check and the first worker's record of the search space happen under the study's lock:
    two workers creating one study with different spaces cannot both succeed."""
    check_version(storage.engine)  # a database of another hpo's layout: refused, nothing written
    directions = config.study.resolved_directions
    optuna.create_study(
        storage=storage, study_name=name, directions=directions, load_if_exists=True,
        sampler=optuna.samplers.RandomSampler(),  # this worker's own sampler is built below
    )  # fmt: skip
    study_id = storage.get_study_id_from_name(name)
    existing = [d.name.lower() for d in storage.get_study_directions(study_id)]
    if existing != directions:
        raise ConfigError(
            [
                f"study.direction: study {name!r} already exists and is {_said(existing)}, but "
                f"this config says {_said(directions)}; use another --study name or the same "
                "metric"
            ],
            config.source,
        )
    with storage.lock(study_id):
        _check_study_settings(storage, study_id, name, config)
        _say_budget_change(storage, study_id, name, config.study.n_trials)
        # The budget of the latest worker to join, for `hpo status --watch` to know the end.
        storage.set_study_user_attr(study_id, "n_trials", config.study.n_trials)
        # The Pareto front's tolerance of throughput noise (hpo.front), the latest worker's.
        storage.set_study_user_attr(study_id, TOLERANCE_ATTR, config.study.throughput_tolerance)
        # When a running trial's silence means its worker is gone, for `hpo status`.
        storage.set_study_user_attr(study_id, "grace_period_s", liveness(config.study)[1])
        worker_index = int(storage.get_study_system_attrs(study_id).get(WORKERS_ATTR, 0))
        storage.set_study_system_attr(study_id, WORKERS_ATTR, worker_index + 1)
    pruner = build_pruner(config.study.pruner)
    if len(directions) > 1 and not isinstance(pruner, optuna.pruners.NopPruner):
        log.info("study %r has %d objectives: pruning is off (Optuna's pruners serve one "
                 "objective)", name, len(directions))  # fmt: skip
        pruner = optuna.pruners.NopPruner()
    study = optuna.load_study(
        study_name=name,
        storage=storage,
        sampler=build_sampler(config.study.sampler, worker_index, config.search_space),
        pruner=pruner,
    )
    # Named metrics: the dashboard shows "accuracy", not "Objective 0".
    if study.metric_names != config.study.objectives:
        with _experimental_features():
            study.set_metric_names(config.study.objectives)
    if config.study.enqueue:
        budget = config.study.n_trials
        if budget is not None and len(config.study.enqueue) > budget:
            count = len(config.study.enqueue)
            log.warning("study.enqueue lists %d configurations but n_trials is %d: the ones "
                        "past the budget stay queued", count, budget)  # fmt: skip
        with storage.lock(study_id):
            for params in config.study.enqueue:
                enqueue(study, params, "study.enqueue")
    return study


def enqueue(study: optuna.Study, params: dict[str, Any], by: str = "hpo enqueue") -> bool:
    """Queue a configuration to try next, unless a trial of the study (in any state) was
    queued or ran with exactly these parameters; whether it was queued. Call it under the
    study's lock: two workers must not both queue it. `by` (the trial's `queued_by`) is said
    in the log when the trial starts."""
    before = len(study.get_trials(deepcopy=False))
    study.enqueue_trial(params, user_attrs={QUEUED_BY_ATTR: by}, skip_if_exists=True)
    return len(study.get_trials(deepcopy=False)) > before


def _say_budget_change(storage: StudyStorage, study_id: int, name: str, budget: int | None) -> None:
    """Each worker counts the study's trials against its own budget: one that joins with
    another n_trials than the last one's (a rerun without --n-trials, say) grows or ends the
    study at its own; said in one line, as it may not be what was meant."""
    attrs = storage.get_study_user_attrs(study_id)
    if "n_trials" not in attrs or attrs["n_trials"] == budget:  # a new study, or the same
        return
    log.warning("study %r had a budget of %s; this worker's is %s (--n-trials or "
                "study.n_trials), which now applies", name, _budget_text(attrs["n_trials"]),
                _budget_text(budget))  # fmt: skip


def _budget_text(budget: int | None) -> str:
    return "no limit" if budget is None else f"{budget} trials"


def _check_study_settings(storage: StudyStorage, study_id: int, name: str, config: Config) -> None:
    """The first worker records the study's metrics, search space and sampler; every later one
    must have the same metrics and search space (a study that mixed accuracy and macro-F1
    values would compare unlike numbers)."""
    space = space_record(config.search_space)
    attrs = storage.get_study_user_attrs(study_id)
    if "search_space" not in attrs:
        storage.set_study_user_attr(study_id, "metric", config.study.metric)
        storage.set_study_user_attr(study_id, "search_space", space)
        storage.set_study_user_attr(study_id, "sampler", config.study.sampler.type)
        return
    stored_metric = attrs.get("metric")
    if stored_metric is not None and objective_list(stored_metric) != config.study.objectives:
        raise ConfigError(
            [
                f"study.metric: study {name!r} optimises {stored_metric}, but this config says "
                f"{config.study.metric}; use the study's metric or another --study name"
            ],
            config.source,
        )
    stored = attrs["search_space"]
    differ = sorted(k for k in stored.keys() | space.keys() if stored.get(k) != space.get(k))
    if differ:
        raise ConfigError(
            [
                f"search_space: study {name!r} was created with another search space "
                f"(it differs in {', '.join(differ)}); every worker of a study needs the "
                "same search space: use the study's config or another --study name"
            ],
            config.source,
        )


def run_trials(
    study: optuna.Study,
    storage: StudyStorage,
    objective: Objective,
    stop: StopRequest,
    queued_only: bool = False,
    started: float | None = None,
) -> int:
    """Run trials until the study holds n_trials, this worker's timeout passes or it is asked
    to stop; returns how many trials this worker finished. A failing trial is recorded as FAIL
    (one line in the log) and never stops the worker; an interrupted one is handed back.
    `queued_only` (a retrain): run queued trials only, and stay while other workers' trials
    run, so that a retry of one whose worker dies is run here. The timeout counts from
    `started` (time.monotonic() when the worker started: preparing the data is part of its
    time), else from now."""
    study_config = objective.task.config.study
    trials = StudyTrials(study, storage, worker_id(), study_config.n_trials,
                         liveness(study_config), queued_only)  # fmt: skip
    deadline = None
    if study_config.timeout is not None:
        deadline = (time.monotonic() if started is None else started) + study_config.timeout
    checkpoints, artifacts = None, None
    if study_config.checkpoints:
        checkpoints = checkpoint_root(objective.task.config, study.study_name)
        if study_config.artifact_store is not None:
            artifacts = ArtifactStore(study_config.artifact_store)
    if objective.trains and len(study.directions) > 1:
        _record_chance_level(study, objective)
    in_worker = study_config.trial_isolation == "none"
    # On the CPU, counted among the host's workers, so that their trials share its cores.
    host = cpu_share.registered() if objective.trains_on_cpu() else contextlib.nullcontext()
    if in_worker:
        # What is alive now (torch, transformers, the data) outlives every trial: frozen out of
        # the collection that frees each trial's memory (150 ms a trial otherwise).
        gc.freeze()
    try:
        with host as entry:
            objective.cpu_worker = entry
            return _trial_loop(trials, objective, stop, (checkpoints, artifacts), deadline,
                               collect=in_worker)  # fmt: skip
    finally:
        if not stop.requested:  # done with its trials: its last cleanup of the store may end
            trials.finish_cleanup(ARTIFACT_CLEANUP_WAIT_S)
        objective.close()
        if in_worker:
            gc.unfreeze()


def _record_chance_level(study: optuna.Study, objective: Objective) -> None:
    """What guessing scores on the evaluation split: no trial at that level is on the Pareto
    front (hpo.front)."""
    from trainer.metrics import chance_levels

    data = objective.task.data
    study.set_user_attr(CHANCE_ATTR, chance_levels(data.eval.labels, data.num_labels))


def _trial_loop(
    trials: StudyTrials,
    objective: Objective,
    stop: StopRequest,
    kept: tuple[Path | None, ArtifactStore | None],
    deadline: float | None,
    collect: bool,
) -> int:
    """`kept`: where checkpoints live, the local folder and the artifact store."""
    checkpoints, artifacts = kept
    ran = 0
    while not stop.requested:
        if deadline is not None and time.monotonic() >= deadline:
            log.info("timeout reached; starting no new trial")
            break
        trials.sweep_if_due()
        trial = trials.next_trial(checkpoints)
        if trial is None:
            if _wait_for_silent_trials(trials, stop):
                continue  # swept: a dead worker's trial may be queued again now
            if trials.queued_only and _wait_for_other_workers(trials, stop):
                continue
            if trials.queued_only:
                log.info("no queued trial left in study %r; stopping", trials.study.study_name)
                return ran
            waiting = len(trials.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
            queued = f"; {waiting} queued trials wait for a larger n_trials" if waiting else ""
            held = counted_trials(trials.study.get_trials(deepcopy=False))
            log.info("study %r holds %d started trials, this worker's budget being %d%s; "
                     "stopping", trials.study.study_name, held, trials.budget, queued)  # fmt: skip
            return ran
        _say_queued(trial)
        try:
            run_trial(trials, trial, objective, checkpoints)
            ran += 1
        except Interrupted:
            trials.hand_back(trial)
            return ran  # its folder stays: the retry resumes from it
        finally:
            live.trial_ended()
            if collect:
                gc.collect()  # the trial's memory, in the worker itself
        if artifacts is not None:
            trials.remove_stale_artifacts(artifacts)
        if live.active():
            _show_study(trials.study, trials.budget)
    if checkpoints is not None:
        trials.remove_stale_checkpoints(checkpoints)
    return ran


def _say_queued(trial: optuna.Trial) -> None:
    """A queued configuration, not a sampled one, is said when it starts (a retry is said
    when it is queued)."""
    by = trial.user_attrs.get(QUEUED_BY_ATTR)
    if by is not None and "retry_of" not in trial.user_attrs:
        log.info("trial %d (queued by %s) starts", trial.number, by)


def _show_study(study: optuna.Study, budget: int | None) -> None:
    """The study part of the live progress line: trials by state, the budget, the best value."""
    finished = study.get_trials(
        deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    )
    counts: dict[str, int] = {}
    for trial in finished:
        counts[trial.state.name.lower()] = counts.get(trial.state.name.lower(), 0) + 1
    best = None
    if len(study.directions) == 1 and counts.get("complete"):
        best = study.best_value
    live.study_progress(counts, best, budget)


def _wait_for_silent_trials(trials: StudyTrials, stop: StopRequest) -> bool:
    """The budget is spent, but a running trial's worker has gone silent (killed moments ago?):
    rather than leave it RUNNING with no worker to retry it, wait a heartbeat interval and sweep
    again. Returns False once no running trial is silent; live workers keep beating."""
    silent = trials.silent_running()
    if not silent:
        return False
    log.info("the workers of trials %s are silent; waiting to take them over once they are "
             "past the grace period", silent)  # fmt: skip
    _pause(trials.heartbeat_interval_s, stop)
    trials.sweep()
    return not stop.requested


def _wait_for_other_workers(trials: StudyTrials, stop: StopRequest, poll_s: float = 1.0) -> bool:
    """A queued-only worker with nothing queued waits while other workers' trials run (any
    may be handed back or swept, and queued again); False once none runs."""
    running = trials.running()
    if not running:
        return False
    if not trials.said_waiting:
        log.info("waiting for %d trials of other workers to finish", running)
        trials.said_waiting = True
    _pause(poll_s, stop)
    return not stop.requested


def _pause(seconds: float, stop: StopRequest) -> None:
    """Sleep `seconds`, or less once the worker is asked to stop."""
    waited = 0.0
    while waited < seconds and not stop.requested:
        time.sleep(0.2)
        waited += 0.2


def liveness(study_config: StudyConfig) -> tuple[float, float, int]:
    """Heartbeat interval, grace period and retries of the study's running trials."""
    return study_config.heartbeat_interval, study_config.grace_period_s, study_config.max_retries


def run_trial(
    trials: StudyTrials, trial: optuna.Trial, objective: Objective, checkpoints: Path | None = None
) -> None:
    """Run one trial with heartbeats and record how it ended. Interrupted propagates. Once its
    end is recorded, a trial that completed or was pruned needs its resume state (in its folder
    under `checkpoints`) no more; until then, a retry after a crash would resume from it."""
    with trials.heartbeat(trial) as beat:
        try:
            value = objective(trial, beat.lost)
        except optuna.TrialPruned as e:
            log.info("trial %d pruned: %s", trial.number, e)
            if trials.tell(trial, TrialState.PRUNED):
                _drop_state(checkpoints, trial)
            return
        except TakenOver:
            trials.tell(trial, TrialState.FAIL)  # one line: it was taken over
            return
        except HandBack as e:
            log.warning("trial %d: %s; queueing it again", trial.number, e)
            trials.hand_back(trial)
            return
        except Exception as e:  # Interrupted is a KeyboardInterrupt: it passes on
            if objective.stop.signal_name is not None:
                # What broke while the worker was stopping (the fork server died with the same
                # signal, say) is not the trial's fault: it is handed back like any stopped one.
                log.debug("trial %d broke while stopping", trial.number, exc_info=e)
                objective.mark_interrupted(trial, objective.stop.signal_name)
                raise Interrupted(objective.stop.signal_name) from e
            # Another worker took the trial over while this one was unresponsive: not a failure
            # of the trial; tell() says so in one line.
            if not (beat.lost.is_set() or isinstance(e, UpdateFinishedTrialError)):
                _record_failure(trial, e)
            trials.tell(trial, TrialState.FAIL)
            return
    if trials.tell(trial, TrialState.COMPLETE, value):
        _drop_state(checkpoints, trial)
        shown = _values_text(objective.task.config.study.objectives, value)
        log.info("trial %d finished: %s", trial.number, shown)


def _drop_state(checkpoints: Path | None, trial: optuna.Trial) -> None:
    """The resume state of a trial whose end is recorded (its stored copy: the worker's
    cleanup of the artifact store)."""
    if checkpoints is not None:
        with contextlib.suppress(OSError):
            (checkpoints / folder_name(trial) / STATE_FILE).unlink(missing_ok=True)


def _said(directions: Sequence[str]) -> str:
    return " and ".join(f"{d}d" for d in directions)


def _values_text(objectives: list[str], value: float | list[float] | None) -> str:
    values = value if isinstance(value, list) else [value]
    return ", ".join(f"{name}={v:.4f}" for name, v in zip(objectives, values, strict=False))


def _record_failure(trial: optuna.Trial, error: Exception) -> None:
    """One line in the log; the traceback only with --debug."""
    reason = trial.user_attrs.get("fail_reason")
    if reason is None:
        reason = f"{type(error).__name__}: {error}".strip()[:1000]
        trial.set_user_attr("fail_reason", reason)
    log.warning("trial %d failed: %s", trial.number, str(reason).splitlines()[0])
    log.debug("trial %d failed", trial.number, exc_info=error)


def summary_lines(study: optuna.Study, objectives: list[str]) -> list[str]:
    """What the user wants at the end: counts by state and the best trial (the Pareto front's
    trials for several objectives), and loudly what left the study without checkpoints or
    without its best model."""
    trials = study.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    state_text = ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())) or "no trials"
    lines = [f"study {study.study_name!r}: {len(trials)} trials ({state_text})"]
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
        lines.append(f"  trial #{best.number}: {_values_text(objectives, best.values)}")
    return lines


def _best_lines(best: FrozenTrial, objectives: list[str]) -> list[str]:
    lines = [f"best trial #{best.number}: {_values_text(objectives, best.value)}"]
    for key, value in best.params.items():
        lines.append(f"  {key}: {value:.3g}" if isinstance(value, float) else f"  {key}: {value}")
    attrs = best.user_attrs
    if "physical_batch_size" in attrs:
        lines.append(
            f"  physical batch {attrs['physical_batch_size']} x {attrs.get('grad_accum_steps')} "
            f"accumulation steps, {attrs.get('samples_per_s', 0):.1f} samples/s "
            f"on {attrs.get('device_name', '?')}"
        )
    return lines
