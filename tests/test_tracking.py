"""Trials in MLflow and TensorBoard, on real parts: an MLflow tracking server started here on
127.0.0.1 (SQLite backend, its own artifact folder), read back through MLflow's own client; a
tracker that refuses costs no trial and is counted by `hpo status`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from hpo.tracking.background import STUDY, BackgroundCalls, GiveUp
from tests.conftest import (
    hold_env,
    holding_metrics,
    start_hpo,
    tiny_config,
    wait_until_held,
    write_config,
)

HTTP_SETTINGS = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")


def _mlflow() -> Any:
    """MLflow (the dev extra installs it); the tests that need it are skipped without it."""
    return pytest.importorskip("mlflow")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """MLflow's own tracking server (the app `mlflow server` serves) on 127.0.0.1, served from a
    thread of this process, with a SQLite backend and its own artifact folder. `mlflow server`
    itself starts three processes that each import MLflow (itself, a uvicorn worker, a job
    runner with seven consumers): 16 to 32 s on a loaded 2-core host, where this takes 3."""
    mlflow = _mlflow()
    started = time.monotonic()
    from mlflow.server import ARTIFACT_ROOT_ENV_VAR, BACKEND_STORE_URI_ENV_VAR
    from werkzeug.serving import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_request(self, *args: Any, **kwargs: Any) -> None:
            pass  # a line per request would bury the test's own output

    folder = tmp_path_factory.mktemp("mlflow")
    settings = {
        BACKEND_STORE_URI_ENV_VAR: f"sqlite:///{folder / 'mlflow.db'}",
        ARTIFACT_ROOT_ENV_VAR: str(folder / "artifacts"),
    }
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)  # what the app reads, as `mlflow server` hands them to it
    from mlflow.server import app

    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=Quiet)
    thread = threading.Thread(target=server.serve_forever, name="mlflow-server", daemon=True)
    thread.start()
    uri = f"http://127.0.0.1:{server.server_port}"
    try:
        mlflow.MlflowClient(uri).search_experiments()  # the app creates its database now
        print(f"mlflow server answering in {time.monotonic() - started:.1f} s")
        yield uri
    finally:
        server.shutdown()
        server.server_close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(autouse=True)
def _mlflow_http_settings() -> Iterator[None]:
    """Set in the environment, MLflow's HTTP settings would win over hpo's own (timeout, no
    retries): each test runs without them, and leaves the environment as it found it."""
    saved = {key: os.environ.pop(key, None) for key in HTTP_SETTINGS}
    yield
    for key, value in saved.items():
        os.environ.pop(key, None)
        if value is not None:
            os.environ[key] = value


def _study_args(
    tmp_path: Path,
    data: tuple[Path, Path],
    tracking: dict,
    name: str,
    metrics: str | None = None,
    **sections: dict,
) -> list[str]:
    raw = tiny_config(*data, **{"training": {"epochs": 1, "evals_per_epoch": 2}, **sections})
    raw["tracking"] = tracking
    if metrics is not None:
        raw["metrics"] = metrics
    config = write_config(tmp_path / "study.yaml", raw)
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    return ["run", "--study", name, "--config", str(config), "--storage", storage]


def _wait_for_runs(
    client: Any,
    experiment: str,
    filter_string: str,
    what: str,
    alive: Callable[[], bool] = lambda: True,
) -> None:
    """Until a run of `experiment` matches `filter_string` (the server read directly; a failed
    answer is asked again)."""
    from mlflow.exceptions import MlflowException

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and alive():
        with contextlib.suppress(MlflowException):
            found = client.get_experiment_by_name(experiment)
            if found is not None and client.search_runs([found.experiment_id], filter_string):
                return
        time.sleep(0.2)
    pytest.fail(f"no {what} in MLflow")


# The worker is held in its trial 0's second evaluation (the first is in MLflow by then) by
# conftest's HOLDING_METRICS: the test kills it there, where before it froze the worker at a guess
# and looked, and a slow machine's worker could finish its trials first (a CI failure).


def _kill_when_held(worker: Any, held: Path, client: Any, experiment: str) -> int:
    """SIGKILL `worker` once it is held in trial 0's second evaluation and trial 0's first
    evaluation is in MLflow; returns 0, the trial lost."""
    wait_until_held(held, [worker])
    _wait_for_runs(
        client,
        experiment,
        "tags.`hpo.first_attempt` = '0' and metrics.accuracy >= 0",
        "first evaluation of trial 0",
        alive=lambda: worker.poll() is None,
    )
    worker.send_signal(signal.SIGKILL)
    return 0


def test_two_workers_log_one_study_a_lost_trial_goes_on_in_its_run_and_retrain_registers(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    mlflow_server: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A worker (a process of its own) is killed in a trial whose first evaluation is in
    MLflow; a second worker (this process) takes the trial over: it continues the same run
    under the same parent run. Then `hpo retrain --register` puts the winner in the registry.
    The trials run in their workers (trial_isolation: none): no fork server to start, twice."""
    mlflow = _mlflow()
    study_section = {
        "n_trials": 2,
        "heartbeat_interval": 1,
        "grace_period": 3,
        "checkpoint_interval": 0,
        "trial_isolation": "none",
    }
    training = {"epochs": 2, "evals_per_epoch": 2}
    tracking = {"mlflow": {"uri": mlflow_server}}
    metrics = holding_metrics(tmp_path)
    args = _study_args(
        tmp_path,
        easy_data,
        tracking,
        "shared",
        study=study_section,
        training=training,
        metrics=metrics,
    )
    client = mlflow.MlflowClient(mlflow_server)
    held = tmp_path / "held"
    env = hold_env(held, at=2, release="never")  # until killed
    doomed = start_hpo(*args, "--quiet", cwd=tmp_path, env=env)
    try:
        killed_in = _kill_when_held(doomed, held, client, "hpo-shared")
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(30)
    assert hpo_main(args) == 0
    study = optuna.load_study(study_name="shared", storage=args[-1])
    lost = study.trials[killed_in]
    done = [t for t in study.trials if t.number != killed_in]
    assert lost.state == optuna.trial.TrialState.FAIL
    retry = next(t for t in done if t.system_attrs.get("failed_trial") == killed_in)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in done) and len(done) == 2
    assert retry.user_attrs["worker"] != lost.user_attrs["worker"]

    experiment = client.get_experiment_by_name("hpo-shared")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("hpo.kind") == "study"]
    trials = {
        r.data.tags["hpo.first_attempt"]: r for r in runs if r.data.tags.get("hpo.kind") == "trial"
    }
    assert len(parents) == 1 and len(runs) == 3, [r.data.tags for r in runs]  # one per attempt 0
    parent = parents[0]
    assert parent.data.params["sampler"] == "tpe" and parent.data.params["pruner"] == "median"
    assert parent.data.params["objectives"] == "accuracy"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {
        "config.json",
        "search_space.json",
    }
    steps = [128 * k for k in range(1, 5)]  # 2 evaluations an epoch of 256 examples, 2 epochs
    for trial in done:
        run = trials[str(trial.user_attrs.get("first_attempt", trial.number))]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.info.status == "FINISHED" and run.data.tags["hpo.state"] == "complete"
        params = run.data.params
        assert float(params["learning_rate"]) == pytest.approx(trial.params["learning_rate"])
        assert params["physical_batch_size"] == str(trial.user_attrs["physical_batch_size"])
        assert params["grad_accum_steps"] == str(trial.user_attrs["grad_accum_steps"])
        assert run.data.tags["hpo.worker"] == trial.user_attrs["worker"]
        history = sorted(
            client.get_metric_history(run.info.run_id, "accuracy"), key=lambda m: m.step
        )
        ended = client.get_metric_history(run.info.run_id, "eval_loss")
        if trial is retry:  # the killed worker's evaluations, then this one's, in one run
            assert history[0].step == 128 and {m.step for m in history} == set(steps)
            assert run.data.tags["hpo.retried_as"] == str(trial.number)
            assert "hpo.interrupted_reason" in run.data.tags  # KILLED until the retry came
            assert len(ended) >= len(steps)
        else:
            assert [m.step for m in history] == steps and len(ended) == len(steps)
            assert [round(m.value, 6) for m in history] == [
                round(v, 6) for v in trial.intermediate_values.values()
            ]
        assert history[-1].value == pytest.approx(trial.value)
        assert {"samples_per_s", "peak_mem_bytes", "train_loss"} <= set(run.data.metrics)
        assert run.data.tags["hpo.best_model"] == trial.user_attrs["best_model"]

    capsys.readouterr()
    final = tmp_path / "final"
    retrain = [
        "retrain",
        "--study",
        "shared",
        *args[3:],
        "--top",
        "1",
        "--seeds",
        "1",
        "--out",
        str(final),
        "--register",
        "tiny-classifier",
    ]
    assert hpo_main(retrain) == 0
    out = capsys.readouterr().out
    assert "registered in MLflow's model registry: tiny-classifier version 1" in out, out
    version = client.get_model_version("tiny-classifier", "1")
    run = client.get_run(version.run_id)
    retrain_study = run.data.tags["hpo.study"]
    assert run.data.tags["hpo.kind"] == "trial" and "[retrain top 1 x 1 seeds" in retrain_study
    assert version.description.startswith("# Final model of study 'shared'")
    card = json.loads((final / "hpo_model_card.json").read_text())
    assert version.tags["hpo.study"] == "shared" and version.tags["hpo.metric"] == "accuracy"
    assert version.tags["hpo.retrain_study"] == retrain_study
    assert float(version.tags["hpo.mean"]) == pytest.approx(card["winner"]["mean"])
    assert json.loads(version.tags["hpo.params"]) == card["winner"]["params"]
    uploaded = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "final_model")}
    assert {"config.json", "hpo_model_card.json", "README.md"} <= uploaded, uploaded


def _card() -> dict[str, Any]:
    winner = {"mean": 0.9, "std": 0.01, "seeds": 2, "params": {"learning_rate": 0.01}}
    saved = {"trial": 1, "full_data": False}
    return {
        "study": "s",
        "retrain_study": "s [retrain top 1 x 2 seeds, abc123]",
        "metric": "accuracy",
        "winner": winner,
        "saved_run": saved,
    }


def test_a_winner_the_tracker_missed_gets_a_run_and_a_remote_store_copy_is_the_source(
    tmp_path: Path, mlflow_server: str
) -> None:
    """No second copy of a model the artifact store holds remotely; a run made for it when the
    tracker never logged the winning trial."""
    from types import SimpleNamespace

    from hpo.config.schema import Config, MlflowTrackingConfig
    from hpo.tracking import registry

    mlflow = _mlflow()
    config = Config()
    config.tracking.mlflow = MlflowTrackingConfig(uri=mlflow_server)
    stored = "s3://models/hpo/s/trial-1/best-model"
    trial = SimpleNamespace(number=1, user_attrs={"best_model_uri": stored})
    said = registry.register_winner(
        config, "stored", "s [retrain]", trial, tmp_path, _card(), "# the card"
    )
    assert said == "stored version 1"
    client = mlflow.MlflowClient(mlflow_server)
    version = client.get_model_version("stored", "1")
    assert version.source == stored and version.description == "# the card"
    run = client.get_run(version.run_id)
    assert run.data.tags["hpo.kind"] == "final_model" and run.info.status == "FINISHED"
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["hpo_model_card.json"]


def test_a_registry_out_of_reach_is_one_line_that_keeps_the_model(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from hpo.config.schema import Config, MlflowTrackingConfig
    from hpo.errors import HPOError
    from hpo.tracking import registry

    _mlflow()
    config = Config()
    uri = f"http://hpo:s3cret-token@127.0.0.1:{_free_port()}"  # nothing listens there
    config.tracking.mlflow = MlflowTrackingConfig(uri=uri)
    config.tracking.patience = 1
    trial = SimpleNamespace(number=0, user_attrs={})
    with pytest.raises(HPOError) as raised:
        registry.register_winner(config, "m", "s", trial, tmp_path, _card(), "# card")
    said = str(raised.value)
    assert said.startswith("--register m: MLflow at http://hpo:***@127.0.0.1:"), said
    assert said.endswith(
        f"the final model is saved in {tmp_path}: run the same hpo retrain again to register it"
    )
    assert "s3cret-token" not in said and "\n" not in said


def test_register_without_mlflow_tracking_is_one_line_before_any_training(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _study_args(tmp_path, easy_data, {}, "searched")
    final = tmp_path / "final"
    code = hpo_main(
        ["retrain", "--study", "searched", *args[3:], "--out", str(final), "--register", "model"]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "hpo: error: --register: the model registry is MLflow's and no MLflow "
        "tracking is configured; add tracking.mlflow to the config or pass "
        "--tracking URI"
    ], err
    assert not final.exists() and not (tmp_path / "studies.db").exists()


def test_a_retry_continues_its_run_and_the_ends_are_tags(mlflow_server: str) -> None:
    """The tracker's own calls against the server: a pruned first attempt and its retry (a
    later trial number, the same first attempt) share one run; a failure says why."""
    mlflow = _mlflow()
    from hpo.tracking.events import StudyStart, TrialEnd, TrialInterrupted, TrialStart
    from hpo.tracking.mlflow_runs import MlflowRuns

    runs = MlflowRuns(mlflow_server, "retries", patience_s=5)
    runs.start_study(StudyStart("retried", {"sampler": "tpe"}, {}, {}))
    again = MlflowRuns(mlflow_server, "retries", patience_s=5)  # a second worker
    again.start_study(StudyStart("retried", {"sampler": "tpe"}, {}, {}))
    assert again.parent == runs.parent
    runs.start_trial(TrialStart(0, 0, {"learning_rate": 0.01}, "a:1", "a"))
    runs.evaluation(0, 64, {"accuracy": 0.5})
    # Worker a died: b's sweep hands trial 0 back (its run found by the first attempt) ...
    again.interrupt_trial(TrialInterrupted(0, 0, "lost its worker: no heartbeat for 31 s"))
    client = mlflow.MlflowClient(mlflow_server)
    lost = client.get_run(runs.runs[0])
    assert lost.info.status == "KILLED" and lost.data.tags["hpo.state"] == "interrupted"
    again.start_trial(TrialStart(3, 0, {"learning_rate": 0.01}, "b:2", "b"))  # ... and retries it
    assert client.get_run(runs.runs[0]).info.status == "RUNNING"
    again.evaluation(3, 128, {"accuracy": 0.75})
    again.end_trial(TrialEnd(3, "pruned", "pruner: accuracy=0.75 at evaluation 2", 128))
    runs.start_trial(TrialStart(1, 1, {"learning_rate": 0.02}, "a:1", "a"))
    runs.end_trial(
        TrialEnd(1, "failed", "RuntimeError: boom", 0, derived={"physical_batch_size": 4})
    )
    experiment = client.get_experiment_by_name("retries")
    found = client.search_runs([experiment.experiment_id], "tags.`hpo.kind` = 'trial'")
    by_attempt = {r.data.tags["hpo.first_attempt"]: r for r in found}
    assert sorted(by_attempt) == ["0", "1"] and len(found) == 2
    retried = by_attempt["0"]
    assert retried.info.status == "KILLED" and retried.data.tags["hpo.state"] == "pruned"
    assert retried.data.tags["hpo.pruned_reason"].startswith("pruner: accuracy=0.75")
    assert retried.data.tags["hpo.trial"] == "3" and retried.data.tags["hpo.worker"] == "b:2"
    history = client.get_metric_history(retried.info.run_id, "accuracy")
    assert sorted((m.step, m.value) for m in history) == [(64, 0.5), (128, 0.75)]
    failed = by_attempt["1"]
    assert failed.info.status == "FAILED" and failed.data.tags["hpo.failed_reason"] == (
        "RuntimeError: boom"
    )
    assert failed.data.params["physical_batch_size"] == "4"


def test_the_server_stopped_mid_study_costs_no_trial_and_each_gap_is_said_once(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    mlflow_server: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The server behind a proxy that is cut once the first trial is logged whole: every
    trial completes, the log names each trial MLflow misses once (no secret, no traceback),
    and `hpo status` counts them."""
    mlflow = _mlflow()
    from tests.tcp_proxy import CuttableProxy

    proxy = CuttableProxy("127.0.0.1", int(mlflow_server.rsplit(":", 1)[1]))
    uri = f"http://hpo:s3cret-token@127.0.0.1:{proxy.port}"
    tracking = {"mlflow": {"uri": uri, "experiment": "cut"}, "patience": 3}
    # The trials train in the worker, where the tracker's calls are made either way: no trial
    # process's start-up (the two workers' test above runs trial processes).
    study = {"n_trials": 3, "trial_isolation": "none"}
    args = _study_args(tmp_path, easy_data, tracking, "cut", study=study)
    client = mlflow.MlflowClient(mlflow_server)  # straight to the server, not through the proxy

    def cut_once_a_trial_is_logged() -> None:
        _wait_for_runs(client, "cut", "attributes.status = 'FINISHED'", "finished trial")
        proxy.cut()

    watcher = threading.Thread(target=cut_once_a_trial_is_logged, daemon=True)
    watcher.start()
    try:
        assert hpo_main(args) == 0
    finally:
        watcher.join(5)
        proxy.close()
    out = capsys.readouterr()
    text = out.out + out.err
    study = optuna.load_study(study_name="cut", storage=args[-1])
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3
    experiment = client.get_experiment_by_name("cut")
    logged = client.search_runs([experiment.experiment_id], "attributes.status = 'FINISHED'")
    assert [r.data.tags["hpo.first_attempt"] for r in logged] == ["0"]
    assert "trial 0 is missing" not in text
    for number in (1, 2):
        assert text.count(f"trial {number} is missing from MLflow") == 1, text[-3000:]
    assert "s3cret-token" not in text and "Traceback" not in text
    assert hpo_main(["status", "--study", "cut", "--storage", args[-1]]) == 0
    status = capsys.readouterr().out
    assert "the tracker is missing 2 trials" in status, status


@pytest.mark.slow
def test_a_token_in_the_tracking_uris_query_is_never_printed_or_stored(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 42: `--tracking 'http://host/mlflow?access_token=...'` with the server out of
    reach: the run log, `hpo status`'s WARNING line and the study database show the URI with
    its token masked."""
    _mlflow()
    token = "tok-Sekr1t-42"
    uri = f"http://127.0.0.1:{_free_port()}/mlflow?access_token={token}"  # nothing listens
    study = {"n_trials": 1, "trial_isolation": "none"}  # trained in the worker, as above
    args = _study_args(tmp_path, easy_data, {"patience": 1}, "t", study=study)
    assert hpo_main([*args, "--tracking", uri]) == 0
    assert hpo_main(["status", "--study", "t", "--storage", args[-1]]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "is missing from MLflow" in text and "WARNING: the tracker is missing" in text, text
    assert "access_token=***" in text and token not in text
    study = optuna.load_study(study_name="t", storage=args[-1])
    assert any("access_token=***" in str(v) for v in study.user_attrs.values()), study.user_attrs
    assert token.encode() not in (tmp_path / "studies.db").read_bytes()


def test_hpos_http_settings_hold_in_its_own_calls_only_and_the_environment_is_untouched() -> None:
    """No retries and a short timeout in hpo's client's calls (a refused server fails at once,
    not after MLflow's 7 retries with backoff); a call in another thread at the same time, and
    any call after, reads MLflow's defaults; nothing is written to os.environ."""
    _mlflow()
    from mlflow.environment_variables import (
        MLFLOW_HTTP_REQUEST_MAX_RETRIES,
        MLFLOW_HTTP_REQUEST_TIMEOUT,
    )
    from mlflow.exceptions import MlflowException

    from hpo.tracking.mlflow_runs import ScopedClient, client_for

    client = client_for(f"http://127.0.0.1:{_free_port()}", patience_s=3)
    started = time.monotonic()
    with pytest.raises(MlflowException, match="Connection refused|Max retries"):
        client.search_experiments()
    assert time.monotonic() - started < 5  # MLflow's own retries would take a minute or more
    assert not set(HTTP_SETTINGS) & set(os.environ)

    inside, outside = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    class Probe:
        def read(self) -> None:
            seen["hpo"] = (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get())
            inside.set()
            outside.wait(10)

    scoped = ScopedClient(Probe(), client.settings)
    thread = threading.Thread(target=scoped.read)
    thread.start()
    assert inside.wait(10)
    seen["other thread meanwhile"] = (
        MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(),
        MLFLOW_HTTP_REQUEST_TIMEOUT.get(),
    )
    outside.set()
    thread.join()
    seen["after"] = (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_TIMEOUT.get())
    assert seen == {"hpo": (0, 3), "other thread meanwhile": (7, 120), "after": (7, 120)}

    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "60"  # the user's own setting wins
    scoped.read()
    assert seen["hpo"] == (0, 60)


def test_background_calls_retry_then_give_up_once_per_trial(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tries: list[int] = []

    def flaky() -> None:
        tries.append(1)
        if len(tries) < 2:
            raise ConnectionError("refused")

    def refused() -> None:
        raise GiveUp("403: no permission for https://u:pw@host/")

    calls = BackgroundCalls("MLflow", patience_s=5)
    calls.submit(0, "its start", flaky)  # works on its second try
    calls.submit(1, "its start", refused)
    calls.submit(1, "evaluation 1", refused)  # the trial is missing already: not said again
    assert calls.close(10)
    assert len(tries) == 2
    assert list(calls.take_unreported()) == [1] and calls.take_unreported() == {}
    said = [r.getMessage() for r in caplog.records if "missing from" in r.getMessage()]
    assert len(said) == 1 and "pw" not in said[0] and "trial 1" in said[0]


def test_once_the_study_run_is_missing_each_trial_is_said_missing_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[int] = []

    def refused() -> None:
        raise GiveUp("RESOURCE_DOES_NOT_EXIST: no experiment")

    calls = BackgroundCalls("MLflow", patience_s=5)
    calls.submit(STUDY, "the study's run", refused)
    for number in (0, 0, 1):  # nothing of a trial runs without its study's run
        calls.submit(number, "its start", lambda: ran.append(1))
    assert calls.close(10) and ran == []
    assert sorted(calls.take_unreported()) == [0, 1]
    said = [r.getMessage() for r in caplog.records if "missing from" in r.getMessage()]
    assert len(said) == 3 and sum("trial 0 " in line for line in said) == 1, said


@pytest.mark.parametrize("told", [True, False], ids=["recorded", "taken over meanwhile"])
@pytest.mark.parametrize("outcome", ["complete", "pruned", "failed"])
def test_the_tracker_hears_a_trials_end_only_once_the_study_recorded_it(
    monkeypatch: pytest.MonkeyPatch, told: bool, outcome: str
) -> None:
    """A worker whose trial another worker took over meanwhile (its tell refused) sends no end:
    MLflow keeps the other worker's."""
    from types import SimpleNamespace

    from hpo.study import loop

    ended: list[str] = []
    monkeypatch.setattr(loop, "_record_failure", lambda trial, e: None)

    class Trials:
        # The worker's trackers, as run_trials hands them down: they hear each end.
        observer = SimpleNamespace(trial_ended=lambda trial, state, *a: ended.append(state))

        def heartbeat(self, trial: Any) -> Any:
            return contextlib.nullcontext(SimpleNamespace(lost=threading.Event()))

        def tell(self, trial: Any, state: Any, value: Any = None) -> bool:
            return told

        def fail(self, trial: Any, reason: str) -> bool:
            return told

    class Objective:
        stop = SimpleNamespace(signal_name=None)
        task = SimpleNamespace(config=SimpleNamespace(study=SimpleNamespace(objectives=["a"])))

        def __call__(self, trial: Any, lost: Any) -> float:
            if outcome == "pruned":
                raise optuna.TrialPruned("pruner: a=0.1 at evaluation 1")
            if outcome == "failed":
                raise RuntimeError("boom")
            return 0.5

    trial = SimpleNamespace(number=0, user_attrs={}, study=SimpleNamespace(pruner=None))
    loop.run_trial(Trials(), trial, Objective())  # type: ignore[arg-type]
    assert ended == ([outcome] if told else [])


def test_a_full_queue_gives_calls_up_without_blocking() -> None:
    calls = BackgroundCalls("MLflow", patience_s=5, max_waiting=1)
    release = threading.Event()
    calls.submit(0, "slow", lambda: release.wait(30))  # the tracker hangs until released

    def submit_more() -> None:
        for index in range(5):
            calls.submit(index + 1, f"call {index}", lambda: None)

    submitting = threading.Thread(target=submit_more)
    submitting.start()
    submitting.join(timeout=20)
    blocked = submitting.is_alive()
    release.set()
    submitting.join()
    assert not blocked  # never waits for the tracker: all submitted while it hangs
    calls.close(5)
    assert len(calls.missing) >= 3


@pytest.mark.parametrize("tracker", ["mlflow", "tensorboard"])
def test_a_tracker_not_installed_is_one_line_naming_its_extra(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tracker: str,
) -> None:
    import hpo.tracking

    monkeypatch.setattr(hpo.tracking, "installed", lambda module: module != tracker)
    wanted = {"mlflow": {"uri": "http://127.0.0.1:1"}, "tensorboard": {"dir": "tb"}}[tracker]
    args = _study_args(tmp_path, easy_data, {tracker: wanted}, "no_extra")
    assert hpo_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"hpo: error: tracking.{tracker}: {tracker} is not installed; pip install 'hpo[{tracker}]'"
    ], err
    assert not (tmp_path / "studies.db").exists()  # before anything is written


def test_mlflow_without_a_uri_anywhere_is_one_line(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    args = _study_args(tmp_path, easy_data, {"mlflow": {"experiment": "x"}}, "no_uri")
    assert hpo_main(args) == 2
    err = capsys.readouterr().err
    assert "tracking.mlflow.uri: no URI; give one, pass --tracking URI or set " in err, err
    assert "Traceback" not in err


def test_a_study_in_tensorboard_event_files_read_back_with_its_own_reader(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    tracking = {"tensorboard": {"dir": str(tmp_path / "tb")}}
    # Trained in the worker: the evaluations reach a tracker from trial processes the same way
    # for every tracker, and the MLflow and W&B end-to-end tests run trial processes.
    args = _study_args(tmp_path, easy_data, tracking, "tb study", study={"trial_isolation": "none"})
    assert hpo_main(args) == 0
    study = optuna.load_study(study_name="tb study", storage=args[-1])
    folder = tmp_path / "tb" / "tb_study"
    assert sorted(p.name for p in folder.iterdir()) == ["study.json", "trial-0", "trial-1"]
    for trial in study.trials:
        events = EventAccumulator(str(folder / f"trial-{trial.number}"))
        events.Reload()
        accuracy = events.Scalars("accuracy")
        assert [e.step for e in accuracy] == [128, 256]
        assert [round(e.value, 5) for e in accuracy] == [
            round(v, 5) for v in trial.intermediate_values.values()
        ]
        assert len(events.Scalars("eval_loss")) == 2
        assert "final/samples_per_s" in events.Tags()["scalars"]
        records = {
            tag: plugin_data_pb2.HParamsPluginData.FromString(content)
            for tag, content in events.PluginTagToContent("hparams").items()
        }
        experiment = records["_hparams_/experiment"].experiment
        assert {h.name for h in experiment.hparam_infos} == set(trial.params)
        assert {m.name.tag for m in experiment.metric_infos} == {"accuracy", "eval_loss"}
        start = records["_hparams_/session_start_info"].session_start_info
        assert start.hparams["learning_rate"].number_value == pytest.approx(
            trial.params["learning_rate"]
        )
        end = records["_hparams_/session_end_info"].session_end_info
        assert end.status == api_pb2.Status.Value("STATUS_SUCCESS")


def test_a_handed_back_trials_event_file_says_so_and_its_retry_writes_on_beside_it(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpo.tracking.events import StudyStart, TrialInterrupted, TrialStart
    from hpo.tracking.tensorboard_files import TensorboardFiles

    files = TensorboardFiles(str(tmp_path), "s", ["accuracy"])
    files.start_study(StudyStart("s", {}, {}, {}))
    files.start_trial(TrialStart(0, 0, {"learning_rate": 0.01}, "a:1", "a"))
    files.evaluation(0, 64, {"accuracy": 0.5})
    files.interrupt_trial(TrialInterrupted(0, 0, "interrupted: the worker got SIGTERM"))
    files.interrupt_trial(TrialInterrupted(1, 1, "lost its worker"))  # another worker's: nothing
    assert files.writers == {}
    files.start_trial(TrialStart(2, 0, {"learning_rate": 0.01}, "a:1", "a"))  # the retry
    files.evaluation(2, 128, {"accuracy": 0.75})
    files.close()
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["study.json", "trial-0"]
    events = EventAccumulator(str(tmp_path / "s" / "trial-0"), size_guidance={"tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("accuracy")] == [(64, 0.5), (128, 0.75)]
    said = [t.tensor_proto.string_val[0].decode() for t in events.Tensors("hpo/state/text_summary")]
    assert said == ["interrupted: the worker got SIGTERM"]
