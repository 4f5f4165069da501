"""A small real study run through the CLI, and what a user expects to find in storage after it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

from tests.conftest import run_study, tiny_config, write_config

RECORDED_ATTRS = {
    "physical_batch_size",
    "grad_accum_steps",
    "samples_per_s",
    "tokens_per_s",
    "peak_mem_bytes",
    "device_name",
    "precision",
    "wall_s",
}
# Two learning rates that learn the easy task and two that cannot, so the median pruner fires.
ENQUEUED_LEARNING_RATES = [2e-3, 3e-3, 1e-6, 1.1e-6]


def run_small_study(
    tmp_path: Path,
    data: tuple[Path, Path],
    storage_url: str,
    study: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> optuna.Study:
    raw = tiny_config(
        *data,
        study={
            "n_trials": 5,
            "pruner": {"type": "median", "n_startup_trials": 2, "n_warmup_steps": 0, "margin": 0.0},
        },
    )
    config = write_config(tmp_path / "study.yaml", raw)
    queued = optuna.create_study(storage=storage_url, study_name=study, direction="maximize")
    for lr in ENQUEUED_LEARNING_RATES:
        queued.enqueue_trial({"effective_batch_size": 8, "learning_rate": lr})
    result = run_study(config, storage_url, tmp_path, study=study)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "best trial #" in result.stdout
    # Optuna's own lines come in hpo's format, not in a second one ("[I 2026-...]").
    assert "[optuna." in result.stderr and "\n[I 20" not in result.stderr, result.stderr[-3000:]
    # Not a terminal: plain log lines, no progress line drawn in place.
    assert "\r" not in result.stderr and "\x1b[" not in result.stderr
    # A second worker finds the study's budget spent and starts nothing. It and the next one
    # run hpo's main in this process: as subprocesses, each took seconds to start nothing.
    args = ["run", "--study", study, "--config", str(config), "--storage", storage_url]
    capsys.readouterr()
    assert hpo_main(args) == 0
    again = capsys.readouterr().err
    assert "holds 5 started trials, this worker's budget being 5; stopping" in again, again
    assert "had a budget of" not in again
    # One with a smaller budget says so, and what it found (it once said "holds 3", its own).
    assert hpo_main([*args, "--n-trials", "3"]) == 0
    smaller = capsys.readouterr().err
    assert "had a budget of 5 trials; this worker's is 3 trials" in smaller, smaller
    assert "holds 5 started trials, this worker's budget being 3; stopping" in smaller
    return optuna.load_study(study_name=study, storage=storage_url)


def check_small_study(study: optuna.Study) -> None:
    trials = study.get_trials()
    states = [t.state for t in trials]
    assert len(trials) == 5 and optuna.trial.TrialState.RUNNING not in states
    assert [t.params["learning_rate"] for t in trials[:4]] == ENQUEUED_LEARNING_RATES
    good, bad = trials[:2], trials[2:4]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in good)
    assert all(t.value is not None and t.value > 0.8 for t in good)
    assert all(t.state == optuna.trial.TrialState.PRUNED for t in bad)
    for trial in bad:  # which pruner, the trial's value and what it was compared with
        reason = trial.user_attrs["prune_reason"]
        assert reason.startswith("median pruner: ") and "accuracy" in reason, reason
        assert "below the median" in reason and "complete trials at that evaluation" in reason
    for trial in trials:
        assert RECORDED_ATTRS <= set(trial.user_attrs), trial.user_attrs
        assert trial.user_attrs["precision"] == "fp32"
        assert trial.user_attrs["batch_size_source"] == "config"
        assert (
            trial.user_attrs["grad_accum_steps"] == 2
            and trial.user_attrs["physical_batch_size"] == 4
        )
        assert trial.intermediate_values  # reported as the trial ran
    assert study.best_trial.number in (0, 1)
    assert study.user_attrs["metric"] == "accuracy"
    assert study.metric_names == ["accuracy"]  # named in the dashboard
