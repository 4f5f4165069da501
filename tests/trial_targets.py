"""Trial bodies that the trial-process tests run in a child process (importable by name there)."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import optuna

from hpo.plugins.protocols import TrialLike
from hpo.stopping import Interrupted
from hpo.trial.child import stop_reason, stop_requested


def report_until_pruned(trial: TrialLike, payload: dict[str, Any]) -> float:
    """Report 0, 1, 2, ...; before each report, check that the previous one is already in the
    study's storage, as another process reads it."""
    study = optuna.load_study(study_name=payload["study"], storage=payload["storage"])
    for step in range(10):
        if step:
            stored = study.get_trials(deepcopy=False)[trial.number].intermediate_values
            if stored.get(step - 1) != float(step - 1):
                raise AssertionError(f"report {step - 1} not in storage: {stored}")
        trial.report(float(step), step)
        if trial.should_prune():
            trial.set_user_attr("pruned_at", step)
            raise optuna.TrialPruned(f"pruned at step {step}")
    return 99.0


def kill_itself(trial: TrialLike, payload: Any) -> float:
    trial.set_user_attr("child_pid", os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
    return 0.0


def raise_error(trial: TrialLike, payload: Any) -> float:
    raise ValueError("bad luck in the child")


def return_one(trial: TrialLike, payload: Any) -> float:
    return 1.0


def sleep_forever(trial: TrialLike, payload: Any) -> float:
    """Writes its pid where the test can see it, then trains forever."""
    Path(payload.config.source).with_name("child.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)


def ignore_sigterm(trial: TrialLike, payload: Any) -> float:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return sleep_forever(trial, payload)


def fork_then_ignore_sigterm(trial: TrialLike, payload: Any) -> float:
    """Leaves a sleeping child (its pid in forked.pid), then ignores the worker's SIGTERM: the
    worker has to kill this process, which can then end nothing itself."""
    forked = Path(payload.config.source).with_name("forked.pid")
    if os.fork() == 0:
        forked.write_text(str(os.getpid()))
        time.sleep(120)
        os._exit(0)
    while not forked.exists():
        time.sleep(0.01)
    return ignore_sigterm(trial, payload)


def train_until_stopped(trial: TrialLike, payload: Any) -> float:
    """Trains (asks whether to stop, as the training loop does) until asked to stop, then
    checkpoints, as the training loop does."""
    pid_file = Path(payload.config.source).with_name("child.pid")
    while not stop_requested():
        pid_file.write_text(str(os.getpid()))
        time.sleep(0.05)
    pid_file.with_name("checkpointed").write_text("step 1")
    raise Interrupted("SIGTERM")


def sigterm_itself_while_training(trial: TrialLike, payload: Any) -> float:
    """Another process (not the worker) sends the training trial process SIGTERM."""
    stop_requested()  # training has begun: a SIGTERM now checkpoints at the next step
    os.kill(os.getpid(), signal.SIGTERM)
    while not stop_requested():
        time.sleep(0.01)
    raise Interrupted(stop_reason())


def record_pid(trial: TrialLike, payload: Any) -> float:
    """Records which process ran the trial, and what the trial was given."""
    trial.set_user_attr("child_pid", os.getpid())
    if dataclasses.is_dataclass(payload):
        trial.set_user_attr("payload", dataclasses.asdict(payload))  # type: ignore[arg-type]
    return 1.0


def ask_to_be_replaced(trial: TrialLike, payload: Any) -> float:
    from hpo.trial.child import replace_after_this_trial

    trial.set_user_attr("child_pid", os.getpid())
    replace_after_this_trial("the test asks for it")
    return 1.0


_leaked: list[bytearray] = []


def leak_memory(trial: TrialLike, payload: Any) -> float:
    """Keeps 64 MiB alive after the trial, with the process's growth limit at 16 MiB."""
    from hpo.trial import child as trial_process

    trial_process.MEMORY_GROWTH_LIMIT = 16 * 1024**2
    _leaked.append(bytearray(64 * 1024**2))
    trial.set_user_attr("child_pid", os.getpid())
    return 1.0


def run_named(trial: TrialLike, payload: Any) -> float:
    """Runs the target named by the trial's `params`: one kept process, a body per trial."""
    body: Any = globals()[payload.params]
    return float(body(trial, payload))
