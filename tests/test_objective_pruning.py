"""Pruning a study of several objectives on one of them (study.pruner.objective): the decision
in a one-objective view of the study, the front still of all objectives, the config's checks,
and one study through the real worker."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch
from optuna.storages import InMemoryStorage
from optuna.trial import TrialState

from hpo.config.loader import parse_config
from hpo.config.schema import PrunerConfig
from hpo.errors import ConfigError
from hpo.plugins.context import ReportError, TrainingContext
from hpo.stopping import StopRequest
from hpo.study.front import rule_for
from hpo.study.kept_models import best_trials
from hpo.study.pruners import ExplainedPruner
from hpo.study.sampling import pruner_settings
from hpo.trainer.config import TrainingConfig
from hpo.trial import objective_pruning
from hpo.trial.objective_pruning import (
    SPEED_ATTR,
    ObjectivePruner,
    mirror_study,
    reported_values,
)
from hpo.trial.process import _pass_on
from tests.conftest import exit_code, tiny_config, write_config

CURVE = {0: 0.80, 1: 0.85}  # the complete trials' accuracy at evaluations 0 and 1


def _study(
    pruner: optuna.pruners.BasePruner, throughput: tuple[int, float] | None = None
) -> optuna.Study:
    """[accuracy, samples_per_s], both maximized, three complete trials that each reached an
    accuracy of 0.85 at a different throughput, pruned on accuracy (`throughput`: see
    ObjectivePruner)."""
    storage = InMemoryStorage()
    study = optuna.create_study(
        storage=storage,
        directions=["maximize", "maximize"],
        pruner=ObjectivePruner(pruner, 0, storage, throughput),
    )
    study.set_metric_names(["accuracy", "samples_per_s"])
    for samples_per_s in (100.0, 200.0, 300.0):
        study.add_trial(
            optuna.trial.create_trial(values=[0.85, samples_per_s], intermediate_values=CURVE)
        )
    return study


def _median() -> optuna.pruners.BasePruner:
    return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)


def _reported(study: optuna.Study, values: list[float]) -> tuple[optuna.Trial, bool]:
    """A new trial that reports `values` at evaluations 0, 1...; whether it is to be pruned."""
    trial = study.ask()
    for step, value in enumerate(values):
        objective_pruning.report(trial, value, step)
    return trial, objective_pruning.should_prune(trial)


def test_a_trial_weak_on_the_first_objective_is_pruned_and_a_strong_one_is_not() -> None:
    explained = ExplainedPruner(_median(), PrunerConfig(type="median"), "accuracy", "evaluation")
    study = _study(explained)
    weak, weak_pruned = _reported(study, [0.50])
    strong, strong_pruned = _reported(study, [0.90])
    assert (weak_pruned, strong_pruned) == (True, False)
    # Optuna's own trial.report refuses this study (optuna#3450): the values are the storage's.
    with pytest.raises(NotImplementedError):
        weak.report(0.5, 5)
    assert reported_values(study.trials[weak.number]) == {0: 0.50}
    reason = study.pruner.reason(weak.number)
    assert reason is not None and "accuracy 0.5" in reason and "median 0.8" in reason
    # A report at a step already reported keeps the first value, as Optuna does.
    objective_pruning.report(strong, 0.10, 0)
    assert reported_values(study.trials[strong.number]) == {0: 0.90}


def test_with_throughput_a_trial_is_judged_only_against_trials_as_fast() -> None:
    # The complete trials reach 0.85 at 100, 200 and 300 samples/s (tolerance 5%). A trial at
    # 0.5 that trains at 150 samples/s meets two faster trials, better on accuracy: pruned. At
    # 400 samples/s, the fastest so far, it is a trade-off the front keeps: not pruned; nor
    # while its speed is unknown.
    explained = ExplainedPruner(_median(), PrunerConfig(type="median"), "accuracy", "evaluation")
    study = _study(explained, throughput=(1, 0.05))

    def judged(speed: float | None) -> bool:
        trial = study.ask()
        if speed is not None:
            trial.set_user_attr(SPEED_ATTR, speed)
        objective_pruning.report(trial, 0.5, 0)
        return objective_pruning.should_prune(trial)

    assert judged(150.0) is True
    reason = study.pruner.reason(3)  # the first trial judged
    assert reason is not None and "of 2 complete trials" in reason
    assert reason.endswith("(of the trials at least as fast in samples/s)")
    assert judged(400.0) is False
    assert judged(None) is False
    # Within the tolerance, a trial no faster than 300 / 0.95 still meets the one at 300, but
    # the median rule needs two complete trials to compare with (n_startup_trials=2).
    assert judged(310.0) is False
    assert judged(190.0) is True


def test_the_pruner_judges_the_named_objective_in_its_direction() -> None:
    # Pruned on objective 1 (minimized here): the view is of that objective alone.
    storage = InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=["maximize", "minimize"])
    study.add_trial(optuna.trial.create_trial(values=[0.9, 2.0], intermediate_values={0: 3.0}))
    study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL))
    study.ask()
    view = mirror_study(study, 1)
    assert view.direction == optuna.study.StudyDirection.MINIMIZE
    assert [t.state for t in view.trials] == [
        TrialState.COMPLETE,
        TrialState.FAIL,
        TrialState.RUNNING,
    ]
    assert view.trials[0].value == 2.0 and view.trials[0].intermediate_values == {0: 3.0}
    assert view.study_name == study.study_name


def test_pruned_trials_are_pruned_in_the_study_and_the_front_uses_every_objective() -> None:
    study = _study(_median())
    weak, _ = _reported(study, [0.50, 0.55])
    study.tell(weak, state=TrialState.PRUNED)
    fast_but_weak = study.ask()  # completes: a weak accuracy can still be a trade-off
    study.tell(fast_but_weak, [0.70, 900.0])
    strong, pruned = _reported(study, [0.90, 0.95])
    assert not pruned
    study.tell(strong, [0.95, 50.0])
    trials = study.get_trials()
    assert trials[weak.number].state == TrialState.PRUNED
    assert trials[weak.number].values is None  # no value of one objective stands for both
    front = {t.number for t in best_trials(trials, rule_for(study))}
    # The best on accuracy, the fastest, and the best of the rest at 0.85: the front uses both.
    assert front == {2, fast_but_weak.number, strong.number}
    assert weak.number not in front


def test_a_trial_process_reports_and_asks_through_its_worker() -> None:
    # What a trial process sends over its pipe (ChildTrial.report, should_prune) reaches the
    # same decision in the worker.
    study = _study(_median())
    trial = study.ask()
    replies: list[object] = []
    conn = SimpleNamespace(send=replies.append)
    assert _pass_on(trial, conn, StopRequest(), ("report", 0.5, 0)) is None  # type: ignore[arg-type]
    assert _pass_on(trial, conn, StopRequest(), ("should_prune",)) is None  # type: ignore[arg-type]
    assert replies == [True]
    assert reported_values(study.trials[trial.number]) == {0: 0.5}


def test_tpe_samples_after_a_pruned_trial_of_two_objectives() -> None:
    # Optuna 5.0's TPE ranks a pruned trial by its last intermediate value through
    # study.direction, which a study of two objectives refuses: the values reported for the
    # pruner are the trial's own record, not intermediate values, so sampling goes on.
    study = _study(_median())
    study.sampler = optuna.samplers.TPESampler(n_startup_trials=0, seed=0)
    for _ in range(3):
        trial = study.ask()
        trial.suggest_float("learning_rate", 1e-5, 1e-1, log=True)
        objective_pruning.report(trial, 0.1, 0)
        assert objective_pruning.should_prune(trial)
        study.tell(trial, state=TrialState.PRUNED)
    assert study.trials[-1].intermediate_values == {}
    assert [t.state for t in study.trials[3:]] == [TrialState.PRUNED] * 3


def test_successive_halving_keeps_its_rungs_in_the_study() -> None:
    # ASHA records each trial's value at a rung on the trial (a system attribute): written to
    # the study itself, later trials are compared with it, as with one objective.
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    study = _study(pruner)
    first, first_pruned = _reported(study, [0.9, 0.9])
    second, second_pruned = _reported(study, [0.1, 0.1])
    rungs = study.trials[first.number].system_attrs
    assert rungs.get("completed_rung_0") == 0.9
    assert (first_pruned, second_pruned) == (False, True)


def test_successive_halving_compares_a_fast_trial_with_trials_as_fast_only() -> None:
    # ASHA compares a trial with every trial that reached its rung, running and pruned ones
    # too: with throughput an objective, only those at least as fast count, by their speed so
    # far.
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    study = _study(pruner, throughput=(1, 0.05))

    def judged(value: float, speed: float) -> bool:
        trial = study.ask()
        trial.set_user_attr(SPEED_ATTR, speed)
        objective_pruning.report(trial, value, 0)
        objective_pruning.report(trial, value, 1)
        return objective_pruning.should_prune(trial)

    assert judged(0.9, 100.0) is False  # slow and accurate: at its rung, alone so far
    assert judged(0.1, 1000.0) is False  # fast: the slow one is no rival
    assert judged(0.05, 950.0) is True  # as fast as the one before, and worse


def test_hyperband_judges_in_its_brackets() -> None:
    study = _study(optuna.pruners.HyperbandPruner(min_resource=1, max_resource=4))
    _, pruned = _reported(study, [0.9])
    assert pruned is False


def test_the_private_optuna_paths_this_relies_on_are_still_public() -> None:
    # Breaks on an Optuna upgrade that changes what the view needs: the storage's calls, and
    # Trial.report still refusing several objectives (else this module could go).
    assert importlib.metadata.version("optuna").split(".")[0] == "5"
    for name in (
        "get_trial_id_from_study_id_trial_number",
        "set_trial_intermediate_value",
        "set_trial_system_attr",
    ):
        assert callable(getattr(optuna.storages.BaseStorage, name))
    study = optuna.create_study(directions=["maximize", "maximize"])
    with pytest.raises(NotImplementedError):
        study.ask().should_prune()


@pytest.mark.parametrize(
    ("study", "said"),
    [
        (
            {"metric": ["accuracy", "samples_per_s"], "pruner": {"objective": "f1"}},
            "study.pruner.objective: got 'f1'; must be one of study.metric's: accuracy, "
            "samples_per_s",
        ),
        (
            {"metric": "accuracy", "pruner": {"objective": "accuracy"}},
            "study.pruner.objective: got 'accuracy'; only for several objectives",
        ),
        (
            {"metric": ["accuracy", "samples_per_s"], "pruner": {"objective": "samples_per_s"}},
            "study.pruner.objective: got 'samples_per_s'; a trial's throughput is measured once",
        ),
        (
            {"metric": ["accuracy", "eval_loss"], "pruner": {"type": "none", "objective": "x"}},
            "study.pruner.objective: got 'x'; must be one of",
        ),
        (
            {
                "metric": ["accuracy", "eval_loss"],
                "pruner": {"type": "none", "objective": "accuracy"},
            },
            "study.pruner.objective: got 'accuracy'; pruner type none prunes nothing",
        ),
    ],
)
def test_a_pruned_objective_that_makes_no_sense_is_one_line(
    easy_data: tuple[Path, Path], study: dict[str, object], said: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(tiny_config(*easy_data, study=study), Path.cwd())
    assert len(refused.value.problems) == 1
    assert refused.value.problems[0].startswith(said)


def test_a_wrong_pruned_objective_exits_2_with_one_line(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    raw = tiny_config(
        *easy_data, study={"metric": ["accuracy", "samples_per_s"], "pruner": {"objective": "f1"}}
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert (
        exit_code(hpo_main, ["run", "--study", "x", "--config", str(config), "--storage", url]) == 2
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "study.pruner.objective: got 'f1'" in err


def test_a_study_of_two_objectives_pruned_on_eval_loss_through_the_worker(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    url = f"sqlite:///{tmp_path / 'two.db'}"
    # Two trials at learning rates that learn, then one at a rate that cannot (its loss stays
    # at the start's): the median rule on eval_loss, judged at the second evaluation, stops
    # the third. Trials train in the worker (isolation none): the same loop and the same
    # decision as in a trial process, whose pipe hands report and should_prune over to it.
    # A tolerance of 0.99: the third is compared with both others, however fast each ran on
    # this shared machine (the unit tests above hold the comparison by speed).
    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": 3,
            "metric": ["eval_loss", "samples_per_s"],
            "checkpoints": False,
            "trial_isolation": "none",
            "throughput_tolerance": 0.99,
            "pruner": {
                "type": "median",
                "n_startup_trials": 2,
                "n_warmup_steps": 2,
                "margin": 0.0,
                "objective": "eval_loss",
            },
            "enqueue": [{"learning_rate": 5e-3}, {"learning_rate": 4e-3}, {"learning_rate": 1e-6}],
        },
        search_space={
            "effective_batch_size": {"type": "categorical", "choices": [8]},
            "learning_rate": {"type": "float", "low": 1e-6, "high": 5e-3, "log": True},
        },
        training={"epochs": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    assert hpo_main(["run", "--study", "two", "--config", str(config), "--storage", url]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    assert "the pruner judges eval_loss" in err
    assert "created in memory" not in err  # the one-objective view says nothing
    trials = optuna.load_study(study_name="two", storage=url).get_trials()
    states = [t.state for t in trials]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED], err[-3000:]
    for trial in trials[:2]:  # each evaluation's eval_loss, as with one objective
        curve = trial.user_attrs["curve"]
        assert list(reported_values(trial).values()) == pytest.approx(curve)
        assert len(trial.values) == 2
    pruned = trials[2]
    assert pruned.user_attrs[SPEED_ATTR] > 0  # its samples/s at its last evaluation
    assert pruned.values is None
    assert pruned.user_attrs["prune_reason"].startswith("median pruner: evaluation 2's eval_loss")


def test_the_pruner_objective_is_part_of_the_setup_every_worker_shares() -> None:
    # A study's record of its pruner (hpo.study.setup_record) names the objective it judges;
    # without one, the record is as before, so studies made earlier still match.
    assert pruner_settings(PrunerConfig(objective="accuracy"))["objective"] == "accuracy"
    assert "objective" not in pruner_settings(PrunerConfig())


def test_a_training_function_reports_the_pruned_objective() -> None:
    # training.entrypoint: ctx.report hands the pruner the named objective's value, which it
    # must include.
    class Recorded:
        number = 0
        reports: list[tuple[float, int]] = []

        def set_user_attr(self, key: str, value: object) -> None:
            pass

        def report(self, value: float, step: int) -> None:
            self.reports.append((value, step))

        def should_prune(self) -> bool:
            return False

    trial = Recorded()
    context = TrainingContext(
        params={},
        device=torch.device("cpu"),
        effective_batch_size=8,
        trial_number=0,
        metric="val_loss",
        _trial=trial,
        _training=TrainingConfig(),
        _should_stop=lambda: False,
        _pruned_metric="f1",
    )
    context.report({"val_loss": 0.7, "f1": 0.4}, 3)
    assert trial.reports == [(0.4, 3)]
    with pytest.raises(ReportError, match="no 'f1' among the metrics given"):
        context.report({"val_loss": 0.6}, 4)
