"""study.warm_start: earlier studies' best configurations mapped onto this study's space (what
does not fit is said), queued once across workers, and ranges narrowed around them (issue 47)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from hpo.config.loader import load_config
from hpo.config.schema import Config, ParamSpec
from hpo.errors import ConfigError
from hpo.storage.engine import StudyStorage, open_storage
from hpo.storage.url import StorageURL
from hpo.study import warm_start
from hpo.study.join import open_study
from tests.conftest import exit_code, run_hpo, tiny_config, write_config

SPACE = {
    "effective_batch_size": ParamSpec(type="categorical", choices=[8, 16]),
    "learning_rate": ParamSpec(type="float", low=1e-4, high=1e-2, log=True),
    "warmup_ratio": ParamSpec(type="float", low=0.0, high=0.2, step=0.05),
    "epochs": ParamSpec(type="int", low=1, high=10),
}


def test_a_configuration_is_mapped_onto_this_space_and_what_does_not_fit_is_said() -> None:
    mapped = warm_start.Mapped("old")
    source = {
        "effective_batch_size": 32,  # not a choice here: dropped, sampled
        "learning_rate": 0.5,  # above the range: clipped to 1e-2
        "warmup_ratio": 0.07,  # inside, onto the step: 0.05
        "dropout": 0.1,  # not in this space: dropped
        "epochs": 3.6,  # an int: rounded
    }
    assert warm_start.map_onto(source, SPACE, mapped) == {
        "learning_rate": 1e-2,
        "warmup_ratio": pytest.approx(0.05),
        "epochs": 4,
    }
    line = mapped.line(1)
    assert line.startswith("warm start from study 'old': 1 of its best 0 configurations queued")
    assert "dropout: dropped (not in this search space)" in line
    assert "effective_batch_size: 32 dropped (not among this space's choices)" in line
    assert "learning_rate: clipped into [0.0001, 0.01]" in line
    a_fit = warm_start.Mapped("same")
    assert warm_start.map_onto({"learning_rate": 1e-3}, SPACE, a_fit) == {"learning_rate": 1e-3}
    assert "warmup_ratio: sampled (not in the earlier study)" in a_fit.line(1)


def test_the_best_k_come_best_first_each_once() -> None:
    def trial(value: float, lr: float) -> optuna.trial.FrozenTrial:
        return create_trial(
            value=value, params={"learning_rate": lr}, distributions={"learning_rate": LR}
        )

    trials = [trial(0.5, 1e-3), trial(0.9, 2e-3), trial(0.9, 2e-3), trial(0.7, 3e-3)]
    best = warm_start.best_params(trials, optuna.study.StudyDirection.MAXIMIZE, top=2)
    assert best == [{"learning_rate": 2e-3}, {"learning_rate": 3e-3}]
    least = warm_start.best_params(trials, optuna.study.StudyDirection.MINIMIZE, top=1)
    assert least == [{"learning_rate": 1e-3}]


LR = FloatDistribution(1e-4, 1e-2, log=True)


def test_narrowing_widens_the_top_ks_span_inside_the_original_bounds() -> None:
    configurations = [
        {"learning_rate": 1e-3, "warmup_ratio": 0.05, "epochs": 3},
        {"learning_rate": 4e-3, "warmup_ratio": 0.1, "epochs": 5},
    ]
    ranges = warm_start.narrowed(SPACE, configurations, widen=1.5)
    low, high = ranges["learning_rate"]  # log space: 1e-3..4e-3 widened 1.5x about 2e-3
    assert low == pytest.approx(2e-3 / 4**0.75) and high == pytest.approx(2e-3 * 4**0.75)
    assert ranges["warmup_ratio"] == pytest.approx([0.0, 0.15])  # 0.0375..0.1125 onto the step
    assert ranges["epochs"] == [2, 6]  # 2.5..5.5 outwards to whole numbers
    assert "effective_batch_size" not in ranges  # categorical: never narrowed
    # All agree: at least a tenth of the range, and never past the original bounds.
    edge = warm_start.narrowed(SPACE, [{"epochs": 10}, {"epochs": 10}])
    assert edge["epochs"] == [10, 10] or edge["epochs"][1] == 10
    assert edge["epochs"][0] >= 9


def _source(storage: StudyStorage, name: str = "old") -> None:
    """An earlier study with four completed trials (the best: 2e-3, then 3e-3)."""
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    distributions = {"learning_rate": LR, "dropout": FloatDistribution(0, 0.5)}
    for value, lr in [(0.6, 1e-3), (0.9, 2e-3), (0.8, 3e-3), (0.5, 5e-3)]:
        study.add_trial(
            create_trial(
                value=value,
                params={"learning_rate": lr, "dropout": 0.1},
                distributions=distributions,
            )
        )
    failed = create_trial(state=TrialState.FAIL, params={}, distributions={})
    study.add_trial(failed)


def _config(tmp_path: Path, easy_data: tuple[Path, Path], **warm: Any) -> Config:
    raw = tiny_config(*easy_data, study={"warm_start": {"from": ["old"], "top": 2, **warm}})
    return load_config(write_config(tmp_path / "c.yaml", raw))


def _storage(tmp_path: Path) -> StudyStorage:
    return open_storage(StorageURL(f"sqlite:///{tmp_path / 'h.db'}", "test"))


def test_two_workers_queue_the_warm_start_once_and_narrow_alike(
    tmp_path: Path, easy_data: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    storage = _storage(tmp_path)
    _source(storage)
    caplog.set_level(logging.INFO, logger="hpo.study.warm_start")
    first, second = (_config(tmp_path, easy_data, narrow=True) for _ in range(2))
    study = open_study(storage, "new", first)
    open_study(storage, "new", second)  # a second worker joins
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert [t.system_attrs["fixed_params"] for t in waiting] == [
        {"learning_rate": 2e-3},
        {"learning_rate": 3e-3},
    ]
    assert all(t.user_attrs["queued_by"] == "warm start from 'old'" for t in waiting)
    said = [r.getMessage() for r in caplog.records if "warm start from study" in r.getMessage()]
    assert len(said) == 1, said  # one line per source, from the worker that queued
    assert "dropout: dropped (not in this search space)" in said[0]
    assert any("queued by the study's first worker" in r.getMessage() for r in caplog.records)
    lr1, lr2 = first.search_space["learning_rate"], second.search_space["learning_rate"]
    assert (lr1.low, lr1.high) == (lr2.low, lr2.high)
    assert 1e-4 < lr1.low < 2e-3 and 3e-3 < lr1.high < 1e-2
    storage.engine.dispose()


def test_a_source_study_that_does_not_exist_is_refused_naming_the_studies(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    storage = _storage(tmp_path)
    _source(storage, "older")
    with pytest.raises(ConfigError) as refused:
        open_study(storage, "new", _config(tmp_path, easy_data))
    assert "no study 'old' in that storage; its studies: older" in str(refused.value)
    assert [s.study_name for s in storage.get_all_studies()] == ["older"]  # nothing created
    storage.engine.dispose()


def test_the_cli_refuses_a_missing_source_in_one_line(
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    easy_data: tuple[Path, Path],
) -> None:
    raw = tiny_config(*easy_data, study={"warm_start": {"from": ["nope"]}})
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'h.db'}"
    args = ["run", "--study", "s", "--config", str(config), "--storage", url, "--quiet"]
    assert exit_code(hpo_main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("no study 'nope' in that storage; its studies: none"), err
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize(
    ("warm", "expected"),
    [
        ({"from": [], "top": 3}, "study.warm_start.from: got []; name at least one earlier study"),
        ({"from": ["a"], "top": 0}, "study.warm_start.top: got 0; must be an integer from 1"),
        ({"form": ["a"]}, "study.warm_start.form: unknown key (did you mean 'from'?)"),
        ({"from": [{"storage": "sqlite:///x.db"}]}, "give the study's name"),
    ],
)
def test_a_bad_warm_start_is_named(
    tmp_path: Path, easy_data: tuple[Path, Path], warm: dict[str, Any], expected: str
) -> None:
    raw = tiny_config(*easy_data, study={"warm_start": warm})
    with pytest.raises(ConfigError) as refused:
        load_config(write_config(tmp_path / "c.yaml", raw))
    assert expected in str(refused.value)


def test_a_warm_started_study_trains_the_earlier_best_first(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    fast = {"pruner": {"type": "none"}, "trial_isolation": "none"}
    training = {"max_steps": 1, "evals_per_epoch": 1}
    url = f"sqlite:///{tmp_path / 'h.db'}"
    # The earlier study as a search of this config's space leaves it (the search itself is
    # tested everywhere else): its best is the second trial.
    old = optuna.create_study(study_name="old", storage=url, direction="maximize")
    lr_range = FloatDistribution(1e-3, 5e-3, log=True)  # the config's
    space = {"effective_batch_size": CategoricalDistribution([8]), "learning_rate": lr_range}
    for value, lr in [(0.5, 1.5e-3), (0.75, 4e-3)]:
        params = {"effective_batch_size": 8, "learning_rate": lr}
        old.add_trial(create_trial(value=value, params=params, distributions=space))
    best = old.best_trial.params
    warm = {"from": ["old"], "top": 1, "narrow": True}
    new = write_config(
        tmp_path / "new.yaml",
        tiny_config(
            *easy_data, study={"n_trials": 1, "warm_start": warm, **fast}, training=training
        ),
    )
    ran = run_hpo("run", "--study", "new", "--config", str(new), "--storage", url, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "warm start from study 'old': 1 of its best 1 configurations queued" in ran.stderr
    assert "warm start narrows learning_rate" in ran.stderr
    (trial,) = optuna.load_study(study_name="new", storage=url).trials
    assert trial.state == TrialState.COMPLETE and trial.params == best


def test_a_warm_start_with_the_grid_sampler_is_refused(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    raw = tiny_config(
        *easy_data, study={"warm_start": {"from": ["old"]}, "sampler": {"type": "grid"}}
    )
    with pytest.raises(ConfigError) as refused:
        load_config(write_config(tmp_path / "c.yaml", raw))
    assert "study.warm_start: got '{...}'; the grid sampler tries every grid point" in str(
        refused.value
    )


def test_a_source_in_another_database_is_read_relative_to_the_config(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    other = open_storage(StorageURL(f"sqlite:///{tmp_path / 'other.db'}", "test"))
    _source(other)
    other.engine.dispose()
    (tmp_path / "run").mkdir()
    source = {"study": "old", "storage": "sqlite:///../other.db"}  # beside the config's folder
    raw = tiny_config(*easy_data, study={"warm_start": {"from": [source], "top": 1}})
    config = load_config(write_config(tmp_path / "run" / "c.yaml", raw))
    storage = _storage(tmp_path)
    study = open_study(storage, "new", config)
    (waiting,) = study.get_trials(states=(TrialState.WAITING,))
    assert waiting.system_attrs["fixed_params"] == {"learning_rate": 2e-3}
    storage.engine.dispose()


def test_a_retrain_study_takes_neither_the_warm_start_nor_the_budget(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    from hpo.study.retrain import RetrainPlan, study_config

    raw = tiny_config(
        *easy_data, study={"warm_start": {"from": ["old"]}, "budget_device_hours": 2.0}
    )
    config = load_config(write_config(tmp_path / "c.yaml", raw))
    retrain = study_config(config, RetrainPlan("old", [], [1, 2]))
    assert retrain.study.warm_start is None and retrain.study.budget_device_hours is None
    assert config.study.warm_start is not None  # the search's own config is left as it was
