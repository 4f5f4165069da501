"""`hpo retrain`: the plan, the winner on the mean, what cleanup keeps, the final model's folder,
and end to end through the CLI (search, retrain stopped and resumed, full data, `hpo best`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

from hpo.config.schema import Config, ParamSpec, space_record
from hpo.errors import HPOError
from hpo.reports import model_card
from hpo.study import retrain
from hpo.study.kept_models import remove_unneeded_folders
from hpo.trainer.data import PreparedData, TokenizedSplit, with_eval_in_training
from hpo.trial.folders import prepare_trial_folder, study_folder_name
from tests.conftest import (
    run_hpo,
    sigterm_once_training,
    start_hpo,
    tiny_config,
    wait_until_training,
    write_config,
)

SPACE = {"learning_rate": ParamSpec(type="float", low=1e-4, high=1e-1, log=True)}
LR = FloatDistribution(1e-4, 1e-1, log=True)


def _searched(values: list[float | None], direction: str = "maximize") -> optuna.Study:
    """A searched study: one trial per value (None: pruned), learning rate 1e-3 * (k + 1)."""
    study = optuna.create_study(direction=direction)
    study.set_user_attr("search_space", space_record(SPACE))
    for k, value in enumerate(values):
        study.add_trial(
            optuna.create_trial(
                state=TrialState.COMPLETE if value is not None else TrialState.PRUNED,
                value=value,
                params={"learning_rate": 1e-3 * (k + 1)},
                distributions={"learning_rate": LR},
            )
        )
    return study


def _config() -> Config:
    config = Config(search_space=dict(SPACE))
    config.training.seed = 42
    return config


def test_the_plan_takes_the_best_distinct_configurations_and_seeds_the_search_did_not_use() -> None:
    study = _searched([0.7, 0.9, None, 0.8, 0.9])
    study.enqueue_trial({"learning_rate": 2e-3})  # trial 1's configuration again: once in the plan
    plan = retrain.make_plan(study, _config(), top=3, seeds=2)
    assert [c["trial"] for c in plan.configs] == [1, 4, 3]  # ties: the earlier trial first
    assert [c["rank"] for c in plan.configs] == [1, 2, 3]
    assert plan.seeds == [43, 44] and 42 not in plan.seeds
    name = f"{study.study_name} [retrain top 3 x 2 seeds, {plan.digest}]"
    assert plan.runs == 6 and plan.study_name == name and len(plan.digest) == 6
    assert retrain.make_plan(study, _config(), top=3, seeds=2).study_name == name  # resumable
    # The search went on and found a better configuration: another plan, another study.
    study.add_trial(
        optuna.create_trial(
            value=0.99, params={"learning_rate": 9e-3}, distributions={"learning_rate": LR}
        )
    )
    assert retrain.make_plan(study, _config(), top=3, seeds=2).study_name != name
    assert "full data" in plan.full_data_study_name
    assert plan.full_data_study_name not in (name, plan.study_name)
    minimized = retrain.make_plan(_searched([0.3, 0.1, 0.2], "minimize"), _config(), 1, 1)
    assert [c["trial"] for c in minimized.configs] == [1]
    fewer = retrain.make_plan(_searched([0.5]), _config(), top=3, seeds=1)
    assert len(fewer.configs) == 1 and "top 1 x 1" in fewer.study_name
    longest = retrain.make_plan(_searched([0.5]), _config(), top=3, seeds=1)
    assert len(retrain.retrain_study_name("x" * 512, 3, 3, longest.digest)) == 512


@pytest.mark.parametrize(
    ("values", "space", "message"),
    [
        ([None, None], SPACE, "no completed trial"),
        ([0.5], {"learning_rate": ParamSpec(type="float", low=1e-5, high=1e-1)}, "search space"),
        ([0.5], {**SPACE, "seed": ParamSpec(type="categorical", choices=[1, 2])}, "seed"),
        ([0.5], SPACE, "is the retrain of study 'searched'"),
    ],
    ids=["nothing completed", "another search space", "the seed is tuned", "a retrain study"],
)
def test_a_plan_that_cannot_be_made_is_one_line(
    values: list[float | None], space: dict[str, ParamSpec], message: str
) -> None:
    study = _searched(values)
    if message.startswith("is the retrain"):
        study.set_user_attr("retrain_of", "searched")
    if "seed" in space:
        study.set_user_attr("search_space", space_record(space))
    config = _config()
    config.search_space = space
    with pytest.raises(HPOError, match=message):
        retrain.make_plan(study, config, 3, 3)


def _retrain_study(plan: retrain.RetrainPlan, runs: dict[int, list[float | None]]) -> optuna.Study:
    """The retrain study after its runs: per configuration rank, one value per seed (None:
    the run failed)."""
    study = optuna.create_study(direction="maximize")
    seed = CategoricalDistribution(plan.seeds)
    for config in plan.configs:
        for s, value in zip(plan.seeds, runs[config["rank"]], strict=True):
            study.add_trial(
                optuna.create_trial(
                    state=TrialState.COMPLETE if value is not None else TrialState.FAIL,
                    value=value,
                    params={**config["params"], "seed": s},
                    distributions={"learning_rate": LR, "seed": seed},
                    user_attrs={"retrain_config": config["rank"], "seed": s},
                )
            )
    return study


def test_the_winner_is_the_best_mean_not_the_luckiest_run() -> None:
    plan = retrain.make_plan(_searched([0.95, 0.90]), _config(), top=2, seeds=3)
    # Configuration 1 had the best search value and has the best single run, by luck.
    study = _retrain_study(plan, {1: [0.97, 0.70, 0.72], 2: [0.90, 0.91, None]})
    found = retrain.results(study, plan)
    assert [len(r.runs) for r in found] == [3, 2] and [r.unfinished for r in found] == [0, 1]
    winner = retrain.pick_winner(found, study.direction, seeds=3)
    assert winner is not None and winner.rank == 2
    assert winner.mean == pytest.approx(0.905) and winner.std == pytest.approx(0.00707, abs=1e-4)
    assert retrain.best_run(winner, study.direction)["value"] == 0.91
    nothing = _retrain_study(plan, {1: [None] * 3, 2: [None] * 3})
    assert retrain.pick_winner(retrain.results(nothing, plan), study.direction, 3) is None


def test_one_lucky_run_of_a_configuration_that_failed_on_most_seeds_does_not_win() -> None:
    plan = retrain.make_plan(_searched([0.95, 0.90]), _config(), top=2, seeds=3)
    study = _retrain_study(plan, {1: [0.99, None, None], 2: [0.90, 0.91, 0.89]})
    found = retrain.results(study, plan)
    winner = retrain.pick_winner(found, study.direction, seeds=3)
    assert winner is not None and winner.rank == 2
    assert found[0].std is None  # one run: no spread, not a spread of zero
    assert "one run, no spread" in model_card.mean_std_text(found[0].mean, found[0].std)
    # When every configuration lost most of its runs, the ones with the most runs compete.
    study = _retrain_study(plan, {1: [0.99, None, None], 2: [0.70, 0.71, None]})
    winner = retrain.pick_winner(retrain.results(study, plan), study.direction, seeds=3)
    assert winner is not None and winner.rank == 2


def test_cleanup_keeps_every_configurations_best_run_in_a_retrain_study(tmp_path: Path) -> None:
    plan = retrain.make_plan(_searched([0.95, 0.90]), _config(), top=2, seeds=3)
    study = _retrain_study(plan, {1: [0.97, 0.70, 0.72], 2: [0.90, 0.91, 0.89]})
    trials = study.get_trials()
    root = tmp_path / "r"
    for trial in trials:
        prepare_trial_folder(root, "r", f"trial-{trial.number}")
    removed = remove_unneeded_folders(root, "r", trials, study.directions)
    # The overall best run (trial 0) and configuration 2's best run (trial 4) stay.
    assert sorted(p.name for p in removed) == ["trial-1", "trial-2", "trial-3", "trial-5"]


def test_cleanup_keeps_the_run_retrain_saves_in_a_study_of_two_objectives(tmp_path: Path) -> None:
    # Two runs tie on the first objective; the later is better on the second, so the Pareto
    # front holds only it, but retrain saves the earlier (best on the first, earliest of equals).
    study = optuna.create_study(directions=["maximize", "maximize"])
    for values in ([0.9, 0.5], [0.9, 0.7], [0.8, 0.9]):
        study.add_trial(
            optuna.create_trial(
                values=values, params={}, distributions={}, user_attrs={"retrain_config": 1}
            )
        )
    trials = study.get_trials()
    root = tmp_path / "r"
    for trial in trials:
        prepare_trial_folder(root, "r", f"trial-{trial.number}")
    remove_unneeded_folders(root, "r", trials, study.directions)
    kept = sorted(p.name for p in root.iterdir() if p.name.startswith("trial-"))
    assert "trial-0" in kept  # what retrain.best_run picks
    assert {"trial-1", "trial-2"} <= set(kept)  # the Pareto front


def test_full_data_trains_on_both_splits_and_keeps_the_evaluation_split() -> None:
    train = TokenizedSplit(
        np.array([1, 2, 3], np.int32), np.array([0, 1, 3]), None, np.array([0, 1])
    )
    held = TokenizedSplit(
        np.array([7, 8, 9, 9], np.int32), np.array([0, 3, 4]), None, np.array([1, 1])
    )
    joined = with_eval_in_training(PreparedData(train, held, ["a", "b"], 0))
    assert joined.train.ids.tolist() == [1, 2, 3, 7, 8, 9, 9]
    assert joined.train.lengths.tolist() == [1, 2, 3, 1] and joined.train.labels.tolist() == [
        0,
        1,
        1,
        1,
    ]
    assert joined.eval is held


def _model_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}", encoding="utf-8")
    (path / "model.safetensors").write_bytes(b"weights")
    return path


def test_the_final_model_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    model = _model_folder(tmp_path / "best-model")
    (model / "model.safetensors").chmod(0o600)  # as checkpoints are written
    db = "sqlite:////data/a.db"
    card: dict[str, Any] = {"study": "s", "metric": "accuracy", "storage": db}
    out = tmp_path / "final"
    stranger = tmp_path / "mine"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("the user's")
    with pytest.raises(HPOError, match="not a final model hpo wrote"):
        retrain.check_out(stranger, "s", db)
    with pytest.raises(HPOError, match="parent .* does not exist"):
        retrain.check_out(tmp_path / "no" / "final", "s", db)
    with pytest.raises(HPOError, match="is not a folder"):
        retrain.check_out(stranger / "notes.txt" / "final", "s", db)
    with pytest.raises(HPOError, match="missing"):
        retrain.save_final_model(tmp_path / "gone", out, card, "# card\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-model", "mine"]  # nothing left

    with pytest.MonkeyPatch.context() as patch:
        retrain.save_final_model(model, out, card, "# card\n")
        retrain.check_out(out, "s", db)  # hpo's own: a later retrain may replace it
        with pytest.raises(HPOError, match="holds the final model of study 's' of sqlite"):
            retrain.check_out(out, "other", db)  # another study's final model is never replaced
        with pytest.raises(HPOError, match="holds the final model of study 's'"):
            retrain.check_out(out, "s", "sqlite:////data/b.db")  # nor another database's
        # A save killed midway left a folder aside; the next save removes it (its writer is
        # dead), not one that another live process is writing.
        dead, live = (tmp_path / f".final.{tag}.tmp" for tag in ("dead", "live"))
        for folder, pid in ((dead, 2**22 + 1), (live, os.getpid())):
            folder.mkdir()
            writer = {"host": socket.gethostname(), "pid": pid}
            (folder / retrain.ASIDE_MARKER).write_text(json.dumps(writer))
        (model / "model.safetensors").write_bytes(b"better weights")
        retrain.save_final_model(model, out, card, "# card\n")
        assert not dead.exists() and live.is_dir()
        shutil.rmtree(live)
        # A parent folder it cannot write in: one line, nothing left behind.
        patch.setattr(retrain.tempfile, "mkdtemp", _refused)
        with pytest.raises(HPOError, match="cannot write"):
            retrain.save_final_model(model, tmp_path / "empty", card, "# card\n")
    assert (out / "model.safetensors").read_bytes() == b"better weights"
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable as any file
    assert not (out / retrain.ASIDE_MARKER).exists()
    assert json.loads((out / retrain.CARD_JSON).read_text(encoding="utf-8"))["study"] == "s"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best-model", "final", "mine"]
    (tmp_path / "empty").mkdir()
    retrain.check_out(tmp_path / "empty", "s", db)  # an empty folder is a fine place for it
    made = subprocess.run(["chattr", "+i", str(tmp_path / "empty")], capture_output=True)
    if made.returncode == 0:  # an immutable folder (root writes through permissions)
        try:
            with pytest.raises(HPOError, match="cannot write there"):
                retrain.check_out(tmp_path / "empty", "s", db)
        finally:
            subprocess.run(["chattr", "-i", str(tmp_path / "empty")], check=True)


def _refused(*args: Any, **kwargs: Any) -> str:
    raise PermissionError(13, "Permission denied")


# -- through the CLI ------------------------------------------------------------------------


def _search(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    **study: Any,
) -> tuple[Path, str]:
    """The searched study 's', by hpo's main in this process (a subprocess would spend seconds
    importing torch, and its fork server as many again); `study` updates the config's section."""
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 2, "pruner": {"type": "none"}, **study},
        # Two epochs (each run of the search and of retrain): long enough to be stopped while it
        # trains; the tests check which runs ran and what was saved, not what they learned.
        training={"epochs": 2, "evals_per_epoch": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    run = ["run", "--study", "s", "--config", str(config), "--storage", url, "--quiet"]
    assert hpo_main(run) == 0
    return config, url


def _plan(url: str, config: Path, top: int, seeds: int) -> retrain.RetrainPlan:
    searched = optuna.load_study(study_name="s", storage=url)
    return retrain.make_plan(searched, retrain_config_of(config), top, seeds)


def _stop_once_training(
    args: list[str],
    database: Path,
    study: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`hpo retrain` in this process, SIGTERMed once a run of `study` trains: handed back, told
    how to resume."""
    capsys.readouterr()
    with sigterm_once_training(database, study) as sent:
        assert hpo_main(args) == 0
    stderr = capsys.readouterr().err
    assert sent.is_set(), stderr[-3000:]
    assert "run the same hpo retrain again" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr


def test_retrain_through_the_cli_stopped_resumed_then_best_names_the_winner(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every command runs hpo's main in this process, in the test's folder, as a user's shell
    would run them one after another."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    monkeypatch.chdir(tmp_path)
    config, url = _search(tmp_path, easy_data, hpo_main)
    args = [
        "retrain",
        "--study",
        "s",
        "--config",
        str(config),
        "--storage",
        url,
        "--top",
        "2",
        "--seeds",
        "2",
        "--full-data",
        "--out",
        "final",
    ]
    plan = _plan(url, config, 2, 2)
    name, full_name = plan.study_name, plan.full_data_study_name

    # Stopped while its first run trains, then while the full-data run trains: each handed
    # back and resumed by the next call.
    _stop_once_training(args, tmp_path / "hpo.db", name, hpo_main, capsys)
    _stop_once_training(args, tmp_path / "hpo.db", full_name, hpo_main, capsys)
    assert not (tmp_path / "final").exists()

    assert hpo_main(args) == 0
    done = capsys.readouterr()
    assert "Traceback" not in done.err, done.err[-3000:]
    assert "<- winner" in done.out and "final model: final" in done.out
    assert "the final model: trained on the training and evaluation splits" in done.out
    study = optuna.load_study(study_name=name, storage=url)
    trials = study.get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    runs = {(t.user_attrs["retrain_config"], t.user_attrs["seed"]) for t in complete}
    assert len(complete) == 4 and len(runs) == 4  # 2 x 2 runs, each once
    assert sum(t.state == TrialState.FAIL for t in trials) == 1  # the stopped attempt
    # The full-data run (its metric is measured on data it trained on) is in a study apart.
    full = optuna.load_study(study_name=full_name, storage=url).get_trials()
    assert [t.state for t in full] == [TrialState.FAIL, TrialState.COMPLETE]
    assert all(t.user_attrs["full_data"] for t in full)
    card = json.loads((tmp_path / "final" / retrain.CARD_JSON).read_text(encoding="utf-8"))
    assert card["saved_run"] == {"trial": 1, "seed": card["saved_run"]["seed"], "full_data": True}
    assert card["retrain_study"] == name and card["full_data_note"]
    assert len(card["configurations"]) == 2 and all(
        len(c["runs"]) == 2 for c in card["configurations"]
    )
    assert [f["sha256"] for f in card["data"]] == [
        model_card.data_files(retrain_config_of(config))[i]["sha256"] for i in range(2)
    ]
    assert set(card["versions"]) >= {"hpo", "torch", "transformers", "optuna", "python"}
    assert "± " in (tmp_path / "final" / "README.md").read_text(encoding="utf-8")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final")
    AutoTokenizer.from_pretrained(tmp_path / "final")
    assert model.config.num_labels == 2

    assert hpo_main(["best", "--study", "s", "--storage", url]) == 0
    best = capsys.readouterr().out
    assert "retrain winner (mean over 2 seeds" in best, best
    assert f"final model: {tmp_path / 'final'}" in best
    assert hpo_main(["best", "--study", "s", "--storage", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["retrain"]["params"] == card["winner"]["params"]
    assert hpo_main(["status", "--study", name, "--storage", url]) == 0
    status = capsys.readouterr().out
    assert "4 complete" in status, status

    assert hpo_main(args) == 0  # everything ran: nothing trains again
    assert "Traceback" not in capsys.readouterr().err
    assert len(optuna.load_study(study_name=name, storage=url).get_trials()) == len(trials)
    assert len(optuna.load_study(study_name=full_name, storage=url).get_trials()) == 2


def retrain_config_of(path: Path) -> Config:
    from hpo.config.loader import load_config

    return load_config(path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--top", "0"), "--top: got '0'"),
        (("--seeds", "x"), "--seeds: got 'x'"),
        (("--out", "c.yaml"), "--out c.yaml: exists and is not a final model"),
        (("--study", "nope"), "no study 'nope'"),
    ],
    ids=["top 0", "seeds not a number", "out a user's file", "unknown study"],
)
def test_bad_retrain_input_is_one_line_and_trains_nothing(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    extra: tuple[str, ...],
    message: str,
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # --out c.yaml: the user's file in the working folder
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    if "--study" in extra:
        assert (
            hpo_main(
                [
                    "run",
                    "--study",
                    "s",
                    "--config",
                    str(config),
                    "--storage",
                    url,
                    "--n-trials",
                    "1",
                    "--quiet",
                ]
            )
            == 0
        )
        capsys.readouterr()
    args = ["retrain", "--study", "s", "--config", str(config), "--storage", url]
    args += [*extra] if "--study" not in extra else ["--study", "nope"]
    try:
        code = hpo_main(args)
    except SystemExit as e:  # refused by the parser, as `python -m hpo` exits
        code = e.code
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-3000:]
    assert message in stderr and "Traceback" not in stderr
    if "--study" not in extra:
        assert not (tmp_path / "hpo.db").exists()  # nothing written
    assert "data: " not in stderr  # refused before the data is prepared (seconds)


def test_retrain_runs_on_the_workers_of_several_gpus(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # the search's checkpoints, where the retrain's go
    # The runs train in their workers (trial_isolation: none): this is about the launcher and
    # its workers, and each worker's fork server would cost seconds of imports.
    config, url = _search(tmp_path, easy_data, hpo_main, trial_isolation="none")
    args = (
        "retrain",
        "--study",
        "s",
        "--config",
        str(config),
        "--storage",
        url,
        "--top",
        "1",
        "--seeds",
        "2",
        "--gpus",
        "0,1",
        "--full-data",
    )
    env = {"HPO_TEST_FAKE_GPUS": "2"}
    plan = _plan(url, config, 1, 2)
    # A SIGTERM to the launcher reaches its workers, and the launcher ends too (it once went on
    # waiting for the runs its workers had handed back, deaf to any further signal).
    launcher = start_hpo(*args, cwd=tmp_path, env=env, own_group=True)
    wait_until_training(url, plan.study_name, [launcher], trials=2)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=90)
    assert launcher.returncode == 0 and "run the same hpo retrain again" in stderr, stderr[-3000:]

    done = run_hpo(*args, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "started 2 workers" in done.stderr
    study = optuna.load_study(study_name=plan.study_name, storage=url)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert sorted(t.user_attrs["seed"] for t in complete) == [43, 44]  # each once
    # And the handed-back attempts, nothing else: one per worker whose run the SIGTERM met
    # (a run training in its worker may end in the moment before the signal lands).
    handed_back = [t for t in study.get_trials() if t.state != TrialState.COMPLETE]
    assert 1 <= len(handed_back) <= 2, [(t.number, t.state.name) for t in handed_back]
    assert {t.user_attrs.get("interrupted") for t in handed_back} == {"SIGTERM"}
    full = optuna.load_study(study_name=plan.full_data_study_name, storage=url)
    assert [t.state for t in full.get_trials()] == [TrialState.COMPLETE]  # the workers ran it
    assert (tmp_path / f"hpo-final-{study_folder_name('s')}" / retrain.CARD_JSON).is_file()


def test_without_config_the_demo_config_is_checked_against_the_study() -> None:
    from hpo.config.loader import DEMO_CONFIG, load_config
    from hpo.study.setup_record import SETUP_ATTR, setup_record

    demo = load_config(DEMO_CONFIG)
    ran_with_demo = {
        "search_space": space_record(demo.search_space),
        SETUP_ATTR: setup_record(demo),
    }
    retrain.check_demo_config(ran_with_demo, demo, "demo")  # the demo's own study: no refusal
    mine = {"sha256": "0" * 64, "path": "/data/mine.csv"}
    other_data = {**ran_with_demo[SETUP_ATTR], "data.train_file": mine}
    with pytest.raises(
        HPOError,
        match=r"^no --config given, and the demo config is not the one "
        r"study 'mine' ran with \(its data.train_file differs\); pass the study's "
        r"config: hpo retrain --study mine --config FILE$",
    ):
        retrain.check_demo_config({**ran_with_demo, SETUP_ATTR: other_data}, demo, "mine")
    with pytest.raises(HPOError, match=r"\(its search_space differs\)"):
        retrain.check_demo_config({"search_space": space_record(SPACE)}, demo, "mine")


def test_retrain_without_config_of_another_study_is_refused_before_the_data(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    # Issue 42: it prepared the demo's data, then refused; now one line at once.
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'mine.db'}"
    study = optuna.create_study(study_name="mine", storage=url, direction="maximize")
    study.set_user_attr("search_space", space_record(SPACE))  # the user's own config's
    out = str(tmp_path / "final")
    code = hpo_main(["retrain", "--study", "mine", "--storage", url, "--out", out])
    said = capsys.readouterr()
    assert code == 2, said.err
    assert said.err.splitlines() == [
        "hpo: error: no --config given, and the demo config is not the one study 'mine' ran "
        "with (its search_space differs); pass the study's config: hpo retrain --study mine "
        "--config FILE"
    ]
    assert not (tmp_path / "final").exists()
