"""Several objectives: `study.metric` as a list, checked in the config, a Pareto front kept by
the study, its checkpoints and `hpo best`, and pruning off with a note."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.study import StudyDirection
from optuna.trial import TrialState

from hpo.config.loader import parse_config
from hpo.errors import ConfigError
from hpo.study.front import rule_for
from hpo.study.kept_models import best_trials
from tests.conftest import tiny_config, write_config


def test_a_metric_list_makes_objectives_with_their_natural_directions(
    easy_data: tuple[Path, Path],
) -> None:
    raw = tiny_config(*easy_data, study={"metric": ["macro_f1", "eval_loss", "samples_per_s"]})
    study = parse_config(raw, Path.cwd()).study
    assert study.objectives == ["macro_f1", "eval_loss", "samples_per_s"]
    assert study.primary_metric == "macro_f1"
    assert study.resolved_directions == ["maximize", "minimize", "maximize"]


@pytest.mark.parametrize(
    ("study", "expected"),
    [
        (
            {"metric": ["accuracy", "accuracy"]},
            "study.metric: got ['accuracy', 'accuracy']; lists a metric twice",
        ),
        ({"metric": ["samples_per_s", "accuracy"]}, "must begin with an evaluation metric"),
        ({"metric": []}, "give a metric, or a list of them"),
        ({"metric": ["accuracy", "eval_loss"], "direction": "maximize"}, "give one per metric"),
        (
            {"metric": ["accuracy", "eval_loss"], "direction": ["maximize", "maximize"]},
            "metric eval_loss must be minimized",
        ),
        ({"metric": ["accuracy", "eval_loss"], "sampler": {"type": "cmaes"}}, "not cmaes"),
        ({"metric": ["accuracy", "speed"]}, "study.metric: got ['accuracy', 'speed']; must be"),
    ],
    ids=[
        "twice",
        "throughput first",
        "empty",
        "one direction",
        "wrong direction",
        "cmaes",
        "unknown",
    ],
)
def test_a_bad_objective_setting_is_named_with_its_fix(
    easy_data: tuple[Path, Path], study: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(tiny_config(*easy_data, study=study), Path.cwd())
    assert expected in str(caught.value)


def test_the_pareto_front_is_every_complete_trial_no_other_beats_everywhere() -> None:
    study = optuna.create_study(directions=["maximize", "minimize"])
    for values in ([0.9, 0.5], [0.8, 0.2], [0.7, 0.3], [0.9, 0.5], [0.95, 0.9], [0.5, 0.2]):
        study.add_trial(optuna.trial.create_trial(values=values, params={}, distributions={}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL))
    front = best_trials(study.get_trials(), study.directions)
    # [0.7, 0.3] loses to [0.8, 0.2]; [0.5, 0.2] too; the repeated [0.9, 0.5] counts once.
    assert sorted(t.number for t in front) == [0, 1, 4]
    single = optuna.create_study(direction="minimize")
    for value in (3.0, 1.0, 2.0):
        single.add_trial(optuna.trial.create_trial(value=value))
    assert [t.number for t in best_trials(single.get_trials(), [StudyDirection.MINIMIZE])] == [1]


def test_a_study_with_two_objectives_through_the_cli(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    url = f"sqlite:///{tmp_path / 'two.db'}"
    # One epoch a trial: a curve of its 2 evaluations, the best of them the trial's value.
    # Every command runs hpo's main in this process, and trials train in the worker: the same
    # code decides, without seconds of imports per subprocess.
    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": 3,
            "metric": ["accuracy", "samples_per_s"],
            "checkpoint_interval": 0,
            "trial_isolation": "none",
        },
        training={"epochs": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    assert hpo_main(["run", "--study", "two", "--config", str(config), "--storage", url]) == 0
    result = capsys.readouterr()
    assert "Traceback" not in result.err, result.err[-3000:]
    assert "2 objectives: pruning is off" in result.err
    assert "Pareto front:" in result.out
    study = optuna.load_study(study_name="two", storage=url)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    for trial in trials:
        assert trial.values[0] == trial.user_attrs["best_evaluation"]["metrics"]["accuracy"]
        assert trial.values[1] == pytest.approx(trial.user_attrs["samples_per_s"], rel=0.01)
        assert trial.intermediate_values == {} and len(trial.user_attrs["curve"]) == 2

    assert hpo_main(["best", "--study", "two", "--storage", url, "--json"]) == 0
    front = json.loads(capsys.readouterr().out)
    # hpo's front (hpo.study.front), not Optuna's: throughput within the tolerance is noise.
    assert {t["number"] for t in front} == {t.number for t in best_trials(trials, rule_for(study))}
    assert all(len(t["values"]) == 2 for t in front)
    # The front's best models stay; the folders of the trials off the front are gone.
    for trial in trials:
        on_front = trial.number in {t["number"] for t in front}
        assert Path(trial.user_attrs["best_model"]).is_dir() == on_front
    assert hpo_main(["status", "--study", "two", "--storage", url]) == 0
    status = capsys.readouterr()
    assert "Pareto front #" in status.out, status.err[-3000:]
    assert hpo_main(["studies", "--storage", url]) == 0
    assert "maximize and maximize" in capsys.readouterr().out
