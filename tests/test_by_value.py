"""Functions a trial process cannot import (a notebook's, `python -c`'s, objects given to
hpo.run) sent to it by value: how they are named, packed, weighed and refused; hpo.run's
summary; and the whole path through `python -c`, trial processes included.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hpo.api import RunResult, Trial
from hpo.api.showing import result_html, summary_lines
from hpo.errors import ConfigError
from hpo.plugins import by_value
from hpo.plugins.loading import load_plugin

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _nothing_kept() -> None:
    by_value.forget()


def test_a_module_function_is_named_by_its_import_path() -> None:
    assert by_value.spec_of(load_plugin, "entrypoint") == "hpo.plugins.loading:load_plugin"
    assert by_value.find("hpo.plugins.loading:load_plugin") is None  # imported, not sent


def test_a_lambda_or_closure_gets_a_main_name_of_its_own() -> None:
    def make(n: int):  # type: ignore[no-untyped-def]
        def train(ctx: object) -> float:
            return float(n)

        return train

    first, second = make(1), make(2)
    one, two = by_value.spec_of(first, "entrypoint"), by_value.spec_of(second, "entrypoint")
    assert one.startswith("__main__:") and two.startswith("__main__:") and one != two
    assert by_value.spec_of(first, "entrypoint") == one  # the same object: the same name
    assert load_plugin(one, "", "training.entrypoint") is first
    assert by_value.spec_of(lambda ctx: 1.0, "entrypoint").startswith("__main__:lambda")


def test_not_a_function_is_one_line() -> None:
    with pytest.raises(ConfigError, match="entrypoint: got 3; give a function"):
        by_value.spec_of(3, "entrypoint")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="give a function"):
        by_value.spec_of(dict, "entrypoint")


def test_packed_and_received_in_another_process_state() -> None:
    offset = 5.0

    def train(ctx: object) -> float:
        return offset + 1

    spec = by_value.spec_of(train, "training.entrypoint")
    by_value.keep(spec, train, "training.entrypoint")
    sent = by_value.packed()
    by_value.forget()  # as a fresh trial process: nothing but what it is sent
    by_value.receive(sent)
    received = by_value.find(spec)
    assert received is not None and received is not train
    assert received(None) == 6.0


def test_a_function_that_cannot_be_pickled_is_one_line_naming_what() -> None:
    lock = threading.Lock()

    def train(ctx: object) -> None:
        with lock:
            pass

    spec = by_value.spec_of(train, "training.entrypoint")
    with pytest.raises(ConfigError) as raised:
        by_value.keep(spec, train, "training.entrypoint")
    line = str(raised.value)
    assert "\n" not in line.strip()
    assert "cannot be sent to a trial process" in line and "`lock`" in line, line
    assert "study.trial_isolation: none" in line


def test_a_heavy_closure_is_weighed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    data = bytes(300_000)

    def train(ctx: object) -> int:
        return len(data)

    monkeypatch.setattr(by_value, "WARN_BYTES", 100_000)
    spec = by_value.spec_of(train, "training.entrypoint")
    by_value.keep(spec, train, "training.entrypoint")
    assert "sent to each trial process by value: 0.3 MiB" in caplog.text
    assert "`data`" in caplog.text
    by_value.forget()
    monkeypatch.setattr(by_value, "LIMIT_BYTES", 200_000)
    spec = by_value.spec_of(train, "training.entrypoint")
    with pytest.raises(ConfigError, match=r"weighs 0.3 MiB .*`data`.*load the data inside"):
        by_value.keep(spec, train, "training.entrypoint")


def _result(**changes: object) -> RunResult:
    fields: dict[str, object] = dict(
        study="s",
        trials_run=2,
        best=Trial(1, "complete", (0.5,), {"loss": 0.5}, {"lr": 0.01}, {}),
        pareto_front=(),
        trials={"complete": 2},
        stopped_by=None,
        storage="SQLite file /x/hpo.db",
        budget=2,
    )
    fields.update(changes)
    return RunResult(**fields)  # type: ignore[arg-type]


def test_the_summary_says_what_ran_and_when_nothing_did() -> None:
    lines = summary_lines(_result())
    assert lines[0] == "hpo: ran 2 trial(s)"
    assert "study 's' in SQLite file /x/hpo.db: 2 complete" in lines[1]
    assert lines[2] == "hpo: best trial #1: loss 0.5 with lr=0.01"
    spent = summary_lines(_result(trials_run=0))[0]
    assert "no trial ran" in spent and "budget (n_trials=2) is spent" in spent
    stopped = summary_lines(_result(trials_run=1, stopped_by="SIGINT"))[0]
    assert "stopped by SIGINT after 1 trial(s)" in stopped
    assert "<table>" in result_html(_result()) and "lr=0.01" in result_html(_result())


PYTHON_C = """
import hpo, os
offset = 0.5
def train(ctx):
    print("trained in", os.getpid(), flush=True)
    return {"loss": (ctx.params["lr"] - 0.01) ** 2 + offset}
config = {
    "study": {"metric": "loss", "direction": "minimize", "n_trials": 2},
    "search_space": {"lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True}},
}
print("worker", os.getpid(), flush=True)
result = hpo.run(config, study="c", storage="sqlite:///c.db", entrypoint=train)
print("best", result.best.value >= offset)
# Two lambdas in two runs of one session: the same name (__main__:lambda), each its own code.
config["study"]["n_trials"] = 1
seven = hpo.run(config, study="c7", storage="sqlite:///c.db", entrypoint=lambda ctx: 7.0)
nine = hpo.run(config, study="c9", storage="sqlite:///c.db", entrypoint=lambda ctx: 9.0)
print("values", seven.best.value, nine.best.value)
"""


@pytest.mark.slow
def test_python_c_function_runs_in_trial_processes(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PYTHON_C],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    worker = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("worker")]
    trained = [line.split()[2] for line in done.stdout.splitlines() if line.startswith("trained")]
    assert len(trained) == 2 and worker[0] not in trained, done.stdout  # not in the worker
    assert "best True" in done.stdout
    assert "values 7.0 9.0" in done.stdout
    assert "hpo: ran 2 trial(s)" in done.stderr, done.stderr[-3000:]


def test_an_entrypoint_given_to_run_is_set_over_a_config_file(tmp_path: Path) -> None:
    from hpo.commands.run import config_from

    path = tmp_path / "tune.yaml"
    path.write_text(
        "study: {metric: loss, direction: minimize}\n"
        "search_space: {lr: {type: float, low: 0.001, high: 0.1}}\n"
        "training: {entrypoint: elsewhere:train, device: cpu}\n"
    )
    assert config_from(path, "__main__:mine").training.entrypoint == "__main__:mine"
    assert config_from(path).training.entrypoint == "elsewhere:train"


def test_run_refuses_what_is_no_function_in_one_line(tmp_path: Path) -> None:
    import hpo

    config = {"study": {"metric": "loss", "direction": "minimize"}}
    with pytest.raises(hpo.ConfigError, match="entrypoint: got 3; give a function"):
        hpo.run(config, study="s", storage=f"sqlite:///{tmp_path}/x.db", entrypoint=3)  # type: ignore[arg-type]
    with pytest.raises(hpo.ConfigError, match="with gpus or workers_per_gpu, name it in the"):
        hpo.run(str(tmp_path / "c.yaml"), study="s", gpus="none", entrypoint=lambda ctx: 1.0)
    assert not (tmp_path / "x.db").exists()  # nothing written
