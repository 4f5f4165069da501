"""bench/search_anchors.py drives Syne Tune's schedulers on a stored grid as search_efficiency
replays Optuna's: the replay's accounting with a scripted scheduler (no Syne Tune needed), and
Syne Tune's ASHA on a tiny grid where that is installed (the bench extra)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest

from hpo.config.space import ParamSpec
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import search_anchors as anchors  # noqa: E402
from search_efficiency import Run, Table  # noqa: E402

RATES = [1e-4, 1e-3, 1e-2]
SPACE = {"learning_rate": ParamSpec(type="float", low=1e-4, high=1e-2, log=True)}


def _run(rate: float, seed: int) -> Run:
    """Four evaluations of 80 samples each; good only at the middle learning rate."""
    final = 0.9 if rate == 1e-3 else 0.4
    curve = [0.33, 0.5, final - 0.1, final]
    evaluations = [
        {"index": i, "step": 10 * i, "samples": 80 * i, "seconds": 1.0 * i, "metrics": {"acc": v}}
        for i, v in enumerate(curve, 1)
    ]
    return Run({"learning_rate": rate}, seed, "completed", evaluations)


TABLE = Table([_run(rate, seed) for rate in RATES for seed in (1, 2)], SPACE)


@dataclass
class Suggestion:
    """syne_tune.optimizer.scheduler.TrialSuggestion's fields that the replay reads."""

    config: dict[str, Any] = field(default_factory=dict)
    spawn_new_trial_id: bool = True
    checkpoint_trial_id: int | None = None


@dataclass
class Scripted:
    """A scheduler that follows a script: each suggestion in turn, and per trial the answer at
    each evaluation (CONTINUE where the script says nothing)."""

    suggestions: list[Suggestion]
    answers: dict[tuple[int, int], str]  # (trial id, evaluation): decision
    seen: list[tuple[int, int, float]] = field(default_factory=list)
    completed: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    added: list[int] = field(default_factory=list)

    def suggest(self) -> Suggestion:
        return self.suggestions.pop(0)

    def on_trial_add(self, trial: anchors.Trial) -> None:
        self.added.append(trial.trial_id)

    def on_trial_error(self, trial: anchors.Trial) -> None:
        raise AssertionError("no run of the grid diverged")

    def on_trial_result(self, trial: anchors.Trial, result: dict[str, Any]) -> str:
        at = result[anchors.RESOURCE]
        self.seen.append((trial.trial_id, at, result["acc"]))
        return self.answers.get((trial.trial_id, at), "CONTINUE")

    def on_trial_complete(self, trial: anchors.Trial, result: dict[str, Any]) -> None:
        self.completed.append((trial.trial_id, result))


def test_a_paused_trial_resumes_its_stored_curve_and_its_compute_counts_once() -> None:
    scheduler = Scripted(
        [
            Suggestion({"learning_rate": 2e-3}),  # snapped to 1e-3 (log scale): the good run
            Suggestion({"learning_rate": 5e-3}),  # nearer 1e-2 than 1e-3 in log space
            Suggestion({"learning_rate": 1e-4}),
            Suggestion(spawn_new_trial_id=False, checkpoint_trial_id=2),
        ],
        {(1, 2): "STOP", (2, 1): "PAUSE", (0, 4): "STOP"},  # ASHA's STOP at its maximum
    )
    search = anchors.replay_scheduler(scheduler, SPACE, TABLE, "acc", "scripted", 0, 4)
    assert [p["learning_rate"] for p in search.points] == [1e-3, 1e-2, 1e-4]
    # Trial 0 runs all 4 evaluations (the STOP on its last is its completion), trial 1 stops
    # after 2, trial 2 pauses after 1 and its resumption trains the other 3, not 4 again.
    assert search.samples == [320.0, 480.0, 560.0, 800.0]
    assert search.seconds == [4.0, 6.0, 7.0, 10.0]
    assert search.best == [0.9, 0.9, 0.9, 0.9] and search.pruned == 1  # the resumed one completed
    assert [(t, at) for t, at, _ in scheduler.seen if t == 2] == [(2, 1), (2, 2), (2, 3), (2, 4)]
    assert scheduler.added == [0, 1, 2]  # a resumption is not a new trial
    assert [t for t, _ in scheduler.completed] == [0, 2]
    assert scheduler.completed[1][1] == {"acc": 0.4, anchors.RESOURCE: 4}


def test_a_stopped_trial_adds_nothing_to_the_best_a_completed_one_adds_its_runs_best() -> None:
    scheduler = Scripted(
        [Suggestion({"learning_rate": 1e-3}), Suggestion({"learning_rate": 1e-2})],
        {(0, 3): "STOP"},
    )
    search = anchors.replay_scheduler(scheduler, SPACE, TABLE, "acc", "scripted", 0, 2)
    assert search.best == [-math.inf, 0.5] and search.samples == [240.0, 560.0]


def test_a_conditional_parameter_is_dropped_where_its_condition_does_not_hold() -> None:
    space = {
        "method": ParamSpec(type="categorical", choices=["none", "lora"]),
        "r": ParamSpec(type="categorical", choices=[4, 16], when={"method": ["lora"]}),
    }
    assert anchors.parameters_of({"method": "none", "r": 16}, space) == {"method": "none"}
    assert anchors.parameters_of({"r": 4, "method": "lora"}, space) == {"method": "lora", "r": 4}


def test_syne_tune_asha_replays_the_grid_stopping_only_at_its_rungs() -> None:
    pytest.importorskip("syne_tune", reason="Syne Tune is in the bench extra, not in dev")
    from syne_tune.optimizer.baselines import ASHA

    space = anchors.config_space(SPACE)
    scheduler = ASHA(
        space, metric="acc", time_attr=anchors.RESOURCE, max_t=4, do_minimize=False, random_seed=0
    )
    search = anchors.replay_scheduler(scheduler, SPACE, TABLE, "acc", "ASHA", 0, 30)
    steps = [b - a for a, b in zip([0.0, *search.samples], search.samples, strict=False)]
    # Rungs at evaluations 1 and 3 (reduction factor 3, maximum 4): a trial stops at one of
    # them or completes; the first trial at a rung always goes on.
    assert set(steps) <= {80.0, 240.0, 320.0} and steps[0] == 320.0
    assert search.pruned == len(steps) - steps.count(320.0) > 0
    assert search.best[-1] == 0.9 and len(search.points) == 30


def test_without_syne_tune_the_bench_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = anchors.importlib.util.find_spec
    monkeypatch.setattr(
        anchors.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "syne_tune" else real(name, *a),
    )
    monkeypatch.setattr(sys, "argv", ["search_anchors.py", "--seeds", "1"])
    with pytest.raises(SystemExit) as stopped:
        anchors.main()
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs Syne Tune, not installed; pip install" in err[0]
