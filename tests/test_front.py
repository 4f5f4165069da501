"""hpo's Pareto front: a trial no better than chance, or better only by throughput noise, is
not on it; a real trade-off is. Checked on the rule and on the models a study keeps."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.study import StudyDirection

from hpo.reports import status as report
from hpo.reports.summary import summary_lines
from hpo.study.front import FrontRule, best_of, rule_for
from hpo.study.kept_models import remove_stale_checkpoints
from hpo.trainer.config import DataConfig, TrainingConfig
from hpo.trainer.data import TokenizedSplit
from hpo.trainer.tasks import make_task
from hpo.trial.folders import prepare_trial_folder

MAX = StudyDirection.MAXIMIZE
# [accuracy, samples_per_s] on an evaluation split where the most common label is half of it.
RULE = FrontRule((MAX, MAX), throughput=frozenset({1}), tolerance=0.05, chance=(0.5, None))


def front(rule: FrontRule | None = None, **trials: list[float]) -> list[str]:
    return best_of(list(trials.items()), rule or RULE)


def test_a_chance_level_trial_a_little_faster_is_off_the_front() -> None:
    # Plain dominance keeps the trial stuck at chance: its throughput is 3% higher, by noise.
    plain = FrontRule((MAX, MAX))
    assert front(plain, good=[0.90, 1000.0], chance=[0.50, 1030.0]) == ["good", "chance"]
    assert front(good=[0.90, 1000.0], chance=[0.50, 1030.0]) == ["good"]
    # Above chance, but worse and only 3% faster: noise too, off the front.
    assert front(good=[0.90, 1000.0], worse=[0.70, 1030.0]) == ["good"]
    # At chance, however fast: a model that learned nothing is no trade-off.
    assert front(good=[0.90, 1000.0], chance=[0.50, 5000.0]) == ["good"]


def test_a_real_trade_off_stays_on_the_front() -> None:
    trials = {"accurate": [0.90, 1000.0], "fast": [0.85, 1500.0], "noise": [0.84, 1520.0]}
    assert front(**trials) == ["accurate", "fast"]
    # Equal accuracy: the faster one dominates, as in plain dominance, whatever the tolerance.
    assert front(a=[0.90, 1000.0], b=[0.90, 1020.0]) == ["b"]
    # No throughput objective: the tolerance changes nothing.
    two = FrontRule((MAX, StudyDirection.MINIMIZE), chance=(0.5, None), tolerance=0.05)
    assert front(two, a=[0.9, 0.40], b=[0.8, 0.39]) == ["a", "b"]


def test_when_no_trial_beats_chance_the_front_is_of_all() -> None:
    assert front(a=[0.50, 1000.0], b=[0.40, 2000.0]) == ["a", "b"]


def test_chance_levels_are_what_answering_the_common_label_scores() -> None:
    task = make_task("sequence_classification", DataConfig(), TrainingConfig())
    split = TokenizedSplit(np.arange(4, dtype=np.int32), np.arange(5), None, np.array([0, 0, 0, 1]))
    levels = task.chance_levels(split, ["a", "b", "c"])
    assert levels["accuracy"] == 0.75
    assert levels["macro_f1"] == pytest.approx((2 * 0.75 / 1.75) / 2)  # class 1 scores 0
    assert levels["eval_loss"] == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


def test_the_kept_models_and_every_view_of_the_front_follow_the_rule(tmp_path: Path) -> None:
    study = optuna.create_study(study_name="s", directions=["maximize", "maximize"])
    study.set_metric_names(["accuracy", "samples_per_s"])
    study.set_user_attr("chance_level", {"accuracy": 0.5, "macro_f1": 0.33, "eval_loss": 0.69})
    study.set_user_attr("throughput_tolerance", 0.05)
    root = tmp_path / "checkpoints"
    # #0 accurate, #1 a real trade-off, #2 at chance and 3% faster than #1: plain dominance
    # keeps all three (Optuna's study.best_trials does).
    for number, values in enumerate(([0.90, 1000.0], [0.80, 1500.0], [0.50, 1545.0])):
        folder = prepare_trial_folder(root, "s", f"trial-{number}")
        attrs = {"best_model": str(folder / "best-model")}
        study.add_trial(optuna.trial.create_trial(values=values, user_attrs=attrs))
    assert len(study.best_trials) == 3
    removed = remove_stale_checkpoints(study, root)
    assert [p.name for p in removed] == ["trial-2"]
    assert sorted(p.name for p in root.glob("trial-*")) == ["trial-0", "trial-1"]
    assert [t["number"] for t in report.best_trials(study)] == [0, 1]
    lines = summary_lines(study, ["accuracy", "samples_per_s"])
    assert "Pareto front: 2 trials" in lines
    assert not any("trial #2" in line for line in lines)
    assert rule_for(study) == RULE
