"""Each trial in its own process: reports and pruning reach the study live, a crash fails only
that trial, and a stop request ends the trial process and hands the trial back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import forkserver
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpo.config.loader import load_config
from hpo.config.schema import Config
from hpo.stopping import StopRequest
from hpo.storage import open_storage
from hpo.storage.url import StorageURL
from hpo.study.loop import run_trials
from hpo.trial.objective import Objective
from hpo.trial.process import TrialLimits, TrialProcess, run_in_child
from hpo.trial.protocol import TrialTarget
from tests import trial_targets
from tests.conftest import tiny_config, write_config


def _study(tmp_path: Path, pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    return optuna.create_study(
        study_name="iso", storage=f"sqlite:///{tmp_path / 'iso.db'}", pruner=pruner
    )


def _run(study: optuna.Study, target: TrialTarget, payload: object = None) -> None:
    def objective(trial: optuna.Trial) -> float:
        return run_in_child(trial, target, payload, StopRequest(), TrialLimits(5))

    study.optimize(objective, n_trials=1, catch=(Exception,))


def test_reports_reach_the_study_live_and_the_pruner_stops_the_trial(tmp_path: Path) -> None:
    study = _study(tmp_path, optuna.pruners.ThresholdPruner(upper=2.5))
    payload = {"study": "iso", "storage": f"sqlite:///{tmp_path / 'iso.db'}"}
    _run(study, trial_targets.report_until_pruned, payload)
    trial = study.get_trials()[0]
    assert trial.state == TrialState.PRUNED
    assert trial.intermediate_values == {0: 0.0, 1: 1.0, 2: 2.0, 3: 3.0}
    assert trial.user_attrs["pruned_at"] == 3


def test_a_crashed_trial_process_fails_its_trial_and_the_next_trial_runs(tmp_path: Path) -> None:
    study = _study(tmp_path)
    _run(study, trial_targets.kill_itself)
    _run(study, trial_targets.return_one)
    crashed, ok = study.get_trials()
    assert crashed.state == TrialState.FAIL
    assert "killed (SIGKILL)" in crashed.user_attrs["fail_reason"]
    assert crashed.user_attrs["child_pid"] != os.getpid()
    assert ok.state == TrialState.COMPLETE and ok.value == 1.0


def test_an_error_in_the_trial_process_fails_the_trial(tmp_path: Path) -> None:
    study = _study(tmp_path)
    _run(study, trial_targets.raise_error)
    trial = study.get_trials()[0]
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["fail_reason"] == "ValueError: bad luck in the child"


@pytest.fixture
def stub_config(tmp_path: Path, easy_data: tuple[Path, Path]) -> Config:
    raw = tiny_config(*easy_data, study={"n_trials": 3, "stop_timeout": 1.0})
    return load_config(write_config(tmp_path / "c.yaml", raw))


@pytest.mark.parametrize("target", [trial_targets.sleep_forever, trial_targets.ignore_sigterm])
# A signal to the whole process group (Slurm, systemd, `timeout`) kills the fork server too; the
# worker must still wait for its trial process, and kill it after the timeout (seen in CI: the
# worker exited at once and the trial process went on, orphaned).
@pytest.mark.parametrize("fork_server_dies", [False, True])
def test_a_stop_request_ends_the_trial_process_and_hands_the_trial_back(
    tmp_path: Path, stub_config: Config, target: TrialTarget, fork_server_dies: bool
) -> None:
    study, ran, seconds = _stop_once_started(tmp_path, stub_config, target, fork_server_dies)
    assert ran == 0
    # A child that ignores SIGTERM is killed after study.stop_timeout (1 s).
    assert seconds < 20
    assert _gone(int((tmp_path / "child.pid").read_text()))
    interrupted, retry = study.get_trials()
    assert interrupted.state == TrialState.FAIL
    assert interrupted.user_attrs["interrupted"] == "SIGTERM"
    assert interrupted.user_attrs["fail_reason"] == "interrupted: the worker got SIGTERM"
    assert retry.state == TrialState.WAITING
    assert retry.params == interrupted.params
    assert retry.user_attrs["retry_of"] == 0 and "interrupted" not in retry.user_attrs
    assert retry.system_attrs["failed_trial"] == 0


def test_the_timeout_counts_from_the_worker_start(tmp_path: Path, stub_config: Config) -> None:
    """`--timeout 0.001`: the data took longer than that to prepare, so no trial starts (the
    deadline once counted from the loop's start, and a fast one ran a trial)."""
    url = StorageURL(f"sqlite:///{tmp_path / 'iso.db'}", "test")
    storage = open_storage(url)
    study = optuna.create_study(study_name="iso", storage=storage)

    def trials_run(timeout: float, started: float) -> int:
        stub_config.study.timeout = timeout
        target = trial_targets.return_one
        objective = Objective(stub_config, None, url, StopRequest(), target=target)  # type: ignore[arg-type]
        return run_trials(study, storage, objective, StopRequest(), started=started)

    assert trials_run(0.5, started=time.monotonic() - 1.0) == 0  # started a second ago
    assert study.get_trials() == []
    assert trials_run(600.0, started=time.monotonic() - 1.0) == 3  # the budget: n_trials 3


def _stop_once_started(
    tmp_path: Path, config: Config, target: TrialTarget, fork_server_dies: bool = False
) -> tuple[optuna.Study, int, float]:
    """Run trials of `target` and ask the worker to stop once the trial process has written its
    pid (optionally killing the fork server first, as a group signal does); returns the study,
    the trials the worker ran and how long it took."""
    url = StorageURL(f"sqlite:///{tmp_path / 'iso.db'}", "test")
    storage = open_storage(url)
    study = optuna.create_study(study_name="iso", storage=storage)
    stop = StopRequest()
    pid_file = tmp_path / "child.pid"

    def preempt() -> None:
        while not pid_file.exists():
            time.sleep(0.05)
        if fork_server_dies:
            os.kill(forkserver._forkserver._forkserver_pid, signal.SIGTERM)  # type: ignore[attr-defined]
        stop.signal_name = "SIGTERM"

    threading.Thread(target=preempt, daemon=True).start()
    objective = Objective(config, None, url, stop, target=target)  # type: ignore[arg-type]
    started = time.monotonic()
    ran = run_trials(study, storage, objective, stop)
    return study, ran, time.monotonic() - started


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie that its parent (init, for an orphan) has not yet
    reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_what_a_killed_trial_process_started_is_ended_by_its_worker(
    tmp_path: Path, stub_config: Config, caplog: pytest.LogCaptureFixture
) -> None:
    """The trial process ignores the stop and is killed after study.stop_timeout, so it cannot
    end the child its trial forked: the worker does (hpo/trial/leftovers.py)."""
    target = trial_targets.fork_then_ignore_sigterm
    _, _, seconds = _stop_once_started(tmp_path, stub_config, target)
    assert seconds < 20
    forked = int((tmp_path / "forked.pid").read_text())
    deadline = time.monotonic() + 10
    while not _gone(forked) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(forked)
    assert "left 1 process running; ended it" in caplog.text


@pytest.mark.parametrize("target", [trial_targets.sleep_forever, trial_targets.train_until_stopped])
def test_a_stop_ends_a_trial_process_at_once_before_training_and_after_a_checkpoint_once_training(
    tmp_path: Path, easy_data: tuple[Path, Path], target: TrialTarget
) -> None:
    # Before its first training step (batch search, model build: many seconds on a GPU) a trial
    # process has nothing to save and exits on SIGTERM at once, without waiting for a step.
    raw = tiny_config(*easy_data, study={"n_trials": 3, "stop_timeout": 60.0})
    config = load_config(write_config(tmp_path / "c.yaml", raw))
    study, _, seconds = _stop_once_started(tmp_path, config, target)
    assert seconds < 30  # not the 60 s stop timeout
    assert _gone(int((tmp_path / "child.pid").read_text()))
    checkpointed = (tmp_path / "checkpointed").exists()
    assert checkpointed == (target is trial_targets.train_until_stopped)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL, TrialState.WAITING]


def test_a_sigterm_the_worker_did_not_send_hands_the_trial_back_with_that_reason(
    tmp_path: Path,
) -> None:
    from hpo.stopping import HandBack

    study = _study(tmp_path)
    trial = study.ask()
    with pytest.raises(HandBack, match="did not send"):
        run_in_child(
            trial, trial_targets.sigterm_itself_while_training, None, StopRequest(), TrialLimits(5)
        )
    assert "did not send" in study.get_trials()[0].user_attrs["fail_reason"]


@dataclass(frozen=True)
class _Base:
    data: str = "sent once, when the process starts"
    params: str = ""  # the name of the trial body in tests.trial_targets


def _run_kept(
    study: optuna.Study, process: TrialProcess, bodies: list[TrialTarget]
) -> list[optuna.trial.FrozenTrial]:
    """One trial per body, each in the kept trial process if it is still fit for one."""
    for body in bodies:
        trial = study.ask()
        try:
            study.tell(trial, process.run(trial, {"params": body.__name__}))
        except Exception:
            study.tell(trial, state=TrialState.FAIL)
    return study.get_trials()


def _kept_process() -> TrialProcess:
    return TrialProcess(trial_targets.run_named, _Base(), StopRequest(), TrialLimits(5))


def test_a_kept_trial_process_runs_trial_after_trial_and_gets_only_their_changes(
    tmp_path: Path,
) -> None:
    study = _study(tmp_path)
    process = _kept_process()
    try:
        trials = _run_kept(study, process, [trial_targets.record_pid] * 3)
    finally:
        process.close()
    pids = {t.user_attrs["child_pid"] for t in trials}
    assert len(pids) == 1 and os.getpid() not in pids and process.started == 1
    assert [t.user_attrs["payload"]["params"] for t in trials] == ["record_pid"] * 3
    assert [t.user_attrs["process_trials"] for t in trials] == [1, 2, 3]
    assert trials[0].user_attrs["payload"]["data"] == "sent once, when the process starts"
    assert _gone(trials[0].user_attrs["child_pid"])  # closed: the idle process exited


@pytest.mark.parametrize(
    "ending",
    [trial_targets.raise_error, trial_targets.ask_to_be_replaced, trial_targets.leak_memory],
    ids=["the trial failed", "the trial asked", "memory grew"],
)
def test_a_trial_process_is_replaced_after_a_trial_that_may_have_spoilt_it(
    tmp_path: Path, ending: TrialTarget
) -> None:
    study = _study(tmp_path)
    # Memory growth counts from the end of the process's first trial.
    first = (
        trial_targets.leak_memory
        if ending is trial_targets.leak_memory
        else trial_targets.record_pid
    )
    process = _kept_process()
    try:
        _run_kept(study, process, [first, ending, trial_targets.record_pid])
    finally:
        process.close()
    before, spoilt, after = study.get_trials()
    failed = ending is trial_targets.raise_error
    assert spoilt.state == (TrialState.FAIL if failed else TrialState.COMPLETE)
    if not failed:
        assert spoilt.user_attrs["child_pid"] == before.user_attrs["child_pid"]
    assert after.user_attrs["child_pid"] != before.user_attrs["child_pid"]
    assert process.started == 2


def test_cuda_memory_a_process_keeps_on_purpose_is_not_taken_for_a_leak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hpo.trial import child as trial_process

    # After the first trial: 200 MiB of cuBLAS and attention workspaces, kept by design.
    allocated = iter([200, 200, 230, 200 + 65])
    monkeypatch.setattr(trial_process, "_cuda_allocated_bytes", lambda: next(allocated) * 2**20)
    monkeypatch.setattr(trial_process, "_resident_bytes", lambda: None)
    watch = trial_process._MemoryWatch()
    assert [watch.fit() for _ in range(4)] == [True, True, True, False]


def test_a_trial_process_that_died_while_idle_is_replaced_and_the_trial_runs(
    tmp_path: Path,
) -> None:
    study = _study(tmp_path)
    process = _kept_process()
    try:
        (first,) = _run_kept(study, process, [trial_targets.record_pid])
        os.kill(first.user_attrs["child_pid"], signal.SIGKILL)
        second = _run_kept(study, process, [trial_targets.record_pid])[-1]
    finally:
        process.close()
    assert second.state == TrialState.COMPLETE
    assert second.user_attrs["child_pid"] != first.user_attrs["child_pid"]


def test_a_worker_that_exits_without_closing_its_trial_process_does_not_hang(
    tmp_path: Path,
) -> None:
    script = f"""
import optuna
from hpo.stopping import StopRequest
from hpo.trial.process import TrialLimits, TrialProcess
from tests import trial_targets
study = optuna.create_study(storage="sqlite:///{tmp_path / "exit.db"}")
trial = study.ask()
process = TrialProcess(trial_targets.record_pid, None, StopRequest(), TrialLimits(5))
study.tell(trial, process.run(trial))
print(study.get_trials()[0].user_attrs["child_pid"])
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    child = int(result.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while not _gone(child):
        assert time.monotonic() < deadline, "the idle trial process outlived its worker"
        time.sleep(0.1)


def test_a_trial_process_stopped_by_someone_else_is_given_up_after_the_grace_period(
    tmp_path: Path, stub_config: Config
) -> None:
    """`kill -STOP` of the trial process (not its worker): the worker beats for the trial, so
    no other worker would take it over; it stayed RUNNING for ever."""
    from types import SimpleNamespace

    from hpo.stopping import HandBack

    study = _study(tmp_path)
    pid_file = Path(stub_config.source).with_name("child.pid")

    def stop_the_child() -> None:
        while not pid_file.exists() or not pid_file.read_text().strip():  # written, not begun
            time.sleep(0.05)
        os.kill(int(pid_file.read_text()), signal.SIGSTOP)

    threading.Thread(target=stop_the_child, daemon=True).start()
    limits = TrialLimits(5, stopped_limit_s=1)
    started = time.monotonic()
    with pytest.raises(HandBack, match=r"stopped \(SIGSTOP, a debugger\) for \d+ s"):
        run_in_child(
            study.ask(),
            trial_targets.sleep_forever,
            SimpleNamespace(config=stub_config),
            StopRequest(),
            limits,
        )
    assert time.monotonic() - started < 30
    assert _gone(int(pid_file.read_text()))  # killed: a stopped process cannot checkpoint


def test_the_trial_timeout_counts_training_yet_bounds_a_stuck_startup() -> None:
    from hpo.stopping import TrialTimedOut
    from hpo.trial.process import _Watchers

    now = time.monotonic()
    # A slow startup is not counted against the limit (trial_timeout + stop_timeout: 10 s)...
    slow = _Watchers(10.0, None, created=now - 15)
    slow.check()
    slow.training()  # ...and once training starts, the limit counts from there.
    slow.check()
    assert slow.deadline[0] >= now + 10
    # A process that never starts training is ended after twice the limit.
    stuck = _Watchers(10.0, None, created=now - 21)
    with pytest.raises(TrialTimedOut, match="did not start training"):
        stuck.check()
    # Past the deadline of its training: ended as before.
    late = _Watchers(10.0, None, created=now - 30, deadline=[now - 1])
    with pytest.raises(TrialTimedOut, match="did not stop at study.trial_timeout"):
        late.check()
    # No trial timeout: no limit at all.
    _Watchers(None, None, created=now - 10**6).check()


def test_what_a_stopping_trial_sent_before_it_exited_is_recorded() -> None:
    # Issue 42: the worker saw the trial process's exit before reading its last message, and
    # the stopped trial lost checkpoint_s (test_faults, one run in four).
    from multiprocessing import Pipe

    from hpo.trial.process import read_last_words

    class Exited:
        def wait(self, timeout_s: float) -> bool:
            return True

    class Trial:
        attrs: dict = {}

        def set_user_attr(self, key: str, value: object) -> None:
            self.attrs[key] = value

    worker_end, child_end = Pipe()
    child_end.send(("attr", "checkpoint_s", 0.25))
    child_end.send(("attr", "checkpoint_error", None))
    child_end.send(("outcome", ("interrupted", "SIGTERM"), False))
    child_end.send(("attr", "after_outcome", 1))
    child_end.close()  # the process is gone
    trial = Trial()
    started = time.monotonic()
    read_last_words(worker_end, Exited(), trial, limit_s=30)  # type: ignore[arg-type]
    assert trial.attrs == {"checkpoint_s": 0.25, "checkpoint_error": None}
    assert time.monotonic() - started < 5  # an exited process is not waited for


def test_a_trial_trained_in_the_worker_sends_its_evaluations_to_the_workers_observer() -> None:
    """study.trial_isolation: none: the evaluations the training loop sends reach the worker's
    trackers as a trial process's do over its pipe; the rest is the Optuna trial's own."""
    from hpo.trial.objective import InWorkerTrial
    from hpo.trial.training import EvaluationSender

    heard: list[tuple[int, dict[str, object]]] = []

    class Observer:
        def evaluation(self, number: int, report: dict[str, object]) -> None:
            heard.append((number, report))

    study = optuna.create_study()
    trial = study.ask()
    in_worker = InWorkerTrial(trial, Observer())  # type: ignore[arg-type]
    sender = EvaluationSender(in_worker, effective_batch_size=8, device="cpu")
    assert sender.send is not None  # what a trial process's ChildTrial offers too
    in_worker.send_evaluation({"index": 1, "samples": 8, "metrics": {"val_loss": 0.5}})
    assert heard == [(trial.number, {"index": 1, "samples": 8, "metrics": {"val_loss": 0.5}})]
    in_worker.set_user_attr("wall_s", 1.5)
    in_worker.report(0.5, 1)
    assert in_worker.study is study and trial.user_attrs == {"wall_s": 1.5}
    assert study.trials[0].intermediate_values == {1: 0.5}
