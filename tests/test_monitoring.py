"""hpo studies, best, status and dashboard on a study with known trials."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest

from hpo.reports import status as report
from tests.conftest import exit_code


def known_study(url: str) -> None:
    study = optuna.create_study(study_name="watched", storage=url, direction="maximize")
    for value in (0.91, 0.88):
        trial = study.ask({"learning_rate": optuna.distributions.FloatDistribution(1e-6, 1e-2)})
        trial.set_user_attr("wall_s", 1800.0)
        trial.set_user_attr("samples_per_s", 123.0)
        study.tell(trial, value)
    pruned = study.ask()
    pruned.set_user_attr("prune_reason", "oom: out of memory at physical batch 1")
    study.tell(pruned, state=optuna.trial.TrialState.PRUNED)
    failed = study.ask()
    failed.set_user_attr("fail_reason", "RuntimeError: CUDA error: device-side assert")
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    running = study.ask()
    running.set_user_attr("worker", "gpu-host-3:4242")
    optuna.create_study(study_name="other", storage=url)


def test_studies_best_and_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    # hpo's main in this process, as the CLI calls it: a subprocess each took seconds to start.
    url = f"sqlite:///{tmp_path / 'watch.db'}"
    known_study(url)

    def out(*args: str) -> str:
        code = hpo_main([*args, "--storage", url])
        said = capsys.readouterr()
        assert code == 0, said.err
        return said.out

    rows = {row["name"]: row for row in json.loads(out("studies", "--json"))}
    assert rows["watched"]["n_trials"] == 5 and rows["watched"]["best_value"] == 0.91
    assert rows["other"]["n_trials"] == 0
    assert "watched" in out("studies")

    best_trial = json.loads(out("best", "--study", "watched", "--json"))
    assert (best_trial["number"], best_trial["value"]) == (0, 0.91)
    assert best_trial["user_attrs"]["samples_per_s"] == 123.0

    report = json.loads(out("status", "--study", "watched", "--json"))
    assert report["trials"] == {"complete": 2, "pruned": 1, "fail": 1, "running": 1}
    assert (
        report["running"][0]["worker"] == "gpu-host-3:4242" and report["running"][0]["age_s"] >= 0
    )
    assert 1.0 <= report["device_hours"] < 1.01  # and the running trial's seconds so far
    assert report["prunes"] == {"oom": 1} and report["failures"] == {"RuntimeError": 1}
    text = out("status", "--study", "watched")
    assert "running #4 on gpu-host-3:4242" in text and "prune: 1 x oom" in text


def test_the_studies_table_keeps_its_columns_with_long_and_odd_names() -> None:
    from hpo.reports.text import studies_table

    names = ["s", "a-study-name-longer-than-thirty-characters-by-far", "two\nlines"]
    rows = [
        {
            "name": name,
            "direction": "maximize",
            "directions": ["maximize"],
            "n_trials": 3,
            "best_value": 0.5,
        }
        for name in names
    ]
    lines = studies_table(rows).splitlines()
    assert len(lines) == 4 and "two\\nlines" in lines[3]
    columns = {line.index("maximize") for line in lines[1:]}
    assert columns == {lines[0].index("direction")}


def test_unknown_study_and_no_best(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    url = f"sqlite:///{tmp_path / 'watch.db'}"
    known_study(url)
    assert hpo_main(["best", "--study", "nope", "--storage", url]) == 2
    assert "no study 'nope'" in capsys.readouterr().err
    assert hpo_main(["best", "--study", "other", "--storage", url]) == 2
    assert "no completed trial yet" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_dashboard(url: str, cwd: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`hpo dashboard` on `url` at a free port of localhost; returns the server and its port."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "hpo", "dashboard", "--storage", url, "--port", str(port)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    return server, port


def test_dashboard_serves_the_study_on_localhost(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'watch.db'}"
    known_study(url)
    server, port = start_dashboard(url, tmp_path)
    try:
        studies = _get_json(f"http://127.0.0.1:{port}/api/studies", server)
        watched = next(s for s in studies["study_summaries"] if s["study_name"] == "watched")
        detail = _get_json(f"http://127.0.0.1:{port}/api/studies/{watched['study_id']}", server)
        attrs = [{a["key"]: a["value"] for a in t["user_attrs"]} for t in detail["trials"]]
        assert len(detail["trials"]) == 5
        assert attrs[2]["prune_reason"].startswith("oom")
    finally:
        server.terminate()
        server.wait(timeout=30)  # a loaded machine is slow to stop it


def _get_json(address: str, server: subprocess.Popen[bytes]) -> dict:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(address, timeout=5) as response:
                return json.loads(response.read())
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.3)


# A WSGI app that gets its server's SIGTERM while it answers a request: the moment when
# wsgiref's own error handling once swallowed the stop and the dashboard served on.
_STOPPED_MID_REQUEST = """
import os, signal, sys
from hpo.commands.monitor import _serve
from hpo.stopping import Interrupted

def app(environ, start_response):
    os.kill(os.getpid(), signal.SIGTERM)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"answered"]

try:
    _serve(app, "127.0.0.1", int(sys.argv[1]), "serving")
except Interrupted as e:
    print("stopped by", e.signal_name)
"""


def test_a_sigterm_during_a_request_answers_it_then_stops_the_server(tmp_path: Path) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_MID_REQUEST, str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline() == "serving\n"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as response:
            assert response.read() == b"answered"
        out, err = server.communicate(timeout=30)
    finally:
        server.kill()
    assert server.returncode == 0 and out == "stopped by SIGTERM\n", err


def test_ended_needs_nothing_running_or_queued_and_the_budget_spent() -> None:
    def summary(budget: int | None, **states: int) -> dict:
        return {"trials": states, "budget": budget}

    assert not report.ended(summary(None))  # no trial yet
    assert not report.ended(summary(None, complete=3, running=1))
    assert not report.ended(summary(None, complete=3, waiting=1))  # a hand-back, queued
    assert report.ended(summary(None, complete=3, pruned=1))
    assert not report.ended(summary(8, complete=3, fail=1))  # workers will start more
    assert report.ended(summary(4, complete=3, fail=1))


def test_status_watch_refreshes_until_the_running_trial_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    url = f"sqlite:///{tmp_path / 'watch.db'}"
    study = optuna.create_study(study_name="w", storage=url, direction="maximize")
    study.set_user_attr("n_trials", 2)
    done = study.ask()
    study.tell(done, 0.5)
    running = study.ask()
    watcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hpo",
            "status",
            "--study",
            "w",
            "--storage",
            url,
            "--watch",
            "--interval",
            "0.2",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None
        first = watcher.stdout.readline()
        assert "study 'w': 1 complete, 1 running" in first
        time.sleep(1.0)
        assert watcher.poll() is None  # a trial runs: the watch goes on
        study.tell(running, 0.7)
        out, err = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, err
    assert "2 complete" in out and "best #1: 0.7\n" in out and "budget 2 trials" in out
    assert "study 'w' has ended" in err and "Traceback" not in err
    bad = ["status", "--study", "w", "--storage", url, "--watch", "--interval", "0"]
    assert exit_code(hpo_main, bad) == 2  # refused by hpo's main in this process
    assert "give seconds from 0.1 to 3600" in capsys.readouterr().err


def test_status_watch_ends_when_only_a_dead_workers_trial_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    import sqlalchemy as sa

    from hpo.storage.heartbeats import Heartbeats

    url = f"sqlite:///{tmp_path / 'watch.db'}"
    study = optuna.create_study(study_name="w", storage=url, direction="maximize")
    study.set_user_attr("grace_period_s", 1)
    orphan = study.ask()  # its worker was SIGKILLed: its beats stopped
    engine = sa.create_engine(url)
    Heartbeats(engine, study._study_id).start(orphan.number, "host:4242")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE hpo_heartbeats SET beat_at = '2000-01-01'"))
    engine.dispose()
    # hpo's main in this process, as the CLI calls it.
    code = hpo_main(["status", "--study", "w", "--storage", url, "--watch", "--interval", "0.2"])
    done = capsys.readouterr()
    assert code == 1, done.err
    assert "silent for" in done.out and "its worker is gone or hangs" in done.out
    assert "has stopped moving: no trial runs with a live worker" in done.err


def test_hpo_best_says_why_the_model_is_not_in_the_store() -> None:
    from hpo.reports.text import best_text

    attrs = {
        "best_model": "/data/hpo-checkpoints/s/trial-3/best-model",
        "checkpoint_error": "best-model not uploaded to s3://b/p: timed out",
    }
    best = {"study": "s", "number": 3, "value": 0.9, "params": {"lr": 0.001}, "user_attrs": attrs}
    text = best_text(best)
    assert "model: /data/hpo-checkpoints/s/trial-3/best-model" in text
    assert "not saved or not uploaded: best-model not uploaded to s3://b/p: timed out" in text
    best["user_attrs"]["best_model_uri"] = "s3://b/p/s/trial-3/best-model"  # uploaded after all
    assert "not uploaded" not in best_text(best)


def _plain_study(url: str, name: str, **attrs: object) -> optuna.Study:
    """A study that plain Optuna made, whose attributes happen to carry hpo's names."""
    study = optuna.create_study(study_name=name, storage=url, direction="maximize")
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    return study


def test_attributes_of_hpo_names_but_not_hpo_kinds_are_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    main = hpo_main
    from hpo.reports.document import html_page

    url = f"sqlite:///{tmp_path / 'odd.db'}"
    odd = {"n_trials": "ten", "grace_period_s": "long", "retrain": {"params": {"a": 1}}}
    study = _plain_study(url, "odd", **odd)

    def objective(trial: optuna.Trial) -> float:
        for key, value in (
            ("samples_per_s", "fast"),
            ("peak_mem_bytes", "lots"),
            ("physical_batch_size", "big"),
            ("hpo:number", "x"),
        ):
            trial.set_user_attr(key, value)
        return trial.suggest_float("x", 0, 1)

    study.optimize(objective, n_trials=3)
    assert main(["status", "--study", "odd", "--storage", url, "--watch", "--interval", "0.1"]) == 0
    assert main(["best", "--study", "odd", "--storage", url]) == 0
    out = capsys.readouterr().out
    assert "budget" not in out and "retrain winner" not in out
    page = html_page(optuna.load_study(study_name="odd", storage=url))
    assert "no trial has recorded its throughput yet" in page  # not drawn, and the page is whole
    _plain_study(url, "yes", retrain="yes").optimize(lambda t: t.suggest_float("x", 0, 1), 1)
    assert main(["best", "--study", "yes", "--storage", url]) == 0


def test_a_study_deleted_while_hpo_reads_it_is_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    main = hpo_main
    url = f"sqlite:///{tmp_path / 'gone.db'}"
    _plain_study(url, "gone").optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    load = optuna.load_study

    def load_then_lose(**kwargs: Any) -> optuna.Study:
        study = load(**kwargs)
        optuna.delete_study(study_name="gone", storage=url)
        return study

    monkeypatch.setattr(optuna, "load_study", load_then_lose)
    assert main(["status", "--study", "gone", "--storage", url, "--watch"]) == 2
    assert "study 'gone' is no longer in" in capsys.readouterr().err


def test_json_output_is_strict_json_with_infinite_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    main = hpo_main
    url = f"sqlite:///{tmp_path / 'inf.db'}"
    values = iter([float("inf"), float("-inf"), 0.5])
    _plain_study(url, "inf").optimize(lambda t: (t.suggest_float("x", 0, 1), next(values))[1], 3)

    def reject(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    for command in (["studies"], ["best", "--study", "inf"], ["status", "--study", "inf"]):
        assert main([*command, "--storage", url, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out, parse_constant=reject)
        assert "inf" in json.dumps(shown)
    assert main(["best", "--study", "inf", "--storage", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["value"] == "inf"  # float("inf") reads it back


def test_numbers_are_shown_with_four_significant_digits() -> None:
    from hpo.numbers import metric_text, number_text, params_text

    assert number_text(0.873412345678901) == "0.8734"
    assert number_text(3.2e-05) == "3.2e-05" and number_text(0.1) == "0.1"
    assert number_text(32) == "32" and number_text("linear") == "linear"
    assert metric_text("accuracy", 0.873412345678901) == "accuracy 0.8734"
    assert metric_text(None, 0.5) == "0.5"  # a study plain Optuna made names no metric
    params = {
        "learning_rate": 3.2041234567890125e-05,
        "effective_batch_size": 32,
        "scheduler": "cosine",
    }
    assert params_text(params) == (
        "learning_rate=3.204e-05, effective_batch_size=32, scheduler=cosine"
    )


def _named_study(url: str) -> None:
    """A study as hpo makes it: its metric named, a learning rate of 16 digits."""
    study = optuna.create_study(study_name="named", storage=url, direction="maximize")
    study.set_metric_names(["accuracy"])
    space = {
        "learning_rate": optuna.distributions.FloatDistribution(1e-6, 1e-2, log=True),
        "effective_batch_size": optuna.distributions.IntDistribution(8, 64),
    }
    trial = study.ask(space)
    study.tell(trial, 0.873412345678901)


def test_best_and_status_name_the_metric_and_keep_full_digits_in_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    # Issue 42: `hpo best` printed `0.8734 ({'learning_rate': 3.2041234567890125e-05, ...})`.
    url = f"sqlite:///{tmp_path / 'named.db'}"
    _named_study(url)
    study = optuna.load_study(study_name="named", storage=url)
    rate = study.best_trial.params["learning_rate"]
    batch = study.best_trial.params["effective_batch_size"]
    params = f"(learning_rate={rate:.4g}, effective_batch_size={batch})"

    def out(*args: str) -> str:
        code = hpo_main([*args, "--storage", url])
        said = capsys.readouterr()
        assert code == 0, said.err
        return said.out

    best = out("best", "--study", "named")
    assert best.startswith(f"best trial #0 of 'named': accuracy 0.8734 {params}"), best
    status = out("status", "--study", "named")
    assert f"best #0: accuracy 0.8734 {params}" in status, status
    assert repr(rate) not in best + status  # no float's 16 digits
    shown = json.loads(out("best", "--study", "named", "--json"))
    assert shown["value"] == 0.873412345678901 and shown["metric"] == "accuracy"
    assert shown["params"]["learning_rate"] == rate  # every digit for machines
    shown = json.loads(out("status", "--study", "named", "--json"))
    assert shown["best"]["value"] == 0.873412345678901 and shown["best"]["metric"] == "accuracy"


def test_a_pareto_front_trial_names_each_metric() -> None:
    from hpo.reports.text import best_text

    front = {
        "study": "s",
        "number": 2,
        "values": [0.8734123, 412.345678],
        "metrics": ["accuracy", "samples_per_s"],
        "params": {"learning_rate": 1e-4},
        "user_attrs": {},
    }
    assert best_text(front) == (
        "Pareto-front trial #2 of 's': accuracy 0.8734, samples_per_s 412.3 (learning_rate=0.0001)"
    )
    lines = report.status_lines(
        {
            "study": "s",
            "trials": {"complete": 3},
            "running": [],
            "best": None,
            "pareto_front": [front],
            "device_hours": 0.1,
            "trials_per_hour": None,
            "failures": {},
            "prunes": {},
        }
    )
    assert "Pareto front #2: accuracy 0.8734, samples_per_s 412.3 (learning_rate=0.0001)" in lines


def test_ended_for_good_needs_the_budget_spent_by_counted_trials() -> None:
    def summary(budget: int | None, counted: int, **states: int) -> dict:
        return {"trials": states, "budget": budget, "counted": counted}

    assert report.ended_for_good(summary(2, 2, complete=2))
    assert report.ended_for_good(summary(2, 2, complete=1, pruned=1))
    # No budget: nothing running may be a worker between two trials.
    assert report.ended(summary(None, 2, complete=2))
    assert not report.ended_for_good(summary(None, 2, complete=2))
    # A failed trial that a retry replaced is not counted: a worker starts another.
    assert not report.ended_for_good(summary(3, 2, complete=2, fail=1))
    assert not report.ended_for_good(summary(2, 2, complete=1, running=1))


def test_status_watch_on_a_finished_study_says_so_at_the_first_refresh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    # Issue 42: it refreshed twice, `--interval` apart, before saying that the study had ended.
    url = f"sqlite:///{tmp_path / 'done.db'}"
    study = optuna.create_study(study_name="done", storage=url, direction="maximize")
    study.set_user_attr("n_trials", 2)
    for value in (0.5, 0.7):
        study.tell(study.ask(), value)
    started = time.monotonic()
    code = hpo_main(["status", "--study", "done", "--storage", url, "--watch", "--interval", "30"])
    said = capsys.readouterr()
    assert code == 0, said.err
    assert time.monotonic() - started < 20  # no second refresh, 30 s later
    assert said.out.count("study 'done': 2 complete") == 1, said.out
    assert "study 'done' has ended" in said.err


def test_the_services_return_what_the_cli_prints_and_print_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    """hpo.services, under both `hpo best`/`hpo status` and hpo.Study: data, no output; the
    status with the study's artifact store where the CLI shows it, without it for the API."""
    from hpo import services

    url = f"sqlite:///{tmp_path / 'watch.db'}"
    known_study(url)
    store = tmp_path / "store"
    store.mkdir()
    optuna.load_study(study_name="watched", storage=url).set_user_attr(
        services.ARTIFACT_STORE_ATTR, f"file://{store}"
    )
    storage, storage_url = services.open_storage_to_read(url)
    study = services.load_existing_study(storage, "watched", storage_url.masked)
    best = services.best(study, storage)
    status = services.status(study, storage, None)
    plain = services.status(study, storage, with_store=False)
    assert capsys.readouterr() == ("", "")
    assert [trial["number"] for trial in best.trials] == [0]
    assert (best.retrained, best.objectives) == (None, 1)
    assert status["artifact_store"]["url"] == f"file://{store}"
    assert "artifact_store" not in plain and plain["trials"] == status["trials"]
    assert hpo_main(["best", "--study", "watched", "--storage", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(
        json.dumps(best.trials[0], default=str)
    )
    assert hpo_main(["status", "--study", "watched", "--storage", url, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["artifact_store"] == status["artifact_store"]
    assert printed["trials"] == status["trials"]
    storage.engine.dispose()


def test_a_sharded_trial_records_and_shows_what_each_rank_holds() -> None:
    """rank_state_bytes goes from the run's result to the trial, and `hpo status` and `hpo best`
    show it; a trial that holds its state whole shows nothing of the kind."""
    from hpo.reports.text import best_text
    from hpo.trainer.result import TrainResult
    from hpo.trial.training import record_result

    recorded: dict[str, object] = {}

    class Trial:
        def set_user_attr(self, key: str, value: object) -> None:
            recorded[key] = value

    result = TrainResult(
        "completed", None, [], None, 64, 4, 8, 10, 1.0, 0.0, 2**31, 1.0, 1.0, 0.1, "cpu",
        "fp32", "adamw", "accuracy", rank_state_bytes=3 * 2**29,
    )  # fmt: skip
    record_result(Trial(), result)  # type: ignore[arg-type]
    assert recorded["rank_state_bytes"] == 3 * 2**29
    best = {"study": "s", "number": 1, "value": 0.9, "params": {}, "user_attrs": recorded}
    best["user_attrs"]["ranks"] = 2
    shown = "1.5 GiB of weights and optimizer state a rank (2 ranks)"
    assert f"memory: {shown}" in best_text(best)
    summary = {
        "study": "s",
        "trials": {"complete": 1},
        "running": [],
        "best": best,
        "pareto_front": None,
        "device_hours": 0.1,
        "trials_per_hour": None,
        "failures": {},
        "prunes": {},
    }
    assert f"  {shown}" in report.status_lines(summary)
    recorded.clear()
    record_result(Trial(), dataclasses.replace(result, rank_state_bytes=None))  # type: ignore[arg-type]
    assert "rank_state_bytes" not in recorded and "memory" not in best_text(best)
