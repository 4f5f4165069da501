"""Warm start: configurations tried first, from the config (`study.enqueue`) or the command
line (`hpo enqueue`), checked against the search space, queued once per study."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from hpo.config.loader import load_config
from hpo.errors import ConfigError
from tests.conftest import tiny_config, write_config

SPACE = {
    "effective_batch_size": {"type": "categorical", "choices": [8, 16]},
    "learning_rate": {"type": "float", "low": 1.0e-3, "high": 5.0e-3, "log": True},
    "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.2, "step": 0.05},
}


def _config(
    tmp_path: Path, easy_data: tuple[Path, Path], enqueue: Any, n_trials: int = 3, **study: Any
) -> Path:
    # One epoch: these tests check what is tried, not what it learns.
    raw = tiny_config(
        *easy_data,
        study={"n_trials": n_trials, "enqueue": enqueue, "pruner": {"type": "none"}, **study},
        training={"epochs": 1},
    )
    raw["search_space"] = SPACE
    return write_config(tmp_path / "c.yaml", raw)


def test_enqueued_values_are_converted_to_the_settings_types(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    # YAML 1.1 reads 3e-3 as a string and 8.0 as a float: what trains is a float and an int.
    config = load_config(
        _config(
            tmp_path,
            easy_data,
            [
                {"learning_rate": "3e-3", "effective_batch_size": 8.0},
                {"warmup_ratio": 0.1},
            ],
        )
    )
    assert config.study.enqueue == [
        {"learning_rate": 0.003, "effective_batch_size": 8},
        {"warmup_ratio": 0.1},
    ]
    assert type(config.study.enqueue[0]["effective_batch_size"]) is int


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            {"learning_rat": 3e-3},
            "study.enqueue[0].learning_rat: not in the search space "
            "(did you mean 'learning_rate'?)",
        ),
        (
            {"learning_rate": 0.5},
            "study.enqueue[0].learning_rate: got 0.5; must be within [0.001, 0.005]",
        ),
        ({"effective_batch_size": 32}, "must be one of the choices [8, 16]"),
        ({"warmup_ratio": 0.07}, "must be 0 plus a whole number of steps of 0.05"),
        ({"learning_rate": "fast"}, "study.enqueue[0].learning_rate: got 'fast'; must be a number"),
        ({"learning_rate": float("nan")}, "must be a finite number"),
        ("lr=3e-3", "study.enqueue: got ['lr=3e-3']; must be a list, each item a mapping"),
    ],
    ids=["unknown", "out of range", "not a choice", "off the step", "text", "nan", "not a map"],
)
def test_a_bad_enqueued_configuration_is_named_with_its_fix(
    tmp_path: Path, easy_data: tuple[Path, Path], entry: Any, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(_config(tmp_path, easy_data, [entry]))
    assert expected in str(caught.value)


def test_an_empty_or_partial_grid_configuration_is_refused(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    with pytest.raises(ConfigError, match=r"study.enqueue\[0\]: names no parameter"):
        load_config(_config(tmp_path, easy_data, [{}]))
    raw = tiny_config(
        *easy_data,
        study={"sampler": {"type": "grid"}, "n_trials": 2, "enqueue": [{"learning_rate": 0.002}]},
    )
    raw["search_space"] = {
        **SPACE,
        "learning_rate": {"type": "float", "low": 0.001, "high": 0.004, "step": 0.001},
    }
    with pytest.raises(
        ConfigError,
        match="the grid sampler tries whole configurations: add effective_batch_size, warmup_ratio",
    ):
        load_config(write_config(tmp_path / "grid.yaml", raw))


def _params(study: optuna.Study) -> list[dict[str, Any]]:
    return [t.params for t in study.get_trials()]


def test_warm_start_from_the_config_and_the_command_line(
    tmp_path: Path, easy_data: tuple[Path, Path], capsys: pytest.CaptureFixture[str], hpo_main: Any
) -> None:
    url = f"sqlite:///{tmp_path / 'warm.db'}"
    recipe = {"effective_batch_size": 16, "learning_rate": 0.002, "warmup_ratio": 0.05}
    # Every command runs hpo's main in this process, and trials train in the worker: what is
    # queued and tried is decided the same way, without seconds of imports per subprocess.
    config = _config(tmp_path, easy_data, [recipe], n_trials=1, trial_isolation="none")
    run = ["run", "--study", "warm", "--config", str(config), "--storage", url]
    assert hpo_main(run) == 0
    first = capsys.readouterr()
    assert "Traceback" not in first.err, first.err[-3000:]
    study = optuna.load_study(study_name="warm", storage=url)
    assert _params(study) == [recipe]  # tried first
    assert "trial 0 (queued by study.enqueue) starts" in first.err  # said, not only done
    assert study.get_trials()[0].user_attrs["queued_by"] == "study.enqueue"

    mine = {"effective_batch_size": 8, "learning_rate": 0.004}
    args = ["enqueue", "--study", "warm", "--storage", url, "--params"]
    capsys.readouterr()
    assert hpo_main([*args, json.dumps(mine)]) == 0
    queued = capsys.readouterr()
    assert "queued" in queued.out, queued.err[-3000:]
    [waiting] = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert waiting.user_attrs["queued_by"] == "hpo enqueue"
    assert hpo_main([*args, json.dumps(mine)]) == 0
    assert "already holds a trial" in capsys.readouterr().out
    for bad, expected in [
        ('{"learning_rate": 0.5}', "--params.learning_rate: got 0.5; must be within"),
        ('{"learning_rate": 3e-3', "--params is not JSON"),
        ("[0.003]", "--params must be a JSON object"),
        ('{"learning_rate": 0.002, "learning_rate": 0.003}', "gives 'learning_rate' twice"),
        ('{"a": ' * 15_000 + "1" + "}" * 15_000, "--params is not JSON (nested too deeply)"),
    ]:
        assert hpo_main([*args, bad]) == 2
        refused = capsys.readouterr().err
        assert expected in refused and "Traceback" not in refused, refused[-3000:]
    assert (
        hpo_main(["enqueue", "--study", "nope", "--storage", url, "--params", json.dumps(mine)])
        == 2
    )
    assert "no study 'nope'" in capsys.readouterr().err
    assert len(study.get_trials()) == 2  # the one run, and one queued: nothing else written

    # A worker with another metric cannot join: the study would compare unlike values.
    raw = tiny_config(*easy_data, study={"metric": "macro_f1"})
    raw["search_space"] = SPACE
    other = write_config(tmp_path / "f1.yaml", raw)
    assert hpo_main(["run", "--study", "warm", "--config", str(other), "--storage", url]) == 2
    assert "study 'warm' optimises accuracy" in capsys.readouterr().err
    # A second worker with the same config queues its recipe no second time.
    more = _config(tmp_path, easy_data, [recipe], n_trials=2, trial_isolation="none")
    assert hpo_main(["run", "--study", "warm", "--config", str(more), "--storage", url]) == 0
    second = capsys.readouterr()
    assert "Traceback" not in second.err, second.err[-3000:]
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert trials[1].params["learning_rate"] == 0.004
    assert trials[1].params["effective_batch_size"] == 8


def test_thousands_of_bad_keys_give_twenty_lines_and_a_count(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(_config(tmp_path, easy_data, [{f"key_{i}": 1 for i in range(5000)}]))
    message = str(caught.value)
    assert len(caught.value.problems) == 5000
    assert message.count("\n  - ") == 21 and message.endswith("... and 4980 more")


def _spent_study(url: str) -> optuna.Study:
    """A finished study of 2 trials whose budget (n_trials 2) is spent, as hpo run leaves it."""
    from hpo.config.schema import ParamSpec, space_record

    study = optuna.create_study(study_name="pw", storage=url, direction="maximize")
    space = {name: ParamSpec(**spec) for name, spec in SPACE.items()}
    study.set_user_attr("search_space", space_record(space))
    study.set_user_attr("n_trials", 2)
    distribution = optuna.distributions.FloatDistribution(1e-3, 5e-3, log=True)
    for value in (0.7, 0.8):
        study.add_trial(
            optuna.trial.create_trial(
                params={"learning_rate": 2e-3},
                distributions={"learning_rate": distribution},
                value=value,
            )
        )
    return study


def test_enqueue_into_a_spent_budget_says_what_runs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Any
) -> None:
    """Hostile try F2: enqueue said only 'if the study's n_trials leaves room', and status
    --watch then said 'start a worker (hpo run) to go on', which stops at once."""
    url = f"sqlite:///{tmp_path / 'pw.db'}"
    _spent_study(url)
    args = ["--study", "pw", "--storage", url]
    assert hpo_main(["enqueue", *args, "--params", '{"learning_rate": 0.004}']) == 0
    said = capsys.readouterr().out
    assert "but its budget is spent (2 of n_trials 2 started)" in said, said
    assert (
        "run only with a larger budget, e.g. hpo run --study pw --config ... --n-trials 3" in said
    )

    advice = "1 queued trial waits: the budget of 2 trials is spent; run them with a larger one"
    assert hpo_main(["status", *args]) == 0
    assert advice in capsys.readouterr().out
    # The watch ends at once (two refreshes), saying what runs the queued trial: no 'start a
    # worker', which would stop at once.
    assert hpo_main(["status", *args, "--watch", "--interval", "0.1"]) == 0
    err = capsys.readouterr().err
    assert f"hpo: study 'pw' has ended: {advice}" in err and "start a worker" not in err, err


def test_enqueue_with_room_in_the_budget_says_the_next_worker_trains_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Any
) -> None:
    from hpo.reports import status as report

    url = f"sqlite:///{tmp_path / 'pw.db'}"
    _spent_study(url).set_user_attr("n_trials", 3)
    assert (
        hpo_main(
            ["enqueue", "--study", "pw", "--storage", url, "--params", '{"learning_rate": 0.004}']
        )
        == 0
    )
    said = capsys.readouterr().out
    assert "the next worker to start a trial trains it" in said and "spent" not in said
    room = {
        "study": "pw",
        "trials": {"complete": 2, "waiting": 1},
        "running": [],
        "budget": 3,
        "counted": 2,
    }
    assert report.stalled(room) and not report.ended(room)  # a worker would run it
    assert not report.waiting_for_budget(room)
