"""Trials in Weights & Biases, on wandb's own parts in its offline mode (WANDB_MODE=offline:
runs written under a temporary WANDB_DIR, no server, the base URL a port where nothing listens),
read back with wandb's own reader of the .wandb transaction log (`wandb leet inspect`). A
wandb that hangs or raises costs no trial, and the API key is never shown."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

from hpo.config.schema import WandbTrackingConfig
from hpo.tracking.events import StudyStart, TrialEnd, TrialInterrupted, TrialStart
from tests.conftest import run_hpo, tiny_config, write_config

pytest.importorskip("wandb")

API_KEY = "wbk-Sekr1t-0123456789abcdef0123456789abcdef"


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """wandb offline, every folder it writes in tmp_path, and any request it might still try
    (to W&B's server or any other, through the proxy variables) sent to a socket here that
    must see no connection. wandb reads its environment once per process (its setup): torn
    down after each test, the next one's folder counts."""
    import wandb

    folder = tmp_path / "wandb-home"
    trap = socket.create_server(("127.0.0.1", 0), backlog=16)
    trap.setblocking(False)
    address = f"http://127.0.0.1:{trap.getsockname()[1]}"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", API_KEY)
    monkeypatch.setenv("WANDB_BASE_URL", address)
    for variable in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(variable, address)
    for variable in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(variable, raising=False)
    for variable in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(folder))
    for variable in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP", "WANDB_SILENT"):
        monkeypatch.delenv(variable, raising=False)
    folder.mkdir()
    yield folder
    wandb.teardown()
    with trap, pytest.raises(BlockingIOError):  # nothing connected: no request left the host
        trap.accept()


def _inspect(path: Path, *flags: str) -> str:
    """`wandb leet inspect FLAGS PATH`'s output. That command is a shim that runs wandb-core's
    reader with these arguments; run here directly, each read skips a Python start that imports
    wandb (about two seconds of CPU, some thirty reads in this file)."""
    from wandb.util import get_core_path

    command = [get_core_path(), "leet", "inspect", "--no-observability", *flags]
    command += ["--run-file", str(path), str(path.parent.parent)]
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=120).stdout


def _records_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in _inspect(path, "--json").splitlines() if line.strip()]


def _finished_records(path: Path, deadline_s: float = 60.0) -> list[dict[str, Any]]:
    """The records of a run this file's tests have finished, once its file holds them all
    (the exit record): wandb-core writes the file beside the process, and on a loaded host a
    read just after `finish()` once found only the header (a CI run). What is there at the
    deadline otherwise."""
    deadline = time.monotonic() + deadline_s
    records = _records_of(path)
    while not any(r["type"] == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.1)
        records = _records_of(path)
    return records


def read_runs(folder: Path) -> list[dict[str, Any]]:
    """Every offline run under `folder`, oldest first, as wandb's reader gives it: its summary
    view (config, summary, tags, state, exit code) with the run record's group and job type,
    the history rows (step -> the metrics logged at it) and every record ("records")."""
    runs = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        records = _finished_records(path)
        run = json.loads(_inspect(path, "--summary", "--json"))
        last = [r["run"] for r in records if r["type"] == "run"][-1]
        run["group"], run["job_type"] = last.get("run_group"), last.get("job_type")
        history = [r["history"] for r in records if r["type"] == "history"]
        run["history"] = {
            int(h["step"]["num"]): {k: v for k, v in h["item"].items() if not k.startswith("_")}
            for h in history
        }
        run["records"] = records
        runs.append(run)
    return runs


def _runs(**settings: Any) -> Any:
    from hpo.tracking.wandb_runs import WandbRuns

    return WandbRuns(WandbTrackingConfig(**settings), patience_s=10)


def _study(name: str = "s", retrain_of: str | None = None) -> StudyStart:
    params = {"objectives": "accuracy", "directions": "maximize", "sampler": "tpe"}
    return StudyStart(name, params, {}, {}, retrain_of)


def test_a_trials_run_holds_its_params_every_evaluation_its_summary_and_attributes(
    offline_wandb: Path,
) -> None:
    runs = _runs(project="sentiment", log_model=True)
    runs.start_study(_study("my study"))
    runs.start_trial(TrialStart(0, 0, {"learning_rate": 0.01, "warmup": 0.1}, "h:1", "h"))
    runs.evaluation(0, 64, {"accuracy": 0.5, "eval_loss": 1.0})
    runs.evaluation(0, 128, {"accuracy": 0.75, "eval_loss": 0.8})
    runs.evaluation(0, 192, {"accuracy": 0.625, "eval_loss": 0.9})
    model = offline_wandb.parent / "trial-0" / "best"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights")
    derived = {"physical_batch_size": 4, "grad_accum_steps": 2}
    runs.end_trial(TrialEnd(0, "complete", None, 192, {"samples_per_s": 9.5}, derived, str(model)))
    runs.close()
    [run] = read_runs(offline_wandb)
    assert (run["project"], run["group"], run["job_type"]) == ("sentiment", "my study", "trial")
    assert run["name"] == "trial 0" and run["state"] == "finished" and run["exit_code"] == 0
    assert run["tags"] == ["hpo", "trial", "complete"]
    config = run["config"]
    assert config["learning_rate"] == 0.01 and config["warmup"] == 0.1
    assert config["physical_batch_size"] == 4 and config["grad_accum_steps"] == 2
    assert config["hpo.study"] == "my study" and config["hpo.worker"] == "h:1"
    assert config["hpo.sampler"] == "tpe" and config["hpo.first_attempt"] == 0
    assert run["history"] == {
        64: {"accuracy": 0.5, "eval_loss": 1.0},
        128: {"accuracy": 0.75, "eval_loss": 0.8},
        192: {"accuracy": 0.625, "eval_loss": 0.9, "samples_per_s": 9.5},
    }
    summary = run["summary"]
    assert summary["best/accuracy"] == 0.75 and summary["accuracy"] == 0.625
    assert summary["hpo.state"] == "complete" and summary["hpo.best_model"] == str(model)
    [artifact] = [r["artifact"] for r in run["records"] if r["type"] == "artifact"]
    assert artifact["type"] == "model" and "best" in artifact["aliases"]
    assert [c["path"] for c in artifact["manifest"]["contents"]] == ["model.safetensors"]


def test_a_best_model_in_a_store_is_an_artifact_by_reference_not_a_copy(
    offline_wandb: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials in the environment, as where the store is used: boto3 looks for none on
    the network, and W&B records the reference without reading the store."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    runs = _runs(log_model=True)
    runs.start_study(_study())
    runs.start_trial(TrialStart(0, 0, {"learning_rate": 0.01}, "h:1", "h"))
    store = "s3://models/s/trial-0/best"
    runs.end_trial(TrialEnd(0, "complete", None, 0, {}, {}, store))
    [artifact] = [r["artifact"] for r in _records(offline_wandb) if r["type"] == "artifact"]
    [entry] = artifact["manifest"]["contents"]
    assert entry["ref"] == store and "local_path" not in entry


def test_a_best_model_wandb_cannot_log_leaves_the_trials_end_whole(
    offline_wandb: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import wandb

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(f"s3://models refused the key {API_KEY}")

    monkeypatch.setattr(wandb.Artifact, "add_reference", refuse)
    runs = _runs(log_model=True)
    runs.start_study(_study())
    runs.start_trial(TrialStart(0, 0, {"learning_rate": 0.01}, "h:1", "h"))
    runs.end_trial(TrialEnd(0, "complete", None, 0, {}, {}, "s3://models/s/best"))
    [run] = read_runs(offline_wandb)
    assert run["state"] == "finished" and run["summary"]["hpo.state"] == "complete"
    said = [r.getMessage() for r in caplog.records if "best model" in r.getMessage()]
    assert said == [
        "trial 0's best model is not in W&B: PermissionError: s3://models refused the key ***"
    ], said


def _records(folder: Path) -> list[dict[str, Any]]:
    [path] = folder.glob("wandb/offline-run-*/run-*.wandb")
    return _records_of(path)


def test_a_pruned_trial_finishes_saying_why_a_failed_one_fails_no_model_by_default(
    offline_wandb: Path,
) -> None:
    runs = _runs()
    runs.start_study(_study("s/with:odd#chars"))
    for number, state in ((0, "pruned"), (1, "failed")):
        runs.start_trial(TrialStart(number, number, {"learning_rate": 0.01}, "h:1", "h"))
        runs.evaluation(number, 64, {"accuracy": 0.25})
        reason = f"{state}: the reason"
        runs.end_trial(TrialEnd(number, state, reason, 64, {}, {}, "/no/such/folder"))
    ran = read_runs(offline_wandb)
    assert [r["project"] for r in ran] == ["hpo-s_with_odd_chars"] * 2
    assert [r["group"] for r in ran] == ["s/with:odd#chars"] * 2
    assert [(r["state"], r["exit_code"]) for r in ran] == [("finished", 0), ("failed", 1)]
    assert ran[0]["summary"]["hpo.pruned_reason"] == "pruned: the reason"
    assert ran[1]["summary"]["hpo.failed_reason"] == "failed: the reason"
    assert [r["tags"][-1] for r in ran] == ["pruned", "failed"]
    assert not any(r["type"] == "artifact" for run in ran for r in run["records"])


def test_a_handed_back_trial_ends_interrupted_and_its_retry_goes_on_in_the_same_run(
    offline_wandb: Path,
) -> None:
    runs = _runs(group="team-group", entity="my-team")
    runs.start_study(_study())
    runs.start_trial(TrialStart(0, 0, {"learning_rate": 0.01}, "a:1", "a"))
    runs.evaluation(0, 64, {"accuracy": 0.5})
    runs.interrupt_trial(TrialInterrupted(0, 0, "interrupted: the worker got SIGTERM"))
    runs.interrupt_trial(TrialInterrupted(1, 1, "lost its worker"))  # another worker's: nothing
    runs.start_trial(TrialStart(2, 0, {"learning_rate": 0.01}, "b:2", "b"))  # the retry
    runs.evaluation(2, 128, {"accuracy": 0.75})
    runs.end_trial(TrialEnd(2, "complete", None, 128, {}, {"physical_batch_size": 2}, None))
    first, retry = read_runs(offline_wandb)
    assert first["run_id"] == retry["run_id"] and retry["name"] == "trial 0"
    assert first["entity"] == retry["entity"] == "my-team"
    assert first["summary"]["hpo.state"] == "interrupted" and first["exit_code"] == 1
    assert "SIGTERM" in first["summary"]["hpo.interrupted_reason"]
    assert retry["config"]["hpo.retried_as"] == 2 and retry["config"]["hpo.worker"] == "b:2"
    assert (first["group"], retry["group"]) == ("team-group", "team-group")
    assert retry["history"] == {128: {"accuracy": 0.75}}
    assert retry["summary"]["hpo.state"] == "complete"


def test_hpos_runs_leave_the_users_own_wandb_run_alone(offline_wandb: Path) -> None:
    """A training function that logs to W&B itself (trial_isolation: none) keeps its run as
    wandb.run while hpo's trial runs start and end beside it."""
    import wandb

    own = wandb.init(project="mine", settings=wandb.Settings(silent=True, console="off"))
    runs = _runs()
    runs.start_study(_study())
    runs.start_trial(TrialStart(0, 0, {"learning_rate": 0.01}, "h:1", "h"))
    runs.evaluation(0, 64, {"accuracy": 0.5})
    runs.end_trial(TrialEnd(0, "complete", None, 64, {}, {}, None))
    assert wandb.run is own
    own.log({"own_metric": 1.0})
    own.finish()
    mine, hpos = sorted(read_runs(offline_wandb), key=lambda r: r["project"] != "mine")
    assert mine["project"] == "mine" and mine["history"] == {0: {"own_metric": 1.0}}
    assert hpos["history"] == {64: {"accuracy": 0.5}}


def test_a_retrains_runs_are_tagged_and_grouped_with_the_searched_study(
    offline_wandb: Path,
) -> None:
    runs = _runs()
    runs.start_study(_study("s [retrain top 2 x 3 seeds, ab12]", retrain_of="s"))
    runs.start_trial(TrialStart(0, 0, {"learning_rate": 0.01, "seed": 43}, "h:1", "h"))
    runs.end_trial(TrialEnd(0, "complete", None, 0, {}, {}, None))
    [run] = read_runs(offline_wandb)
    assert (run["project"], run["group"], run["job_type"]) == ("hpo-s", "s", "retrain")
    assert run["tags"] == ["hpo", "retrain", "complete"]
    assert run["config"]["hpo.retrain_of"] == "s" and run["config"]["seed"] == 43


def test_a_retrain_study_is_told_apart_by_the_plan_it_records() -> None:
    from hpo.config.schema import Config
    from hpo.study import retrain
    from hpo.tracking import RETRAIN_PLAN_ATTR, study_start

    assert retrain.PLAN_ATTR == RETRAIN_PLAN_ATTR
    searched = optuna.create_study(study_name="s")
    assert study_start(Config(), searched).retrain_of is None
    study = optuna.create_study(study_name="s [retrain top 1 x 2 seeds, ab12]")
    plan = retrain.RetrainPlan("s", [], [1, 2])
    study.set_user_attr(retrain.PLAN_ATTR, dataclasses.asdict(plan))
    assert study_start(Config(), study).retrain_of == "s"


def test_an_error_quoting_the_api_key_is_said_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    def refuse(**settings: Any) -> None:
        raise ConnectionError(f"POST https://api:{API_KEY}@api.wandb.ai/graphql refused")

    monkeypatch.setattr(wandb, "init", refuse)
    runs = _runs()
    runs.start_study(_study())
    with pytest.raises(RuntimeError) as raised:
        runs.start_trial(TrialStart(0, 0, {}, "h:1", "h"))
    assert API_KEY not in str(raised.value) and "ConnectionError" in str(raised.value)
    assert "***" in str(raised.value)


# -- hpo run, end to end --------------------------------------------------------------------


def _study_args(
    tmp_path: Path, data: tuple[Path, Path], tracking: dict, name: str, **study: Any
) -> list[str]:
    """`study` updates the config's study section."""
    raw = tiny_config(*data, study=study, training={"epochs": 1, "evals_per_epoch": 2})
    raw["tracking"] = tracking
    config = write_config(tmp_path / "study.yaml", raw)
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    return ["run", "--study", name, "--config", str(config), "--storage", storage]


def _no_key_anywhere(*places: Path) -> None:
    for place in places:
        files = [place] if place.is_file() else [p for p in place.rglob("*") if p.is_file()]
        for path in files:
            assert API_KEY.encode() not in path.read_bytes(), path


def test_hpo_run_logs_each_trial_to_wandb_offline_read_back_with_wandbs_reader(
    tmp_path: Path, easy_data: tuple[Path, Path], offline_wandb: Path
) -> None:
    """The real CLI: one run per trial in the study's group, its evaluations at step = samples
    trained (as MLflow's), the same values the study recorded; wandb writes nothing to hpo's
    output, and the API key is nowhere. Then `hpo retrain`'s run: job type and tag retrain,
    in the searched study's group."""
    tracking = {"wandb": {"project": "e2e"}}
    args = _study_args(tmp_path, easy_data, tracking, "wb study")
    done = run_hpo(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wandb" not in (done.stdout + done.stderr).lower()
    assert API_KEY not in done.stdout + done.stderr
    _no_key_anywhere(offline_wandb, tmp_path / "studies.db")
    study = optuna.load_study(study_name="wb study", storage=args[-1])
    ran = {r["config"]["hpo.trial"]: r for r in read_runs(offline_wandb)}
    assert sorted(ran) == [t.number for t in study.trials] == [0, 1]
    for trial in study.trials:
        run = ran[trial.number]
        assert (run["project"], run["group"], run["job_type"]) == ("e2e", "wb study", "trial")
        assert run["config"]["learning_rate"] == pytest.approx(trial.params["learning_rate"])
        assert run["config"]["physical_batch_size"] == trial.user_attrs["physical_batch_size"]
        assert sorted(run["history"]) == [128, 256]
        logged = [run["history"][step]["accuracy"] for step in (128, 256)]
        assert logged == pytest.approx(list(trial.intermediate_values.values()))
        assert run["summary"]["best/accuracy"] == pytest.approx(max(logged))
        assert run["summary"]["hpo.state"] == "complete" and run["state"] == "finished"
        assert "samples_per_s" in run["history"][256]
    final = tmp_path / "final"
    retrain = ["retrain", "--study", "wb study", *args[3:], "--top", "1", "--seeds", "1"]
    done = run_hpo(*retrain, "--out", str(final), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    retrained = [r for r in read_runs(offline_wandb) if r["job_type"] == "retrain"]
    assert len(retrained) == 1  # one configuration, one seed
    [run] = retrained
    assert (run["project"], run["group"], run["tags"]) == (
        "e2e",
        "wb study",
        ["hpo", "retrain", "complete"],
    )
    assert run["config"]["hpo.retrain_of"] == "wb study"
    assert run["config"]["hpo.study"].startswith("wb study [retrain top 1 x 1 seeds")


@pytest.mark.parametrize("how", ["hangs", "raises"])
def test_a_wandb_that_hangs_or_raises_costs_no_trial_and_each_gap_is_said_once(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """Every trial completes while wandb.init hangs (hpo run returns, the tracker's wait
    bounded by tracking.patience) or raises with the API key in its message: each trial is said
    missing from W&B once, without the key, and `hpo status` counts them."""
    import wandb

    release = threading.Event()
    waited_out = threading.Event()  # a hang that ran its course: hpo waited for it

    def init(**settings: Any) -> None:
        if how == "hangs" and not release.wait(120):
            waited_out.set()
        raise ConnectionError(f"https://api.wandb.ai refused the key {API_KEY}")

    monkeypatch.setattr(wandb, "init", init)
    tracking = {"wandb": {}, "patience": 1}
    # The trials train in this process (the tracker's calls are the worker's either way):
    # no trial process's start-up, twice.
    args = _study_args(tmp_path, easy_data, tracking, "down", trial_isolation="none")
    try:
        assert hpo_main(args) == 0
        assert not waited_out.is_set()  # hpo run ended while wandb.init still hung
        assert hpo_main(["status", "--study", "down", "--storage", args[-1]]) == 0
    finally:
        release.set()
        for thread in threading.enumerate():  # the hung call ends within the test
            if thread.name == "hpo-W&B":
                thread.join(30)
    out = capsys.readouterr()
    text = out.out + out.err
    study = optuna.load_study(study_name="down", storage=args[-1])
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    if how == "raises":
        for number in (0, 1):
            assert text.count(f"trial {number} is missing from W&B") == 1, text[-3000:]
    assert "the tracker is missing" in text, text[-3000:]
    assert API_KEY not in text and "Traceback" not in text
    _no_key_anywhere(tmp_path / "studies.db")


def test_a_closed_trackers_thread_ends_once_its_hung_call_returns() -> None:
    """A worker that ends while a call hangs gives it up; the thread does not outlive the
    call (in a notebook, each study's would otherwise wait for calls for ever)."""
    from hpo.tracking.background import BackgroundCalls

    release = threading.Event()
    calls = BackgroundCalls("T", patience_s=5)
    calls.submit(0, "its start", lambda: None if release.wait(60) else None)
    calls.submit(0, "its end", lambda: None)
    assert not calls.close(0.1)
    release.set()
    calls.thread.join(10)
    assert not calls.thread.is_alive()


def test_wandb_not_installed_is_one_line_naming_its_extra(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hpo.tracking

    monkeypatch.setattr(hpo.tracking, "installed", lambda module: module != "wandb")
    args = _study_args(tmp_path, easy_data, {"wandb": {"project": "p"}}, "no_extra")
    assert hpo_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hpo: error: tracking.wandb: wandb is not installed; pip install 'hpo[wandb]'"]
    assert not (tmp_path / "studies.db").exists()  # before anything is written


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"project": "team/sentiment"}, "tracking.wandb.project"),
        ({"group": " "}, "tracking.wandb.group"),
        ({"project": "x" * 129}, "tracking.wandb.project"),
    ],
)
def test_a_project_wandb_refuses_is_one_line_before_any_trial(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    settings: dict[str, str],
    said: str,
) -> None:
    args = _study_args(tmp_path, easy_data, {"wandb": settings}, "bad")
    assert hpo_main(args) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
    assert not (tmp_path / "studies.db").exists()
