"""A worker's loop over a study: ask, train, tell, until the study's own trial budget is spent,
the worker's timeout passes or it is asked to stop. The budget (`n_trials`) counts the study's
trials in storage, not this process's; see hpo/study/trials.py for how many workers share it.
The summary printed at the end is hpo/reports/summary.py's.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from pathlib import Path

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from hpo import live, tracking
from hpo.stopping import HandBack, Interrupted, StopRequest, TakenOver
from hpo.storage.artifacts import ArtifactStore
from hpo.storage.engine import StudyStorage
from hpo.storage.heartbeats import LastBeat
from hpo.study import notices
from hpo.study.front import CHANCE_ATTR
from hpo.study.join import QUEUED_BY_ATTR, liveness
from hpo.study.pruners import ExplainedPruner
from hpo.study.trials import StudyTrials, counted_trials, unsure_trials
from hpo.tracking.observer import Observers, TrialObserver
from hpo.trainer.files import drop_resume_state
from hpo.trial import cpu_share
from hpo.trial.folders import checkpoint_root, folder_name
from hpo.trial.objective import Objective, worker_id
from hpo.trial.objective_pruning import ObjectivePruner

log = logging.getLogger(__name__)
# How long a worker done with its trials lets its last cleanup of the artifact store go on.
ARTIFACT_CLEANUP_WAIT_S = 60.0
# How much longer than a grace period and a heartbeat interval a worker with its budget spent
# waits for a silent trial to go stale (a slow database, clocks that tick unevenly).
UNSURE_WAIT_MARGIN_S = 10.0


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
    trials = StudyTrials(
        study, storage, worker_id(), study_config.n_trials, liveness(study_config), queued_only
    )
    trials.device_hours_budget = study_config.budget_device_hours
    deadline = None
    if study_config.timeout is not None:
        deadline = (time.monotonic() if started is None else started) + study_config.timeout
    checkpoints, artifacts = None, None
    if study_config.checkpoints:
        checkpoints = checkpoint_root(objective.task.config, study.study_name)
        if study_config.artifact_store is not None:
            artifacts = ArtifactStore(study_config.artifact_store)
    if objective.trains and objective.task.data is not None and len(study.directions) > 1:
        _record_chance_level(study, objective)
    in_worker = study_config.trial_isolation == "none"
    # A worker training on the CPU registers among the host's CPU workers, so that their trials
    # share its cores (hpo.trial.cpu_share).
    host = cpu_share.registered() if objective.trains_on_cpu() else contextlib.nullcontext()
    if in_worker:
        # What is alive now (torch, transformers, the data) outlives every trial: frozen, so the
        # collection after each trial skips it (150 ms a trial otherwise).
        gc.freeze()
    # The worker's trackers hear of its trials; their calls run in the background, never in
    # the trials' way.
    observer: TrialObserver = tracking.start(objective.task.config, study)
    # The study's notices (study.notify) hear of the trials' ends as the trackers do.
    said = notices.start(study, storage, study_config.notify)
    if said is not None:
        observer = Observers(observer, said)
    objective.observe(observer)
    trials.observer = observer
    try:
        with host as entry:
            objective.cpu_worker = entry
            ran = _trial_loop(
                trials, objective, stop, (checkpoints, artifacts), deadline, collect=in_worker
            )
        if said is not None and not stop.requested:  # said if nothing runs or is left to run
            said.worker_done(trials.budget, trials.device_hours_spent is not None)
        return ran
    finally:
        # A worker that ran out of trials (not one told to stop) lets its last cleanup of the
        # artifact store finish, for up to ARTIFACT_CLEANUP_WAIT_S.
        if not stop.requested:
            trials.finish_cleanup(ARTIFACT_CLEANUP_WAIT_S)
        objective.close()
        if in_worker:
            gc.unfreeze()
        observer.close(study)


def _record_chance_level(study: optuna.Study, objective: Objective) -> None:
    """What guessing scores on the evaluation split: no trial at that level is on the Pareto
    front (hpo.study.front)."""
    from hpo.trainer.tasks import make_task

    config, data = objective.task.config, objective.task.data
    task = make_task(data.task, config.data, config.training)
    study.set_user_attr(CHANCE_ATTR, task.chance_levels(data.eval, data.label_names))


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
        if trial is None and trials.device_hours_spent is not None:
            _say_device_hours_spent(trials)
            return ran
        if trial is None:
            if trials.queued_only and _wait_for_other_workers(trials, stop):
                continue
            if not trials.queued_only and _wait_for_unsure_trials(trials, stop):
                continue  # a trial ended or was swept: one may be queued again now
            if stop.requested:
                break
            if trials.queued_only:
                log.info("no queued trial left in study %r; stopping", trials.study.study_name)
                return ran
            waiting = len(trials.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
            queued = f"; {waiting} queued trials wait for a larger n_trials" if waiting else ""
            held = counted_trials(trials.study.get_trials(deepcopy=False))
            log.info(
                "study %r holds %d started trials, this worker's budget being %d%s; stopping",
                trials.study.study_name,
                held,
                trials.budget,
                queued,
            )
            return ran
        stop.doing = StopRequest.RUNNING  # what a signal stops, said in its log line
        _say_queued(trial)
        try:
            run_trial(trials, trial, objective, checkpoints)
            ran += 1
        except Interrupted:
            trials.hand_back(trial, f"interrupted: the worker got {stop.signal_name or 'SIGINT'}")
            return ran  # its folder stays: the retry resumes from it
        finally:
            stop.doing = StopRequest.BETWEEN_TRIALS
            live.trial_ended()
            if collect:
                gc.collect()  # the trial ran in this process: free its memory now
        if artifacts is not None:
            trials.remove_stale_artifacts(artifacts)
        if live.active():
            _show_study(trials.study, trials.budget)
    if checkpoints is not None:
        trials.remove_stale_checkpoints(checkpoints)
    return ran


def _say_device_hours_spent(trials: StudyTrials) -> None:
    """One line: the study's device-hour budget is spent; trials running elsewhere finish."""
    running = trials.running()
    log.info(
        "study %r has used %.3f device-hours, its budget being %g (study.budget_device_hours); "
        "starting no new trial%s",
        trials.study.study_name,
        trials.device_hours_spent,
        trials.device_hours_budget,
        f" ({running} running trials finish)" if running else "",
    )


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


def _wait_for_unsure_trials(trials: StudyTrials, stop: StopRequest, poll_s: float = 1.0) -> bool:
    """The budget is spent, but other workers' trials run, and a worker killed moments ago
    looks alive (its last beat is recent): left RUNNING, its trial would leave the study one
    short. So wait, watching heartbeats: a trial whose worker beats again is left to it (a live
    worker's long trial keeps no one more than a heartbeat interval); one that stays silent is
    failed and queued again by the sweep once past the grace period, and run here. True when a
    trial ended or was swept (one may be queued again); at most the grace period, an interval
    and a margin."""
    watched = {n: b for n, b in trials.running_beats().items() if n not in trials.seen_beating}
    if not watched:
        return False
    limit_s = trials.grace_period_s + trials.heartbeat_interval_s + UNSURE_WAIT_MARGIN_S
    _say_waiting(trials, watched, limit_s)
    deadline = time.monotonic() + limit_s
    while not stop.requested and time.monotonic() < deadline:
        if trials.sweep():
            return True
        now = trials.running_beats()
        if any(n not in now for n in watched):
            return True  # it ended: completed, or handed back and queued again
        unsure = unsure_trials(watched, now)
        for number in watched.keys() - set(unsure):
            log.info("trial %d: its worker beats; leaving the trial to it", number)
            trials.seen_beating.add(number)
        watched = {n: watched[n] for n in unsure}
        if not watched:
            return False
        _pause(poll_s, stop)
    if watched and not stop.requested:
        log.warning(
            "trials %s still run with no heartbeat after %.0f s; not waiting longer",
            sorted(watched),
            limit_s,
        )
    return False


def _say_waiting(trials: StudyTrials, watched: dict[int, LastBeat | None], limit_s: float) -> None:
    """One line: which trials this worker waits for, and what ends the wait."""
    shown = ", ".join(
        f"#{n} (no heartbeat)"
        if beat is None
        else f"#{n} on {beat.worker}, last heartbeat {beat.silent_s:.0f} s ago"
        for n, beat in sorted(watched.items())
    )
    log.info(
        "study %r holds this worker's budget of %s trials, but trials run: %s; waiting up "
        "to %.0f s for each to end, beat again (its worker is alive: left to it), or pass "
        "the grace period (%.0f s: queued again and run here)",
        trials.study.study_name,
        trials.budget,
        shown,
        limit_s,
        trials.grace_period_s,
    )


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
            reason = _prune_reason(trial, str(e))
            log.info("trial %d pruned: %s", trial.number, reason)
            # The tracker hears each end once it stands: a trial another worker took over
            # meanwhile keeps that worker's record.
            if trials.tell(trial, TrialState.PRUNED):
                trials.observer.trial_ended(trial, "pruned", reason)
                _drop_state(checkpoints, trial)
            return
        except TakenOver:
            # The worker that took the trial over has recorded why; this one logs one line.
            trials.fail(trial, "taken over by another worker: this one had stopped beating")
            return
        except HandBack as e:
            log.warning("trial %d: %s; queueing it again", trial.number, e)
            trials.hand_back(trial, f"{e}; queued again")
            return
        except Exception as e:  # Interrupted is a KeyboardInterrupt: it passes on
            if objective.stop.signal_name is not None:
                # What broke while the worker was stopping (the fork server died with the same
                # signal, say) is not the trial's fault: it is handed back like any stopped one.
                log.debug("trial %d broke while stopping", trial.number, exc_info=e)
                objective.mark_interrupted(trial, objective.stop.signal_name)
                raise Interrupted(objective.stop.signal_name) from e
            # If another worker took the trial over while this one was unresponsive, the error
            # is not the trial's failure: nothing is recorded, and tell() logs one line.
            if not (beat.lost.is_set() or isinstance(e, UpdateFinishedTrialError)):
                _record_failure(trial, e)
            if trials.fail(trial, _error_text(e)):
                trials.observer.trial_ended(trial, "failed", trial.user_attrs.get("fail_reason"))
            return
    not_a_value = nan_objectives(objective.task.config.study.objectives, value)
    if not_a_value:  # Optuna refuses NaN: the trial fails, saying which, and the worker goes on
        reason = f"the trial's value is NaN ({not_a_value}): nothing to compare it by"
        log.warning("trial %d failed: %s", trial.number, reason)
        if trials.fail(trial, reason):
            trials.observer.trial_ended(trial, "failed", reason)
        return
    if trials.tell(trial, TrialState.COMPLETE, value):
        trials.observer.trial_ended(trial, "complete")
        _drop_state(checkpoints, trial)
        shown = values_text(objective.task.config.study.objectives, value)
        log.info("trial %d finished: %s", trial.number, shown)


def _prune_reason(trial: optuna.Trial, given: str) -> str:
    """Why the trial was pruned: for the pruner's decision, the pruner's own account (which
    rule, the trial's value, what it was compared with), in place of the bare "pruner: ..."
    that the training code could say (it runs without the study); `given` otherwise."""
    pruner = trial.study.pruner
    explained = (
        pruner.reason(trial.number)
        if isinstance(pruner, (ExplainedPruner, ObjectivePruner))
        else None
    )
    if explained is None or not given.startswith("pruner"):
        return given
    with contextlib.suppress(UpdateFinishedTrialError):  # taken over: tell() says so
        trial.set_user_attr("prune_reason", explained)
    return explained


def _drop_state(checkpoints: Path | None, trial: optuna.Trial) -> None:
    """The resume state of a trial whose end is recorded (its stored copy: the worker's
    cleanup of the artifact store)."""
    if checkpoints is not None:
        drop_resume_state(checkpoints / folder_name(trial))


def nan_objectives(objectives: list[str], value: float | list[float] | None) -> str:
    """The objectives whose value is NaN, as `name=nan`; empty when there is none."""
    values = value if isinstance(value, list) else [value]
    return ", ".join(
        f"{name}=nan"
        for name, v in zip(objectives, values, strict=False)
        if isinstance(v, float) and math.isnan(v)
    )


def values_text(objectives: list[str], value: float | list[float] | None) -> str:
    values = value if isinstance(value, list) else [value]
    return ", ".join(f"{name}={v:.4f}" for name, v in zip(objectives, values, strict=False))


def _record_failure(trial: optuna.Trial, error: Exception) -> None:
    """One line in the log; the traceback only with --debug."""
    reason = trial.user_attrs.get("fail_reason")
    if reason is None:
        reason = _error_text(error)
        trial.set_user_attr("fail_reason", reason)
    log.warning("trial %d failed: %s", trial.number, str(reason).splitlines()[0])
    log.debug("trial %d failed", trial.number, exc_info=error)


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".strip()[:1000]
