"""One task's whole life through `hpo run`, for its end-to-end test: a small study on tiny data
in which a trial stopped by SIGTERM is resumed by its retry, a hopeless trial is pruned, and the
best model is fetched with `hpo best --download`."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

from tests.conftest import tiny_config, write_config

GOOD_LR = 3e-3
HOPELESS_LR = 1e-6  # learns nothing: the pruner stops it once the good trial is ahead
JUDGED_AT = 3  # the first evaluation the pruner judges: by then a good trial leads clearly
# Six evaluations a trial: the SIGTERM comes after the first, with five still to train.
TRAINING = {"epochs": 3, "evals_per_epoch": 2, "physical_batch_size": 8}


@dataclass
class StudyRun:
    study: optuna.Study
    stopped: FrozenTrial  # SIGTERMed after its first evaluation
    resumed: FrozenTrial  # its retry, which went on from the SIGTERM's checkpoint
    pruned: FrozenTrial
    finished: str  # what the `hpo run` that resumed and pruned printed
    downloaded: str  # what `hpo best --download` printed
    model_dir: Path  # what `hpo best --download` wrote


def run_task_study(
    tmp_path: Path,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    task: str,
    files: tuple[Path, Path],
    metric: str,
    **sections: dict[str, Any],
) -> StudyRun:
    """Trial 0 (a good learning rate) is stopped by SIGTERM after its first evaluation and
    handed back; its retry (trial 1) resumes and completes; then a hopeless learning rate is
    queued and pruned at evaluation JUDGED_AT (trial 2). `sections` update tiny_config's.

    Every command runs hpo's main in this process, as one worker: a subprocess would spend
    seconds importing torch, and its fork server as many again."""
    training = {**TRAINING, **sections.pop("training", {})}
    raw = tiny_config(*files, training=training, **sections)
    raw["task"] = task
    raw["study"].update(
        {
            "metric": metric,
            "n_trials": 1,
            "enqueue": [{"learning_rate": GOOD_LR}],
            # Prunes a trial worse than the complete one was at the same evaluation.
            "pruner": {
                "type": "median",
                "n_startup_trials": 1,
                "n_warmup_steps": JUDGED_AT,
                "margin": 0.0,
            },
            "checkpoint_dir": str(tmp_path / "checkpoints"),  # not the tests' working folder
            "artifact_store": f"file://{tmp_path / 'store'}",
        }
    )
    raw["search_space"]["learning_rate"].update({"low": HOPELESS_LR, "high": 1e-2})
    config = write_config(tmp_path / "c.yaml", raw)
    database = tmp_path / "hpo.db"
    url = f"sqlite:///{database}"
    run = ["run", "--study", "t", "--config", str(config), "--storage", url, "--quiet"]

    with _sigterm_after_the_first_evaluation(database):
        assert hpo_main(run) == 0  # a SIGTERM is a clean stop: the trial is handed back
    params = json.dumps({"learning_rate": HOPELESS_LR})
    assert hpo_main(["enqueue", "--study", "t", "--storage", url, "--params", params]) == 0
    stopping = capsys.readouterr()
    assert hpo_main([*run, "--n-trials", "2"]) == 0  # the retry resumes, then the hopeless one
    finishing = capsys.readouterr()
    model_dir = tmp_path / "best-model"
    assert hpo_main(["best", "--study", "t", "--storage", url, "--download", str(model_dir)]) == 0
    downloaded = capsys.readouterr()
    for output in (stopping, finishing, downloaded):
        assert "Traceback" not in output.err, output.err[-3000:]
    study = optuna.load_study(study_name="t", storage=url)
    evaluations = training["epochs"] * training["evals_per_epoch"]
    stopped, resumed, pruned = study.get_trials()
    assert (stopped.state, resumed.state, pruned.state) == (
        TrialState.FAIL,
        TrialState.COMPLETE,
        TrialState.PRUNED,
    )
    assert stopped.user_attrs["interrupted"] == "SIGTERM"
    assert resumed.system_attrs["failed_trial"] == 0
    assert resumed.user_attrs["resumed_at_step"] > 0  # from the SIGTERM's checkpoint
    assert sorted(resumed.intermediate_values) == list(range(1, evaluations + 1))  # it goes on
    assert study.best_trial.number == 1
    assert pruned.params["learning_rate"] == HOPELESS_LR
    assert sorted(pruned.intermediate_values) == list(range(1, JUDGED_AT + 1))
    reason = pruned.user_attrs["prune_reason"]
    assert reason.startswith("median pruner: ") and f"evaluation {JUDGED_AT}'s {metric} " in reason
    assert "the median" in reason and "of 1 complete trial at that evaluation" in reason, reason
    return StudyRun(study, stopped, resumed, pruned, finishing.out, downloaded.out, model_dir)


@contextmanager
def _sigterm_after_the_first_evaluation(database: Path) -> Iterator[None]:
    """SIGTERM to this process, the worker, once its trial reported an evaluation. The worker
    holds its answer to the trial's first should_prune (asked after that report; the trial
    process waits for the answer) until the signal is sent: it lands in training however fast
    the trial trains (six tiny evaluations could all be over before a poll saw the first). Sent
    from a thread: Python runs the worker's handler in the main thread, where it works."""
    done = threading.Event()
    asked = threading.Event()
    sent = threading.Event()
    should_prune = optuna.trial.Trial.should_prune

    def held_should_prune(trial: optuna.trial.Trial) -> bool:
        if not asked.is_set():
            asked.set()
            deadline = time.monotonic() + 120
            while not sent.is_set() and time.monotonic() < deadline:
                time.sleep(0.02)
        return should_prune(trial)

    def watch() -> None:
        while not done.wait(0.05):
            if asked.is_set() and _evaluations_reported(database) > 0:
                os.kill(os.getpid(), signal.SIGTERM)
                sent.set()
                return

    optuna.trial.Trial.should_prune = held_should_prune  # type: ignore[method-assign]
    watcher = threading.Thread(target=watch, name="sigterm-after-evaluation", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        optuna.trial.Trial.should_prune = should_prune  # type: ignore[method-assign]
        done.set()
        watcher.join()
    assert sent.is_set(), "the trial ended before it reported an evaluation to stop after"


def _evaluations_reported(database: Path) -> int:
    """Read with sqlite3, not Optuna: Optuna's storage, opened while the worker creates the
    tables, creates them too, and one of the two fails (on alembic's version row)."""
    if not database.exists():
        return 0
    try:
        with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
            (count,) = db.execute("select count(*) from trial_intermediate_values").fetchone()
    except sqlite3.OperationalError:
        return 0  # no tables yet, or the worker holds the database this very moment
    return int(count)
