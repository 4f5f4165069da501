"""SIGTERM (preemption, `docker stop`) and Ctrl-C: the worker stops its running trial, records it
as interrupted, hands it back to the study and exits; the next worker runs it again."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from hpo.trial.folders import study_folder_name
from tests.conftest import (
    hold_env,
    holding_metrics,
    record_faults,
    start_hpo,
    tiny_config,
    wait_until_held,
    wait_until_training,
    write_config,
)

STOP_TIMEOUT_S = 5


@pytest.mark.parametrize(
    ("signum", "whole_group", "exit_code", "loader_workers"),
    [
        (signal.SIGTERM, False, 0, 0),  # docker stop, Kubernetes: the worker alone
        (signal.SIGTERM, True, 0, 0),  # Slurm, systemd, timeout: every process of the worker
        (signal.SIGINT, True, 130, 0),  # Ctrl-C in a terminal: the whole foreground group
        # DataLoader worker processes, as on every GPU, get the group's signal too (found on an
        # H100: they died of it, and the trial failed instead of being handed back).
        (signal.SIGTERM, True, 0, 2),
        (signal.SIGINT, True, 130, 2),
    ],
)
def test_a_stopped_worker_hands_its_trial_back_and_the_next_worker_runs_it(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    signum: int,
    whole_group: bool,
    exit_code: int,
    loader_workers: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    url = f"sqlite:///{tmp_path / 'stop.db'}"
    study_settings = {"n_trials": 2, "pruner": {"type": "none"}, "stop_timeout": STOP_TIMEOUT_S}
    training = {"epochs": 1000, "num_workers": loader_workers}
    endless = tiny_config(*easy_data, study=study_settings, training=training)
    worker = _start_worker(write_config(tmp_path / "endless.yaml", endless), url, tmp_path)
    study = wait_until_training(url, "stop", [worker])
    sent = time.monotonic()
    if whole_group:
        os.killpg(worker.pid, signum)
    else:
        worker.send_signal(signum)
    _, stderr = worker.communicate(timeout=60)
    record_faults(study, faults=1, budget=0)  # the budget is checked after the second worker
    assert worker.returncode == exit_code, stderr[-3000:]
    took = time.monotonic() - sent
    assert took < STOP_TIMEOUT_S + 10, f"stopped after {took:.1f} s:\n{stderr[-3000:]}"
    # The stop is told in a line or two (handed back, stopped by ...), never as a traceback.
    assert "Traceback" not in stderr, stderr[-3000:]
    interrupted, retry = study.get_trials()
    assert interrupted.state == TrialState.FAIL, stderr[-3000:]
    assert interrupted.user_attrs["interrupted"] == signal.Signals(signum).name
    assert retry.state == TrialState.WAITING and retry.params == interrupted.params

    if whole_group:
        return  # the next worker's part is the same whoever got the signal
    # The next worker is hpo's main in this process, its trials in itself: it is not the one
    # stopped, and a subprocess took seconds to start.
    short = tiny_config(
        *easy_data, study={**study_settings, "trial_isolation": "none"}, training={"max_steps": 2}
    )
    monkeypatch.chdir(tmp_path)
    # Its config ends trials after 2 steps: another evaluation schedule, allowed deliberately.
    _run_in_process(
        hpo_main, write_config(tmp_path / "short.yaml", short), url, capsys, "--allow-changed-setup"
    )
    states = [(t.number, t.state) for t in study.get_trials()]
    assert states == [(0, TrialState.FAIL), (1, TrialState.COMPLETE), (2, TrialState.COMPLETE)]
    assert study.get_trials()[1].user_attrs["retry_of"] == 0


@pytest.mark.parametrize(
    ("moment", "signum"),
    [
        ("while the CLI loads", signal.SIGINT),
        ("while the CLI loads", signal.SIGTERM),
        ("while inputs are checked", signal.SIGTERM),
        ("while the fork server loads", signal.SIGINT),
    ],
)
def test_a_stop_as_a_worker_starts_ends_it_quietly(
    tmp_path: Path, easy_data: tuple[Path, Path], moment: str, signum: signal.Signals
) -> None:
    url = f"sqlite:///{tmp_path / 'stop.db'}"
    endless = tiny_config(*easy_data, study={"pruner": {"type": "none"}}, training={"epochs": 1000})
    config = write_config(tmp_path / "endless.yaml", endless)
    if moment == "while inputs are checked":  # held there until the signal was sent
        worker = _start_worker(config, url, tmp_path, env=_held_in_check_inputs(tmp_path))
        deadline = time.monotonic() + 120
        while not (tmp_path / "checking").exists():
            assert worker.poll() is None and time.monotonic() < deadline, "never checked inputs"
            time.sleep(0.02)
    else:
        worker = _start_worker(config, url, tmp_path)
    if moment == "while the CLI loads":
        time.sleep(0.2)  # a stop at any moment of the loading is this case: no moment to hit
    elif moment == "while the fork server loads":  # its trial process is being started
        deadline = time.monotonic() + 120
        while not _first_trial_asked(url) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
    os.killpg(worker.pid, signum)  # Ctrl-C in a terminal, or a scheduler's stop: the group
    (tmp_path / "go").touch()  # a check held where the stop did not interrupt it goes on
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == (130 if signum == signal.SIGINT else 0), stderr[-3000:]
    assert f"stopped by {signum.name}" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert "torch." not in stderr, stderr[-3000:]  # no library's INFO lines at exit
    if moment != "while the fork server loads":
        assert not (tmp_path / "stop.db").exists()  # stopped before anything was written


# Started before hpo's main (sitecustomize): `check_inputs` says it began, then waits for the
# test's "go" (after its signal), so the stop lands while inputs are checked on any machine.
HOLD_CHECK_INPUTS = """
import os, pathlib, time

import hpo.commands.run as run

checking = run.check_inputs


def held(*args, **kwargs):
    folder = pathlib.Path(os.environ["HPO_TEST_CHECK_FOLDER"])
    (folder / "checking").touch()
    deadline = time.monotonic() + 60
    while not (folder / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return checking(*args, **kwargs)


run.check_inputs = held
"""


def _held_in_check_inputs(folder: Path) -> dict[str, str]:
    site = folder / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD_CHECK_INPUTS, encoding="utf-8")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "HPO_TEST_CHECK_FOLDER": str(folder)}


def _first_trial_asked(url: str) -> bool:
    try:
        return bool(optuna.load_study(study_name="stop", storage=url).get_trials())
    except (KeyError, optuna.exceptions.StorageInternalError):
        return False  # no study (or no tables) yet


def _run_in_process(
    main: Callable[[list[str]], int],
    config: Path,
    url: str,
    capsys: pytest.CaptureFixture[str],
    *flags: str,
) -> None:
    """`hpo run` of study "stop" by hpo's main in this process, with `flags` added."""
    args = ["run", "--study", "stop", "--config", str(config), "--storage", url, *flags]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]


def _start_worker(
    config: Path, url: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    args = ("run", "--study", "stop", "--config", str(config), "--storage", url)
    return start_hpo(*args, cwd=cwd, env=env, own_group=True)


@pytest.mark.postgres
def test_a_preempted_trial_resumes_from_its_checkpoint_on_the_next_worker(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    url = postgres_url
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 1, "pruner": {"type": "none"}},
        # 96 steps, an evaluation every 8: the first holds until the SIGTERM arrives (a tiny
        # trial may otherwise finish training before it)
        training={"epochs": 3, "evals_per_epoch": 4},
    )
    raw["metrics"] = holding_metrics(tmp_path)
    config = write_config(tmp_path / "c.yaml", raw)
    held = tmp_path / "held"
    worker = _start_worker(config, url, tmp_path, env=hold_env(held, at=1, release="stop"))
    study = wait_until_training(url, "stop", [worker])
    wait_until_held(held, [worker])
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr[-3000:]
    folder = tmp_path / "hpo-checkpoints" / study_folder_name("stop") / "trial-0"
    assert (folder / "checkpoint.pt").is_file(), stderr[-3000:]

    # The next worker is hpo's main in this process, its trial in itself: the resume is the
    # subject, not the trial process.
    raw["study"]["trial_isolation"] = "none"
    monkeypatch.chdir(tmp_path)
    _run_in_process(hpo_main, write_config(tmp_path / "next.yaml", raw), url, capsys)
    record_faults(study, faults=1, budget=1)
    interrupted, retry = study.get_trials()
    assert interrupted.state == TrialState.FAIL and retry.state == TrialState.COMPLETE
    assert retry.user_attrs["resumed_at_step"] > 8  # SIGTERM checkpointed after evaluation 1
    assert sorted(retry.intermediate_values) == list(range(1, 13))  # the curve continues
    assert not (folder / "checkpoint.pt").exists()  # done: only the best model stays
    assert retry.user_attrs["best_model"] == str(folder / "best-model")
    assert (folder / "best-model" / "tokenizer_config.json").is_file()  # self-contained
    assert retry.user_attrs["checkpoint_s"] > 0  # what its checkpoints cost it
    assert hpo_main(["best", "--study", "stop", "--storage", url]) == 0
    assert f"model: {folder / 'best-model'}" in capsys.readouterr().out


def test_an_unwritable_checkpoint_folder_is_recorded_and_the_trial_completes(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": 1,
            "checkpoint_dir": str(tmp_path / "a-file" / "ckpt"),
            "trial_isolation": "none",
        },
        training={"max_steps": 4, "evals_per_epoch": 4},
    )
    url = f"sqlite:///{tmp_path / 'stop.db'}"
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, the trial in itself
    _run_in_process(hpo_main, write_config(tmp_path / "c.yaml", raw), url, capsys)
    trial = optuna.load_study(study_name="stop", storage=url).get_trials()[0]
    assert trial.state == TrialState.COMPLETE
    assert trial.user_attrs["checkpoint_error"].startswith("no checkpoints for this trial")
    assert "Not a directory" in trial.user_attrs["checkpoint_error"]


def test_a_worker_killed_between_a_trials_end_and_its_record_leaves_it_resumable(
    tmp_path: Path, easy_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trial trained to its end, but its worker died before the study recorded that: its
    resume state must still be there, so that the retry resumes rather than starts over (the
    trial once dropped its state before handing its result to the worker)."""
    from hpo.config.loader import load_config
    from hpo.stopping import StopRequest
    from hpo.storage import open_storage
    from hpo.storage.url import StorageURL
    from hpo.study.join import open_study
    from hpo.study.loop import run_trials
    from hpo.study.retry import retry_trial
    from hpo.study.trials import StudyTrials
    from hpo.trainer.model import load_tokenizer
    from hpo.trainer.tasks import prepare_data
    from hpo.trial.objective import Objective

    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": 1,
            "pruner": {"type": "none"},
            "trial_isolation": "none",
            "checkpoint_interval": 0,
            "checkpoint_dir": str(tmp_path / "hpo-checkpoints"),
        },
    )
    config = load_config(write_config(tmp_path / "c.yaml", raw))
    url = StorageURL(f"sqlite:///{tmp_path / 'k.db'}", "test")
    storage = open_storage(url, patience_s=30)
    study = open_study(storage, "k", config)
    data = prepare_data(config.data, load_tokenizer(config.model))
    folder = tmp_path / "hpo-checkpoints" / study_folder_name("k") / "trial-0"

    class WorkerKilled(BaseException):
        pass

    tell = StudyTrials.tell

    def killed_before_the_record(self: StudyTrials, trial: optuna.Trial, *args: object) -> bool:
        raise WorkerKilled

    monkeypatch.setattr(StudyTrials, "tell", killed_before_the_record)
    with pytest.raises(WorkerKilled):
        run_trials(study, storage, Objective(config, data, url, StopRequest()), StopRequest())
    assert (folder / "checkpoint.pt").is_file()  # kept until the trial's end is recorded
    assert study.get_trials()[0].state == TrialState.RUNNING

    monkeypatch.setattr(StudyTrials, "tell", tell)
    # What the next worker's sweep does once the dead worker's heartbeats are past the grace
    # period (its beats ended with this process's exception here, not with a kill).
    storage.set_trial_state_values(study.get_trials()[0]._trial_id, TrialState.FAIL)
    assert retry_trial(study, study.get_trials()[0], max_retries=2) == 1
    run_trials(study, storage, Objective(config, data, url, StopRequest()), StopRequest())
    killed, retry = study.get_trials()
    assert killed.state == TrialState.FAIL and retry.state == TrialState.COMPLETE
    assert retry.user_attrs["resumed_at_step"] > 0  # from the last evaluation's checkpoint
    assert not (folder / "checkpoint.pt").exists()  # recorded now: the state goes


def test_a_stop_as_the_database_opens_creates_no_study_and_says_no_trial_runs(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A SIGTERM after the inputs are checked, as the database opens: found by a hostile try,
    the log said "stopping the running trial and handing it back" (there was none) and the
    study was created after the signal."""
    import sqlalchemy as sa

    from hpo import storage
    from hpo.commands import run
    from hpo.commands.requests import RunRequest
    from hpo.config.loader import load_config
    from hpo.storage.url import resolve_storage_url

    url = f"sqlite:///{tmp_path / 'stop.db'}"
    config = load_config(write_config(tmp_path / "c.yaml", tiny_config(*easy_data)))
    inputs = run.WorkerInputs("s", config, resolve_storage_url(url, None), [], None, 1, {})
    checked = SimpleNamespace(config=config, gpus=[])  # what worker_inputs (faked) is given
    monkeypatch.setattr(run, "check_inputs", lambda request: checked)
    monkeypatch.setattr(run, "worker_inputs", lambda checked: inputs)
    real_open_storage = storage.open_storage

    def open_storage_on_sigterm(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
        return real_open_storage(*args, **kwargs)

    monkeypatch.setattr(storage, "open_storage", open_storage_on_sigterm)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        code = run.run_command(RunRequest(study="s", quiet=True))
    finally:
        signal.signal(signal.SIGINT, handlers[0])
        signal.signal(signal.SIGTERM, handlers[1])
    assert code == 0
    assert "SIGTERM received: stopping before the first trial" in caplog.text
    assert "handing it back" not in caplog.text
    assert "stopped by SIGTERM before the first trial" in capsys.readouterr().err
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        tables = sa.inspect(conn).get_table_names()
        studies = conn.execute(sa.text("SELECT study_name FROM studies")).all() if tables else []
    engine.dispose()
    assert studies == []


def test_a_second_ctrl_c_exits_at_once_and_raises_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Raised from the signal handler, the second Ctrl-C landed in a garbage collector's
    callback or an exit hook: a traceback, and the Ctrl-C ignored (found by a hostile try)."""
    from hpo.stopping import Interrupted, StopRequest

    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    for first in (signal.SIGINT, signal.SIGTERM):
        stop = StopRequest()
        stop._handle(first, None)
        stop._handle(signal.SIGTERM, None)  # a second SIGTERM changes nothing
        assert exits == [] and stop.signal_name == first.name
        stop._handle(signal.SIGINT, None)
        assert exits == [130]
        exits.clear()
    training_here = StopRequest(interrupt_at_once=True)  # the only way to stop it is to raise
    with pytest.raises(Interrupted):
        training_here._handle(signal.SIGINT, None)
    with pytest.raises(Interrupted):
        training_here._handle(signal.SIGINT, None)
    assert exits == []


@pytest.fixture
def signal_handlers() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGALRM as they were, and no timer left, after a test that installs
    a worker's handlers in this process."""
    numbers = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)
    saved = {number: signal.getsignal(number) for number in numbers}
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    for number, handler in saved.items():
        signal.signal(number, handler)


def _import_written(folder: Path, name: str, source: str) -> ModuleType:
    """Import `source` as the module `name` from `folder`, then forget it."""
    (folder / f"{name}.py").write_text(source, encoding="utf-8")
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    except KeyboardInterrupt as e:  # left to pytest, it would end the whole run
        pytest.fail(f"the stop was raised inside the import: {e!r}")
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(name, None)


def _import_signalled(folder: Path, name: str, signum: int, then: str = "") -> ModuleType:
    """Import a module that sends this process `signum` while it loads, then loads on for
    0.3 s (AFTER_IMPORT_CHECK_S looks in six times meanwhile), runs `then` (a call of this
    test module's), and leaves NAME.loaded in `folder` as its last act."""
    marker = str(folder / f"{name}.loaded")
    source = (
        f"import os, pathlib, time\nos.kill(os.getpid(), {int(signum)})\ntime.sleep(0.3)\n"
        + (f"from tests.test_stopping import past_inputs\n{then}\n" if then else "")
        + f"LOADED = True\npathlib.Path({marker!r}).touch()\n"
    )
    return _import_written(folder, name, source)


@pytest.mark.usefixtures("signal_handlers")
def test_a_stop_while_a_module_loads_is_raised_once_it_has_loaded(tmp_path: Path) -> None:
    """Raised inside an import, a stop landed where torch's C++ called back into Python as it
    loaded: the worker aborted (pybind11's error_already_set, exit -6; a CI run of
    test_a_stop_as_a_worker_starts_ends_it_quietly), or in numpy's lazy attributes
    (RecursionError). The worker checking its inputs now stops just after the import."""
    from hpo.stopping import Interrupted, StopRequest

    stop = StopRequest(interrupt_at_once=True, doing=StopRequest.BEFORE_FIRST_TRIAL)
    stop.install()
    # The import inside the raises block: the look-again alarm raises 0 to 50 ms after the
    # import, which on a loaded host can be before the next line runs (a CI run: the stop
    # landed between the two, outside any `raises`, and ended pytest's worker).
    with pytest.raises(Interrupted) as raised:
        _import_signalled(tmp_path, "loads_slowly", signal.SIGTERM)
        time.sleep(5)
    assert (tmp_path / "loads_slowly.loaded").exists()  # the import was not cut short
    assert raised.value.signal_name == "SIGTERM" == stop.signal_name
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL  # hpo's look-again handler gone
    # Past the inputs a worker only notes a signal: one held back by an import is not raised.
    # The worker moves past its inputs while the module still loads (the module itself says
    # so, after the signal): no moment where the alarm could find it stopping at once.
    noted = StopRequest(interrupt_at_once=True)
    noted.install()
    PAST_INPUTS.append(lambda: setattr(noted, "interrupt_at_once", False))
    try:
        _import_signalled(tmp_path, "loads_slowly_too", signal.SIGINT, then="past_inputs()")
    finally:
        PAST_INPUTS.clear()
    # The last look (0-50 ms after the module moved on) puts SIGALRM's handler back, raising
    # nothing: waited for with a deadline, the alarm's handler runs between these lines.
    deadline = time.monotonic() + 10
    while signal.getsignal(signal.SIGALRM) != signal.SIG_DFL and time.monotonic() < deadline:
        time.sleep(0.01)
    assert noted.signal_name == "SIGINT" and not noted.interrupt_at_once
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


PAST_INPUTS: list[Callable[[], None]] = []


def past_inputs() -> None:
    """Called by the module that test_a_stop_while_a_module_loads_... imports, as it loads."""
    for step in PAST_INPUTS:
        step()


@pytest.mark.usefixtures("signal_handlers")
def test_a_stop_while_the_cli_loads_is_said_once_it_has_loaded(tmp_path: Path) -> None:
    """`hpo`'s own handler, before the CLI has loaded, never raises inside an import either."""
    import hpo.__main__ as entry

    signal.signal(signal.SIGTERM, entry._interrupt)
    _import_signalled(tmp_path, "cli_loads", signal.SIGTERM)
    assert entry._stopped_while_loading == ["SIGTERM"]
    entry._stopped_while_loading.clear()


def test_inside_import_tells_a_module_loading_from_code_running(tmp_path: Path) -> None:
    from hpo.stopping import inside_import

    where = _import_written(
        tmp_path,
        "where",
        "import sys\nfrom hpo.stopping import inside_import\n"
        "AT_IMPORT = inside_import(sys._getframe())\n"
        "def later():\n    return inside_import(sys._getframe())\n",
    )
    assert where.AT_IMPORT is True and where.later() is False
    assert inside_import(sys._getframe()) is False and inside_import(None) is False


def test_a_second_ctrl_c_soon_after_the_first_ends_the_worker_quietly(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    study_settings = {"n_trials": 10, "pruner": {"type": "none"}, "stop_timeout": STOP_TIMEOUT_S}
    endless = tiny_config(*easy_data, study=study_settings, training={"epochs": 1000})
    config = write_config(tmp_path / "endless.yaml", endless)
    for gap_s in (0.05, 0.25, 0.3):  # while the trial checkpoints, is handed back, the exit
        url = f"sqlite:///{tmp_path / f'stop-{gap_s}.db'}"  # a study of its own: a new worker
        worker = _start_worker(config, url, tmp_path)
        wait_until_training(url, "stop", [worker])
        os.killpg(worker.pid, signal.SIGINT)
        time.sleep(gap_s)
        os.killpg(worker.pid, signal.SIGINT)
        _, stderr = worker.communicate(timeout=60)
        # -SIGINT: it came as the interpreter shut down, its handlers gone; a shell says 130.
        assert worker.returncode in (130, -signal.SIGINT), stderr[-3000:]
        assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
