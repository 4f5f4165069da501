"""Trials in MLflow and TensorBoard, on real parts: an MLflow tracking server started here on
127.0.0.1 (SQLite backend, its own artifact folder), read back through MLflow's own client; a
tracker that refuses costs no trial and is counted by `hpo status`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from hpo.tracking.background import BackgroundCalls, GiveUp
from tests.conftest import tiny_config, write_config


def _mlflow() -> Any:
    """MLflow (the dev extra installs it); the tests that need it are skipped without it."""
    return pytest.importorskip("mlflow")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _mlflow()
    folder = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
               f"sqlite:///{folder / 'mlflow.db'}", "--default-artifact-root",
               str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]  # fmt: skip
    log = (folder / "server.log").open("wb")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)  # fmt: skip
    started = time.monotonic()
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(
                f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}"
            )
        time.sleep(0.3)
    print(f"mlflow server up in {time.monotonic() - started:.1f} s")
    yield uri
    os.killpg(server.pid, signal.SIGTERM)  # the server and its uvicorn workers
    try:
        server.wait(3)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)
    log.close()


def _study_args(tmp_path: Path, data: tuple[Path, Path], tracking: dict, name: str) -> list[str]:
    raw = tiny_config(*data, training={"epochs": 1, "evals_per_epoch": 2})
    raw["tracking"] = tracking
    config = write_config(tmp_path / "study.yaml", raw)
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    return ["run", "--study", name, "--config", str(config), "--storage", storage]


def test_a_study_in_mlflow_parent_and_nested_runs_with_every_evaluation(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    mlflow_server: str,
    hpo_main: Callable[[list[str]], int],
) -> None:
    mlflow = _mlflow()
    args = _study_args(tmp_path, easy_data, {"mlflow": {"experiment": "tiny"}}, "tracked")
    assert hpo_main([*args, "--tracking", mlflow_server]) == 0
    client = mlflow.MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("hpo.kind") == "study"]
    trials = [r for r in runs if r.data.tags.get("hpo.kind") == "trial"]
    assert len(parents) == 1 and len(trials) == 2
    parent = parents[0]
    assert parent.data.params["sampler"] == "tpe" and parent.data.params["pruner"] == "median"
    assert parent.data.params["objectives"] == "accuracy"
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {
        "config.json", "search_space.json"}  # fmt: skip
    study = optuna.load_study(study_name="tracked", storage=args[-1])
    for run in trials:
        trial = study.trials[int(run.data.tags["hpo.first_attempt"])]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.info.status == "FINISHED" and run.data.tags["hpo.state"] == "complete"
        params = run.data.params
        assert float(params["learning_rate"]) == pytest.approx(trial.params["learning_rate"])
        assert params["physical_batch_size"] == str(trial.user_attrs["physical_batch_size"])
        assert params["grad_accum_steps"] == str(trial.user_attrs["grad_accum_steps"])
        assert run.data.tags["hpo.worker"] == trial.user_attrs["worker"]
        # Every evaluation, at the samples trained so far (2 per epoch of 256 examples).
        history = client.get_metric_history(run.info.run_id, "accuracy")
        assert [m.step for m in sorted(history, key=lambda m: m.step)] == [128, 256]
        assert [round(m.value, 6) for m in sorted(history, key=lambda m: m.step)] == [
            round(v, 6) for v in trial.intermediate_values.values()]  # fmt: skip
        assert len(client.get_metric_history(run.info.run_id, "eval_loss")) == 2
        assert {"samples_per_s", "peak_mem_bytes", "train_loss"} <= set(run.data.metrics)
        assert run.data.tags["hpo.best_model"] == trial.user_attrs["best_model"]


def test_a_retry_continues_its_run_and_the_ends_are_tags(mlflow_server: str) -> None:
    """The tracker's own calls against the server: a pruned first attempt and its retry (a
    later trial number, the same first attempt) share one run; a failure says why."""
    mlflow = _mlflow()
    from hpo.tracking.events import StudyStart, TrialEnd, TrialStart
    from hpo.tracking.mlflow_runs import MlflowRuns

    runs = MlflowRuns(mlflow_server, "retries", patience_s=5)
    runs.start_study(StudyStart("retried", {"sampler": "tpe"}, {}, {}))
    again = MlflowRuns(mlflow_server, "retries", patience_s=5)  # a second worker
    again.start_study(StudyStart("retried", {"sampler": "tpe"}, {}, {}))
    assert again.parent == runs.parent
    runs.start_trial(TrialStart(0, 0, {"learning_rate": 0.01}, "a:1", "a"))
    runs.evaluation(0, 64, {"accuracy": 0.5})
    again.start_trial(TrialStart(3, 0, {"learning_rate": 0.01}, "b:2", "b"))  # its retry
    again.evaluation(3, 128, {"accuracy": 0.75})
    again.end_trial(TrialEnd(3, "pruned", "pruner: accuracy=0.75 at evaluation 2", 128))
    runs.start_trial(TrialStart(1, 1, {"learning_rate": 0.02}, "a:1", "a"))
    runs.end_trial(TrialEnd(1, "failed", "RuntimeError: boom", 0,
                            derived={"physical_batch_size": 4}))  # fmt: skip
    client = mlflow.MlflowClient(mlflow_server)
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
        "RuntimeError: boom")  # fmt: skip
    assert failed.data.params["physical_batch_size"] == "4"


def test_a_tracker_that_refuses_costs_no_trial_and_status_counts_it(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    _mlflow()  # hpo[mlflow]: the client that finds nothing listening
    uri = f"http://hpo:s3cret-token@127.0.0.1:{_free_port()}"  # nothing listens there
    tracking = {"mlflow": {"uri": uri}, "patience": 1}
    args = _study_args(tmp_path, easy_data, tracking, "untracked")
    assert hpo_main(args) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "s3cret-token" not in text
    study = optuna.load_study(study_name="untracked", storage=args[-1])
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for number in (0, 1):
        assert text.count(f"trial {number} is missing from MLflow") == 1, text[-3000:]
    assert hpo_main(["status", "--study", "untracked", "--storage", args[-1]]) == 0
    status = capsys.readouterr().out
    assert "the tracker is missing 2 trials" in status, status
    assert "s3cret-token" not in status


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


def test_a_full_queue_gives_calls_up_without_blocking() -> None:
    calls = BackgroundCalls("MLflow", patience_s=5, max_waiting=1)
    slow_started = time.monotonic()
    calls.submit(0, "slow", lambda: time.sleep(0.5))
    for index in range(5):
        calls.submit(index + 1, f"call {index}", lambda: None)
    assert time.monotonic() - slow_started < 0.2  # never waits for the tracker
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
    assert err == [f"hpo: error: tracking.{tracker}: {tracker} is not installed; "
                   f"pip install 'hpo[{tracker}]'"], err  # fmt: skip
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
    args = _study_args(tmp_path, easy_data, tracking, "tb study")
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
            round(v, 5) for v in trial.intermediate_values.values()]  # fmt: skip
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
            trial.params["learning_rate"])  # fmt: skip
        end = records["_hparams_/session_end_info"].session_end_info
        assert end.status == api_pb2.Status.Value("STATUS_SUCCESS")
