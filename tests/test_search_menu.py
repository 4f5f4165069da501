"""The search menu: every sampler and the patience wrapper, built from a config as `hpo run`
builds them, checked before a study starts, and run through the CLI."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from hpo.config.loader import parse_config
from hpo.config.schema import Config
from hpo.errors import ConfigError
from hpo.study.sampling import build_pruner, build_sampler
from hpo.trial.search_space import sample
from tests.conftest import tiny_config, write_config

FINITE_SPACE = {
    "effective_batch_size": {"type": "categorical", "choices": [8, 16]},
    "learning_rate": {"type": "float", "low": 1.0e-3, "high": 4.0e-3, "step": 1.0e-3},
    "warmup_ratio": {"type": "float", "low": 0.0, "high": 0.1, "step": 0.05},
}
SAMPLERS = [
    ({"type": "tpe"}, optuna.samplers.TPESampler),
    ({"type": "tpe", "multivariate": True, "group": True}, optuna.samplers.TPESampler),
    ({"type": "random"}, optuna.samplers.RandomSampler),
    ({"type": "gp", "n_startup_trials": 2}, optuna.samplers.GPSampler),
    ({"type": "cmaes", "n_startup_trials": 2}, optuna.samplers.CmaEsSampler),
    ({"type": "qmc"}, optuna.samplers.QMCSampler),
    ({"type": "grid"}, optuna.samplers.GridSampler),
]


def _config(easy_data: tuple[Path, Path], study: dict[str, Any]) -> Config:
    study = dict(study)
    space = study.pop("space", {})
    raw = tiny_config(*easy_data, study=study)
    raw["search_space"] = {**FINITE_SPACE, **space}
    return parse_config(raw, Path.cwd())


@pytest.mark.parametrize(("sampler", "kind"), SAMPLERS, ids=[str(s) for s, _ in SAMPLERS])
def test_every_sampler_proposes_configurations_of_the_search_space(
    easy_data: tuple[Path, Path], sampler: dict[str, Any], kind: type
) -> None:
    config = _config(easy_data, {"n_trials": 12, "sampler": {**sampler, "seed": 0}})
    built = build_sampler(config.study.sampler, 0, config.search_space)
    assert isinstance(built, kind)
    study = optuna.create_study(sampler=built, direction="maximize")
    seen = []
    for _ in range(12):
        trial = study.ask()
        params = sample(trial, config.search_space)
        assert params["effective_batch_size"] in (8, 16)
        assert 1e-3 <= params["learning_rate"] <= 4e-3 and 0 <= params["warmup_ratio"] <= 0.1
        seen.append(tuple(sorted(params.items())))
        study.tell(trial, -abs(math.log10(params["learning_rate"]) + 2.5))
    if kind is optuna.samplers.GridSampler:  # 2 x 4 x 3 points, each at most once
        assert len(set(seen)) == 12


@pytest.mark.parametrize(
    ("study", "expected"),
    [
        (
            {"sampler": {"type": "tpe", "multivariate": False, "group": True}},
            "study.sampler.group: got true; needs multivariate: true",
        ),
        ({"sampler": {"type": "gp", "multivariate": True}}, "only for type: tpe, not gp"),
        (
            {"sampler": {"type": "annealing"}},
            "must be one of tpe, random, gp, cmaes, qmc, grid, nsga2",
        ),
        ({"n_trials": 25, "sampler": {"type": "grid"}}, "the grid has 24 combinations"),
        ({"pruner": {"patience": -1}}, "study.pruner.patience: got -1; must be >= 0"),
        ({"pruner": {"margin": -0.01}}, "study.pruner.margin: got -0.01; must be >= 0"),
        (
            {"pruner": {"type": "hyperband", "margin": 0.01}},
            "margin: got 0.01; only for median or percentile, not hyperband",
        ),
        (
            {"pruner": {"type": "successive_halving", "n_warmup_steps": 3}},
            "n_warmup_steps: got 3; only for median or percentile, not successive_halving",
        ),
        (
            {"space": {"epochs": {"type": "int", "low": 1, "high": 10, "step": 4}}},
            "high - low (9) is not a multiple of it, so high is never tried; set high: 9",
        ),
        (
            {"space": {"warmup_ratio": {"type": "float", "low": 0, "high": 0.25, "step": 0.1}}},
            "set high: 0.2 or another step",
        ),
    ],
    ids=[
        "group without multivariate",
        "multivariate gp",
        "unknown",
        "grid too small",
        "negative patience",
        "negative margin",
        "margin of hyperband",
        "warmup of successive halving",
        "int step off the range",
        "float step off the range",
    ],
)
def test_a_bad_search_setting_is_named_with_its_fix(
    easy_data: tuple[Path, Path], study: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(easy_data, study)
    assert expected in str(caught.value)


def test_the_grid_sampler_needs_a_finite_search_space(easy_data: tuple[Path, Path]) -> None:
    raw = tiny_config(*easy_data, study={"sampler": {"type": "grid"}})  # learning_rate: log
    with pytest.raises(ConfigError, match="learning_rate: the grid sampler needs a finite"):
        parse_config(raw, Path.cwd())


def test_a_margin_keeps_runs_at_chance_level_and_prunes_clearly_weaker_ones(
    easy_data: tuple[Path, Path],
) -> None:
    """The plateau before a jump: runs at chance level differ by evaluation noise alone."""
    pruners = {
        margin: build_pruner(
            _config(
                easy_data, {"pruner": {"type": "median", "margin": margin, "n_warmup_steps": 1}}
            ).study.pruner
        )
        for margin in (0.0, 0.01)
    }
    for margin, pruner in pruners.items():
        study = optuna.create_study(direction="maximize", pruner=pruner)
        for curve in ([0.34, 0.9], [0.336, 0.88], [0.333, 0.333], [0.338, 0.91]):
            trial = study.ask()
            for step, value in enumerate(curve, 1):
                trial.report(value, step)
            study.tell(trial, max(curve))
        at_chance, weak = study.ask(), study.ask()
        at_chance.report(0.333, 1)
        weak.report(0.30, 1)
        assert at_chance.should_prune() == (margin == 0)  # the median is 0.337
        assert weak.should_prune()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # Optuna's, on NaN runs
def test_a_zero_margin_prunes_exactly_as_optunas_percentile_rule() -> None:
    """MarginPruner restates Optuna's rule; this breaks if Optuna's rule changes."""
    from hpo.study.pruners import MarginPruner

    rng = np.random.default_rng(0)
    for direction in ("maximize", "minimize"):
        for percentile, startup, warmup in [(50.0, 2, 1), (25.0, 0, 0), (75.0, 4, 2)]:
            ours = MarginPruner(percentile, startup, warmup, margin=0.0)
            optunas = optuna.pruners.PercentilePruner(percentile, startup, warmup)
            study = optuna.create_study(direction=direction)
            for _ in range(30):
                trial = study.ask()
                steps = int(rng.integers(1, 6))
                for step in range(steps):
                    value = float(
                        rng.choice([rng.random(), 0.333, float("nan")], p=[0.8, 0.15, 0.05])
                    )
                    trial.report(value, step)
                    frozen = study.get_trials(deepcopy=False)[-1]  # what the pruners get
                    assert ours.prune(study, frozen) == optunas.prune(study, frozen)
                study.tell(trial, float(rng.random()))


@pytest.mark.parametrize("wrapped", ["none", "median"])
def test_patience_prunes_a_declining_curve_and_never_an_improving_one(
    easy_data: tuple[Path, Path], wrapped: str
) -> None:
    pruner_config: dict[str, Any] = {"type": wrapped, "patience": 2}
    if wrapped == "median":
        pruner_config.update(n_startup_trials=0, n_warmup_steps=0)
    config = _config(easy_data, {"pruner": pruner_config})
    study = optuna.create_study(direction="maximize", pruner=build_pruner(config.study.pruner))
    study.enqueue_trial({})
    for curve in ([0.5, 0.6, 0.7, 0.8, 0.9], [0.5, 0.6, 0.7, 0.8, 0.9]):  # the bar to beat
        trial = study.ask()
        for step, value in enumerate(curve):
            trial.report(value, step)
        study.tell(trial, max(curve))
    improving, declining = study.ask(), study.ask()
    for step, value in enumerate([0.1, 0.2, 0.3, 0.4]):
        improving.report(value, step)
        declining.report(0.5 - value, step)
        assert not improving.should_prune()  # weak, but still improving
        # Its last `patience` + 1 evaluations are all below its best before them.
        assert declining.should_prune() == (step >= 3)


@pytest.mark.parametrize("sampler", ["cmaes", "grid"])
def test_a_study_runs_with_another_sampler_through_the_cli(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    sampler: str,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    # A fixed seed: unseeded, CMA-ES's first point (the space's centre) matched the random
    # first trial's in about one run in 24, and the test below failed on chance. hpo's main in
    # this process, trials in the worker, one epoch: this is about what the sampler proposes.
    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": 2,
            "sampler": {"type": sampler, "seed": 0},
            "pruner": {"type": "none"},
            "trial_isolation": "none",
        },
        training={"epochs": 1},
    )
    raw["search_space"] = FINITE_SPACE
    url = f"sqlite:///{tmp_path / 'menu.db'}"
    config = write_config(tmp_path / "c.yaml", raw)
    assert hpo_main(["run", "--study", "menu", "--config", str(config), "--storage", url]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    trials = optuna.load_study(study_name="menu", storage=url).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.COMPLETE]
    assert trials[0].params != trials[1].params


def test_the_default_pruner_is_the_benchmarks_choice(easy_data: tuple[Path, Path]) -> None:
    """Issue 29: with no pruner section, the median rule with margin 0.02 from evaluation 2
    (bench/README.md: it kept the rule at equal trials on all five tasks); successive halving
    keeps the default margin and warmup without complaint (it uses neither)."""
    raw = tiny_config(*easy_data)
    del raw["study"]["pruner"]
    pruner = parse_config(raw, Path.cwd()).study.pruner
    assert (pruner.type, pruner.margin, pruner.n_warmup_steps) == ("median", 0.02, 2)
    built = build_pruner(pruner)
    from hpo.study.pruners import MarginPruner

    assert isinstance(built, MarginPruner) and (built.margin, built.n_warmup_steps) == (0.02, 2)
    raw["study"]["pruner"] = {"type": "successive_halving"}
    assert parse_config(raw, Path.cwd()).study.pruner.type == "successive_halving"


def _explained_study(cfg: dict[str, Any], direction: str = "maximize") -> optuna.Study:
    """A study whose pruner says why, as a worker builds it, with five complete trials that
    reported 0.7 to 0.9 at evaluation 2."""
    from hpo.config.schema import PrunerConfig
    from hpo.study.pruners import ExplainedPruner

    pruner_cfg = PrunerConfig(**cfg)
    pruner = ExplainedPruner(build_pruner(pruner_cfg), pruner_cfg, "accuracy", "evaluation")
    study = optuna.create_study(direction=direction, pruner=pruner)
    for value in (0.7, 0.75, 0.78, 0.85, 0.9):
        trial = study.ask()
        for step, reported in enumerate((value - 0.1, value), 1):
            trial.report(reported, step)
            trial.should_prune()  # successive halving records its rungs here
        study.tell(trial, value)
    return study


@pytest.mark.parametrize("margin", [0.0, 0.02])
def test_a_pruned_trial_says_which_pruner_and_what_it_was_compared_with(margin: float) -> None:
    # Issue 42: the reason read just "pruner".
    study = _explained_study({"type": "median", "n_warmup_steps": 2, "margin": margin})
    pruner = study.pruner
    weak = study.ask()
    weak.report(0.45, 1)
    weak.report(0.51, 2)
    assert weak.should_prune()
    reason = pruner.reason(weak.number)
    by_margin = " by more than the margin 0.02" if margin else ""
    assert reason == (
        "median pruner: evaluation 2's accuracy 0.51 below the median 0.78 of 5 complete "
        f"trials at that evaluation{by_margin}"
    )
    assert pruner.reason(weak.number) is None  # handed over once
    strong = study.ask()
    strong.report(0.8, 1)
    strong.report(0.79, 2)
    assert not strong.should_prune() and pruner.reason(strong.number) is None


def test_a_prune_reason_names_the_best_so_far_the_percentile_and_patience() -> None:
    study = _explained_study(
        {
            "type": "percentile",
            "percentile": 25.0,
            "n_warmup_steps": 2,
            "margin": 0.0,
            "patience": 0,
        }
    )
    weak = study.ask()
    weak.report(0.55, 1)
    weak.report(0.5, 2)
    assert weak.should_prune()
    assert study.pruner.reason(weak.number) == (
        "percentile pruner: best so far 0.55 (evaluation 2's accuracy 0.5) below the top-25% "
        "mark 0.85 of 5 complete trials at that evaluation; and its accuracy no better than "
        "0.55, its best before it"
    )
    halving = _explained_study({"type": "successive_halving", "min_resource": 1})
    weak = halving.ask()
    weak.report(0.1, 1)
    assert weak.should_prune()
    assert halving.pruner.reason(weak.number) == (
        "successive halving pruner: evaluation 1's accuracy 0.1 not in the best 1/3 of the "
        "trials that reached evaluation 1"
    )


def test_a_minimised_metric_is_pruned_above_the_median() -> None:
    study = _explained_study({"type": "median", "n_warmup_steps": 1, "margin": 0.0}, "minimize")
    weak = study.ask()
    weak.report(0.95, 1)
    assert weak.should_prune()
    reason = study.pruner.reason(weak.number)
    assert reason is not None and "0.95 above the median 0.68 of 5 complete" in reason
