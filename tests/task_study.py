"""One task's whole life through `hpo run`, for its end-to-end test: a small study on tiny data
with a trial stopped by SIGTERM and resumed by its retry, a trial pruned, and the best model
fetched with `hpo best --download`."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tests.conftest import start_hpo, tiny_config, wait_until_training, write_config

GOOD_LR = 3e-3
HOPELESS_LR = 1e-6  # learns nothing: the median pruner stops it once the good trial is ahead
JUDGED_FROM = 7  # the first evaluation the pruner judges (earlier ones are noisy)


@dataclass
class StudyRun:
    study: optuna.Study
    stopped: FrozenTrial  # SIGTERMed after its first evaluation
    resumed: FrozenTrial  # its retry, which went on from the checkpoint
    pruned: FrozenTrial
    model_dir: Path  # what `hpo best --download` wrote


def run_task_study(
    tmp_path: Path,
    hpo_main: Callable[[list[str]], int],
    task: str,
    data: tuple[Path, Path],
    metric: str,
    **data_settings: Any,
) -> StudyRun:
    """Trial 0 (a good learning rate) is stopped after one evaluation and resumed by its retry
    (trial 1) in a second worker; then a hopeless learning rate is queued and pruned (trial 2)
    at evaluation JUDGED_FROM."""
    raw = tiny_config(
        *data,
        study={
            "metric": metric,
            "n_trials": 1,
            "enqueue": [{"learning_rate": GOOD_LR}],
            # Prunes a trial worse than the complete one was at the same evaluation.
            "pruner": {"type": "median", "n_startup_trials": 1, "n_warmup_steps": JUDGED_FROM},
            "checkpoint_interval": 0,  # a checkpoint at every evaluation, for the retry
            "checkpoint_dir": str(tmp_path / "checkpoints"),  # not the tests' working folder
            "artifact_store": f"file://{tmp_path / 'store'}",
        },
        # 12 evaluations over 3 epochs: the SIGTERM lands after the first, 11 still to train.
        training={"epochs": 3, "evals_per_epoch": 4},
        data=data_settings,
    )
    raw["task"] = task
    raw["search_space"]["learning_rate"]["low"] = HOPELESS_LR
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    run = ["run", "--study", "t", "--config", str(config), "--storage", url, "--quiet"]

    worker = start_hpo(*run, cwd=tmp_path)
    try:
        wait_until_training(url, "t", [worker], evaluations=1)
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=120)
    finally:
        worker.kill()
    assert worker.returncode == 0, stderr[-3000:]
    assert hpo_main(run) == 0  # the retry: resumes trial 0 and completes it
    params = json.dumps({"learning_rate": HOPELESS_LR})
    assert hpo_main(["enqueue", "--study", "t", "--storage", url, "--params", params]) == 0
    assert hpo_main([*run, "--n-trials", "2"]) == 0

    model_dir = tmp_path / "best-model"
    assert hpo_main(["best", "--study", "t", "--storage", url, "--download", str(model_dir)]) == 0
    study = optuna.load_study(study_name="t", storage=url)
    stopped, resumed, pruned = study.get_trials()
    assert (stopped.state, resumed.state, pruned.state) == (
        TrialState.FAIL, TrialState.COMPLETE, TrialState.PRUNED,
    )  # fmt: skip
    return StudyRun(study, stopped, resumed, pruned, model_dir)
