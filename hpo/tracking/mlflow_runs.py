"""Trials in MLflow through MLflow's own client: a parent run per study (found again by its
tags, so that every worker on every host logs under the same one) and a nested run per trial
(found again by its first attempt's number, so that a retry continues it). Every method runs on
the background thread of hpo.tracking.background."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hpo.tracking.background import GiveUp
from hpo.tracking.events import StudyStart, TrialEnd, TrialInterrupted, TrialStart

STUDY_TAG = "hpo.study"
KIND_TAG = "hpo.kind"
ATTEMPT_TAG = "hpo.first_attempt"
PARENT_TAG = "mlflow.parentRunId"
RUN_NAME_TAG = "mlflow.runName"
# MLflow's HTTP client retries a refused call 7 times with backoff and waits 120 s for an
# answer by default: hpo retries itself, within tracking.patience.
HTTP_TIMEOUT_S = 10
END_STATUS = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}
# MLflow reads these from os.environ on every request and has no per-client setting. hpo's
# client answers them itself, in the thread of its own call only: the process' environment is
# left alone, so a notebook's or a trainer's own MLflow calls keep theirs. Set in the
# environment, they win for hpo's calls too.
RETRIES, TIMEOUT, QUIET = (
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    # Its "View run ... at" lines would go into hpo's standard output (the summary, --json).
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT",
)
_scoped = threading.local()  # .settings: {name: value} while one of hpo's calls runs
_scoping = threading.Lock()


def client_for(uri: str, patience_s: float) -> Any:
    """An MlflowClient on `uri` whose calls give up quickly (hpo retries them)."""
    from mlflow import MlflowClient

    _answer_in_scope()
    timeout_s = max(1, int(min(HTTP_TIMEOUT_S, patience_s)))
    return ScopedClient(
        MlflowClient(tracking_uri=uri), {RETRIES: 0, TIMEOUT: timeout_s, QUIET: True}
    )


class ScopedClient:
    """An MlflowClient whose calls run with `settings` in place of MLflow's environment
    variables, in the calling thread only and only for the call."""

    def __init__(self, client: Any, settings: dict[str, Any]) -> None:
        self.client = client
        self.settings = settings

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.client, name)
        if not callable(found):
            return found

        def scoped(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(_scoped, "settings", None)
            _scoped.settings = self.settings
            try:
                return found(*args, **kwargs)
            finally:
                _scoped.settings = outer

        return scoped


def _answer_in_scope() -> None:
    """Once per process: MLflow's variables answer hpo's setting inside a scoped call (unless
    the environment sets them), and as before everywhere else."""
    from mlflow import environment_variables

    with _scoping:
        for name in (RETRIES, TIMEOUT, QUIET):
            variable = getattr(environment_variables, name)
            if getattr(variable, "hpo_scoped", False):
                continue
            variable.get = functools.partial(_scoped_get, variable, variable.get)
            variable.hpo_scoped = True


def _scoped_get(variable: Any, unscoped: Any) -> Any:
    settings = getattr(_scoped, "settings", None)
    if settings is None or variable.name not in settings or variable.is_set():
        return unscoped()
    return settings[variable.name]


class MlflowRuns:
    def __init__(self, uri: str, experiment: str, patience_s: float) -> None:
        self.uri = uri
        self.experiment_name = experiment
        self.patience_s = patience_s
        self.client: Any = None
        self.experiment_id: str | None = None
        self.parent: str | None = None
        self.study = ""
        self.runs: dict[int, str] = {}  # trial number -> run id

    # -- the study --------------------------------------------------------------------------

    def start_study(self, start: StudyStart) -> None:
        if self.client is None:
            self.client = client_for(self.uri, self.patience_s)
        self.study = start.study
        self.experiment_id = self._experiment()
        self.parent = self._parent_run(start)

    def _experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(self.experiment_name)
        if found is not None:
            if found.lifecycle_stage == "deleted":
                raise GiveUp(
                    f"the experiment {self.experiment_name!r} is deleted in MLflow: "
                    "restore it, or name another (tracking.mlflow.experiment)"
                )
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(self.experiment_name))
        except MlflowException:  # another worker created it just now
            found = self.client.get_experiment_by_name(self.experiment_name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _parent_run(self, start: StudyStart) -> str:
        """The study's run: the oldest one tagged with the study (two workers that start at once
        may both create one: the younger is deleted, and both log under the older)."""
        existing = self._study_runs()
        if existing:
            return existing[0]
        tags = {STUDY_TAG: self.study, KIND_TAG: "study", RUN_NAME_TAG: self.study}
        created = self.client.create_run(self.experiment_id, tags=tags).info.run_id
        existing = self._study_runs()
        chosen = existing[0] if existing else created
        if chosen != created:
            self.client.delete_run(created)
            return chosen
        self._log_batch(created, start.params)
        self.client.log_dict(created, start.config, "config.json")
        self.client.log_dict(created, start.search_space, "search_space.json")
        return created

    def _study_runs(self) -> list[str]:
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{STUDY_TAG}` = '{quoted(self.study)}' "
            f"and tags.`{KIND_TAG}` = 'study'",
            order_by=["attributes.start_time ASC"],
            max_results=10,
        )
        ordered = sorted(runs, key=lambda run: (run.info.start_time, run.info.run_id))
        return [run.info.run_id for run in ordered]

    # -- trials -----------------------------------------------------------------------------

    def start_trial(self, start: TrialStart) -> None:
        # A first attempt has no run yet: only a retry looks for the one it goes on with (each
        # request costs the server 13-17 ms of CPU, taken from training where it shares a host).
        retry = start.first_attempt != start.number
        run_id = self._trial_run(start.first_attempt) if retry else None
        tags = {
            "hpo.trial": str(start.number),
            "hpo.worker": start.worker,
            "hpo.host": start.host,
            "hpo.state": "running",
        }
        if run_id is None:
            tags.update(
                {
                    PARENT_TAG: self._parent(),
                    STUDY_TAG: self.study,
                    KIND_TAG: "trial",
                    ATTEMPT_TAG: str(start.first_attempt),
                    RUN_NAME_TAG: f"trial {start.first_attempt}",
                }
            )
            run_id = self.client.create_run(self.experiment_id, tags=tags).info.run_id
        else:  # a retry: the same run goes on
            self.client.update_run(run_id, status="RUNNING")
            retried = {**tags, "hpo.retried_as": str(start.number)}
            self.runs[start.number] = run_id
            self._log_batch(run_id, start.params, tags=retried)  # one request for both
            return
        self.runs[start.number] = run_id
        self._log_batch(run_id, start.params)

    def _trial_run(self, first_attempt: int) -> str | None:
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`{STUDY_TAG}` = '{quoted(self.study)}' "
            f"and tags.`{ATTEMPT_TAG}` = '{first_attempt}'",
            max_results=1,
        )
        return runs[0].info.run_id if runs else None

    def evaluation(self, number: int, step: int, metrics: dict[str, float]) -> None:
        self.client.log_batch(self._run(number), metrics=_metrics(step, metrics), synchronous=True)

    def end_trial(self, end: TrialEnd) -> None:
        run_id = self._run(end.number)
        tags = {"hpo.state": end.state}
        if end.reason:
            tags[f"hpo.{end.state}_reason"] = end.reason[:5000]
        if end.best_model is not None:
            tags["hpo.best_model"] = end.best_model
        # The end in one request, and the status in a second: not one per kind of record.
        self._log_batch(run_id, end.derived, tags=tags, metrics=_metrics(end.samples, end.metrics))
        self.client.set_terminated(run_id, status=END_STATUS[end.state])

    def interrupt_trial(self, end: TrialInterrupted) -> None:
        """KILLED with why, rather than RUNNING until a retry that may never come; the run of a
        dead worker's trial is found by its first attempt."""
        run_id = self.runs.pop(end.number, None) or self._trial_run(end.first_attempt)
        if run_id is None:  # never logged: nothing to end
            return
        why = {"hpo.state": "interrupted", "hpo.interrupted_reason": end.reason[:5000]}
        self._log_batch(run_id, {}, tags=why)
        self.client.set_terminated(run_id, status="KILLED")

    def close(self) -> None:
        pass

    # -- helpers ----------------------------------------------------------------------------

    def _parent(self) -> str:
        if self.parent is None:
            raise GiveUp("the study's run could not be created")
        return self.parent

    def _run(self, number: int) -> str:
        if number not in self.runs:
            raise GiveUp("the trial's run could not be created")
        return self.runs[number]

    def _log_batch(
        self,
        run_id: str,
        params: dict[str, Any],
        tags: Mapping[str, str] | None = None,
        metrics: Sequence[Any] = (),
    ) -> None:
        """Params as MLflow keeps them (strings), in one request with `tags` and `metrics`; a
        value that differs from the one logged before (a retry's other physical batch) goes in
        a tag instead, as MLflow keeps params unchanged (and refuses the whole request)."""
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        logged = [Param(key, _text(value)[:6000]) for key, value in params.items()]
        run_tags = [RunTag(key, value) for key, value in (tags or {}).items()]
        if not (logged or run_tags or metrics):
            return
        try:
            self.client.log_batch(
                run_id, params=logged, tags=run_tags, metrics=list(metrics), synchronous=True
            )
        except MlflowException as e:
            if not logged or "INVALID_PARAMETER_VALUE" not in str(e.error_code):
                raise
            as_tags = [RunTag(f"hpo.param.{p.key}", p.value) for p in logged]
            self.client.log_batch(
                run_id, tags=[*run_tags, *as_tags], metrics=list(metrics), synchronous=True
            )


def _metrics(step: int, metrics: dict[str, float]) -> list[Any]:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    return [Metric(key, float(value), now, step) for key, value in metrics.items()]


def quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)
