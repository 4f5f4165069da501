"""What a careless or hostile user found, through the real CLI: study names that are paths,
workers that come back after their trial was taken over, a killed fork server, trial timeouts,
abbreviated options, and monitoring commands that must not write."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from hpo.cli.parser import build_parser
from hpo.study.kept_models import remove_stale_checkpoints
from hpo.trial.folders import STUDY_MARKER, prepare_trial_folder, study_folder_name
from hpo.trial.protocol import FORK_SERVER_NAME, process_stopped
from tests.conftest import (
    exit_code,
    hold_env,
    holding_metrics,
    read_csv,
    start_hpo,
    tiny_config,
    wait_until_held,
    wait_until_training,
    write_config,
    write_csv,
)

# -- study names are data, not paths ------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["..", ".", "/", "../../tmp/x", "x/../b", "b", "", "ünï cödé 'quoted' \"x\"", "a" * 512]
)
def test_every_study_folder_is_one_safe_component(name: str) -> None:
    folder = study_folder_name(name)
    assert "/" not in folder and folder not in (".", "..") and not folder.startswith(".")
    assert len(folder) <= 53
    assert folder == study_folder_name(name)  # stable: every worker and host agrees


def test_names_that_resolve_to_the_same_path_get_different_folders() -> None:
    assert study_folder_name("x/../b") != study_folder_name("b")
    assert study_folder_name("a b") != study_folder_name("a_b")  # same slug, other hash


def test_cleanup_removes_only_folders_hpo_made_for_this_study(tmp_path: Path) -> None:
    study = optuna.create_study(study_name="s")
    root = tmp_path / study_folder_name("s")
    ours = prepare_trial_folder(root, "s", "trial-0")
    (root / "trial-1").mkdir()  # a user's folder with hpo's naming, no marker
    (root / "trial-results").mkdir()
    foreign = prepare_trial_folder(tmp_path / "other", "other", "trial-2")
    (root / "trial-2").symlink_to(foreign)
    removed = remove_stale_checkpoints(study, root)
    assert removed == [ours] and not ours.exists()
    assert (root / "trial-1").is_dir() and (root / "trial-results").is_dir() and foreign.is_dir()
    # A folder whose study marker names another study is not touched at all.
    (root / STUDY_MARKER).write_text(json.dumps({"study": "someone else"}))
    again = prepare_trial_folder(tmp_path / "x", "s", "trial-3")
    assert remove_stale_checkpoints(study, root) == [] and again.is_dir()


def test_a_study_named_dot_dot_writes_inside_the_checkpoint_root_and_removes_nothing_else(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    user_folder = tmp_path / "trial-results"
    user_folder.mkdir()
    (user_folder / "keep.txt").write_text("mine")
    decoy = tmp_path / "hpo-checkpoints" / "trial-7"  # hpo's old naming, not hpo's folder
    decoy.mkdir(parents=True)
    # Four steps a trial: where a study's files go does not depend on how long it trains, nor
    # on which process trains it (hpo's main in this process, trials in the worker).
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 2, "pruner": {"type": "none"}, "trial_isolation": "none"},
        training={"max_steps": 4, "evals_per_epoch": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    monkeypatch.chdir(tmp_path)
    for name in ("..", "x/../b"):
        run = ["run", "--study", name, "--config", str(config)]
        assert hpo_main([*run, "--storage", f"sqlite:///{tmp_path / 's.db'}"]) == 0
        err = capsys.readouterr().err
        assert "Traceback" not in err, err[-3000:]
    assert (user_folder / "keep.txt").read_text() == "mine" and decoy.is_dir()
    assert not (tmp_path / "trial-0").exists() and not (tmp_path.parent / "trial-0").exists()
    for name in ("..", "x/../b"):
        study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 's.db'}")
        best_model = Path(study.best_trial.user_attrs["best_model"])
        root = (tmp_path / "hpo-checkpoints" / study_folder_name(name)).resolve()
        assert best_model.parent.parent == root and (best_model / "config.json").is_file()


def test_a_name_of_512_characters_with_quotes_and_slashes_trains_on_integer_labels(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    # The longest name the database holds (it once trained a trial, then failed on "File name
    # too long"), and labels that are numbers far apart (they once became 200M classes).
    name = ("é'\"/ ünïcødé " * 40)[:512]
    train, evaluation = (
        write_csv(
            tmp_path / f"{split}.csv",
            [
                {**row, "label": "200000000" if row["label"] == "pos" else "0"}
                for row in read_csv(path)
            ],
        )
        for split, path in (("train", easy_data[0]), ("eval", easy_data[1]))
    )
    raw = tiny_config(train, evaluation, study={"n_trials": 1}, training={"max_steps": 4})
    url = f"sqlite:///{tmp_path / 's.db'}"
    config = write_config(tmp_path / "c.yaml", raw)
    monkeypatch.chdir(tmp_path)  # hpo's main in this process; the trial in a trial process
    assert hpo_main(["run", "--study", name, "--config", str(config), "--storage", url]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    (trial,) = optuna.load_study(study_name=name, storage=url).get_trials()
    assert trial.state == TrialState.COMPLETE
    best_model = Path(trial.user_attrs["best_model"])
    assert best_model.is_relative_to((tmp_path / "hpo-checkpoints").resolve())
    model_config = json.loads((best_model / "config.json").read_text())
    assert model_config["id2label"] == {"0": "0", "1": "200000000"}  # two classes, mapped


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("", "the study name is empty"),
        ("   ", "the study name is empty"),
        ("x" * 513, "has 513 characters; Optuna's database holds at most 512"),
        ("a\nb", "control character"),
    ],
    ids=["empty", "blank", "513 characters", "newline"],
)
def test_an_unusable_study_name_is_refused_before_anything_is_written(
    tmp_path: Path,
    name: str,
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, as the CLI calls it
    for command in (["run", "--config", "nope.yaml"], ["status"], ["best"]):
        database = tmp_path / "s.db"
        storage = ["--storage", f"sqlite:///{database}"]
        assert exit_code(hpo_main, [*command, "--study", name, *storage]) == 2
        err = capsys.readouterr().err
        # Looking needs no rule but a name: a plain Optuna study may have any (see below).
        looks = command[0] != "run" and name != ""
        assert (expected in err) != looks and "Traceback" not in err, err[-2000:]
        assert not database.exists() and not (tmp_path / "hpo-checkpoints").exists()


def test_studies_that_plain_optuna_named_oddly_can_be_looked_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    main = hpo_main
    url = f"sqlite:///{tmp_path / 'names.db'}"
    names = ["tab\there", "L" * 600, "   "]
    for name in names:
        study = optuna.create_study(study_name=name, storage=url, direction="maximize")
        study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    for name in names:
        assert main(["status", "--study", name, "--storage", url]) == 0
        assert main(["best", "--study", name, "--storage", url]) == 0
        assert main(["report", "--study", name, "--storage", url, "--format", "md"]) == 0
        assert "best trial #0" in capsys.readouterr().out


# -- workers ---------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _fork_server(worker_pid: int) -> int:
    for child in _children(worker_pid):
        # Started afresh by multiprocessing, or a copy of the worker (hpo/trial/worker_copy.py)
        if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
            return child
        if Path(f"/proc/{child}/comm").read_text().strip() == FORK_SERVER_NAME:
            return child
    raise AssertionError("no fork server among the worker's children")


def test_a_killed_fork_server_fails_its_trial_with_that_reason_and_the_worker_goes_on(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    url = f"sqlite:///{tmp_path / 'fs.db'}"
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 2, "pruner": {"type": "none"}, "checkpoint_interval": 0},
        # The fork server is killed in the second of 4 evaluations (a checkpoint each), which
        # holds until the trial process is told (a tiny trial may otherwise finish before).
        training={"epochs": 2, "evals_per_epoch": 2},
    )
    raw["metrics"] = holding_metrics(tmp_path)
    config = write_config(tmp_path / "c.yaml", raw)
    held = tmp_path / "held"
    worker = start_hpo(
        "run",
        "--study",
        "fs",
        "--config",
        str(config),
        "--storage",
        url,
        cwd=tmp_path,
        env=hold_env(held, at=2),
    )
    wait_until_training(url, "fs", [worker], evaluations=1)
    wait_until_held(held, [worker])
    os.kill(_fork_server(worker.pid), signal.SIGKILL)
    _, stderr = worker.communicate(timeout=600)
    assert worker.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    trials = optuna.load_study(study_name="fs", storage=url).get_trials()
    killed = trials[0]
    assert killed.state == TrialState.FAIL
    assert "fork server" in killed.user_attrs["fail_reason"], killed.user_attrs["fail_reason"]
    assert "the worker got SIGTERM" not in killed.user_attrs["fail_reason"]
    retry = next(t for t in trials if t.system_attrs.get("failed_trial") == 0)
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["resumed_at_step"] > 0
    # The budget of 2 holds: the failed trial's retry takes its place, and a new fork server
    # ran the rest.
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2


def test_a_worker_that_wakes_after_its_trial_was_taken_over_drops_it_and_goes_on(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    url = f"sqlite:///{tmp_path / 'wake.db'}"
    raw = tiny_config(
        *easy_data,
        study={
            "n_trials": 2,
            "pruner": {"type": "none"},
            "heartbeat_interval": 1,
            "grace_period": 3,
            "checkpoint_interval": 0,
        },
        # 12 evaluations (a checkpoint each) over 3 epochs: the sleeper stops in the second,
        # held there until the retry is done (a tiny trial may otherwise finish before the
        # SIGSTOP); the retry and the next trial train 3 epochs at most (they trained 12).
        training={"epochs": 3, "evals_per_epoch": 4},
    )
    raw["metrics"] = holding_metrics(tmp_path)  # held in the sleeper only: HPO_TEST_HELD
    config = write_config(tmp_path / "c.yaml", raw)
    args = ("run", "--study", "wake", "--config", str(config), "--storage", url)
    held, retried = tmp_path / "held", tmp_path / "retried"
    sleeper = start_hpo(*args, cwd=tmp_path, env=hold_env(held, at=2, release=retried))
    try:
        wait_until_training(url, "wake", [sleeper], evaluations=1)
        wait_until_held(held, [sleeper])
        sleeper.send_signal(signal.SIGSTOP)
        time.sleep(5)  # past the grace period
        # The other worker is hpo's main in this process (the sleeper is the one under test).
        monkeypatch.chdir(tmp_path)
        assert hpo_main([*args, "--n-trials", "1"]) == 0  # the retry, and no more
        taken = capsys.readouterr().err
        assert "Traceback" not in taken, taken[-3000:]
    finally:
        retried.touch()  # the sleeper's trial trains on once it wakes
        sleeper.send_signal(signal.SIGCONT)
    _, stderr = sleeper.communicate(timeout=120)
    assert sleeper.returncode == 0, stderr[-3000:]
    assert "was taken over by another worker" in stderr and "Traceback" not in stderr
    stale, retry, following = optuna.load_study(study_name="wake", storage=url).get_trials()
    assert stale.state == TrialState.FAIL
    assert stale.user_attrs["fail_reason"].startswith("stale: no heartbeat from its worker")
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["resumed_at_step"] > 0
    # The woken worker dropped its result and went on with the study's next trial.
    assert following.state == TrialState.COMPLETE
    assert following.user_attrs["worker"] == stale.user_attrs["worker"]


def test_a_paused_worker_pauses_its_trial_process_and_continues_it_on_waking(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    # Another worker may take a paused worker's trial over and resume it from its checkpoint
    # folder: the paused worker's trial process must not write there meanwhile.
    url = f"sqlite:///{tmp_path / 'pause.db'}"
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 1, "pruner": {"type": "none"}, "checkpoint_interval": 0},
        # Paused in the first of 16 evaluations, held there until the trial process is paused
        # (a tiny trial may otherwise finish first): 15 are left to train once it continues.
        training={"epochs": 4, "evals_per_epoch": 4},
    )
    raw["metrics"] = holding_metrics(tmp_path)
    config = write_config(tmp_path / "c.yaml", raw)
    held, paused = tmp_path / "held", tmp_path / "paused"
    worker = start_hpo(
        "run",
        "--study",
        "p",
        "--config",
        str(config),
        "--storage",
        url,
        cwd=tmp_path,
        env=hold_env(held, release=paused),
    )
    try:
        wait_until_training(url, "p", [worker])
        wait_until_held(held, [worker])
        (trial_process,) = _children(_fork_server(worker.pid))
        worker.send_signal(signal.SIGSTOP)
        _wait_for_state(trial_process, stopped=True)
        written = _checkpoint_files(tmp_path)
        paused.touch()  # released: a trial process that ran on would write checkpoints now
        time.sleep(2)
        assert process_stopped(trial_process)
        assert _checkpoint_files(tmp_path) == written
    finally:
        worker.send_signal(signal.SIGCONT)
    _wait_for_state(trial_process, stopped=False)
    _, stderr = worker.communicate(timeout=120)
    assert worker.returncode == 0, stderr[-3000:]
    assert "is stopped (SIGSTOP?); pausing with it" in stderr
    (trial,) = optuna.load_study(study_name="p", storage=url).get_trials()
    assert trial.state == TrialState.COMPLETE


def _wait_for_state(pid: int, stopped: bool) -> None:
    deadline = time.monotonic() + 20
    while process_stopped(pid) != stopped:
        assert time.monotonic() < deadline, f"process {pid} never {'stopped' if stopped else 'ran'}"
        time.sleep(0.1)


def _checkpoint_files(root: Path) -> dict[str, float]:
    folder = root / "hpo-checkpoints"
    return {str(p): p.stat().st_mtime for p in folder.rglob("*") if p.is_file()}


def test_a_trial_past_its_timeout_is_pruned_with_that_reason_and_the_worker_goes_on(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    url = f"sqlite:///{tmp_path / 't.db'}"
    raw = tiny_config(
        *easy_data,
        # Long enough that a trial reaches its first evaluation (8 steps, under a second here)
        # on a loaded CI machine; the timeout counts training only, not the trial's startup.
        study={"n_trials": 2, "pruner": {"type": "none"}, "trial_timeout": 5},
        training={"epochs": 500, "evals_per_epoch": 4},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    started = time.monotonic()
    # hpo's main in this process; its trials in trial processes, which the timeout stops.
    monkeypatch.chdir(tmp_path)
    assert hpo_main(["run", "--study", "t", "--config", str(config), "--storage", url]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    assert time.monotonic() - started < 150
    trials = optuna.load_study(study_name="t", storage=url).get_trials()
    assert [t.state for t in trials] == [TrialState.PRUNED, TrialState.PRUNED]
    for trial in trials:
        assert trial.user_attrs["prune_reason"].startswith("timeout: stopped after"), trial
        # Stopped the way a SIGTERM stops it: checkpointed on the way out.
        assert trial.user_attrs["checkpoint_s"] > 0 and "checkpoint_error" not in trial.user_attrs
    # What a trial reached counts for the sampler (a loaded machine may start one slowly).
    assert any(trial.intermediate_values for trial in trials)


def test_the_trial_timeout_counts_training_not_the_startup_before_it(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    hpo_main: Callable[[list[str]], int],
) -> None:
    """--trial-timeout is "seconds one trial may train": a batch search (or a model load) that
    takes longer than it does not time the trial out before its first step."""
    from hpo.trial import training as trial_training

    search = trial_training._resolve_physical_batch

    def slow_search(*args: object, **kwargs: object) -> object:
        time.sleep(4)  # past the timeout, before any training
        return search(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(trial_training, "_resolve_physical_batch", slow_search)
    raw = tiny_config(
        *easy_data,
        study={"n_trials": 1, "trial_isolation": "none"},
        training={"max_steps": 2, "evals_per_epoch": 1},
    )
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 't.db'}"
    monkeypatch.chdir(tmp_path)
    args = ["run", "--study", "t", "--config", str(config), "--storage", url]
    assert hpo_main([*args, "--trial-timeout", "3"]) == 0
    [trial] = optuna.load_study(study_name="t", storage=url).get_trials()
    assert trial.state == TrialState.COMPLETE, trial.user_attrs.get("prune_reason")


# -- the command line ------------------------------------------------------------------------------


def test_a_study_name_that_begins_with_a_dash_gets_the_spelling_that_works(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["status", "--study", "-x"])
    assert exited.value.code == 2
    assert "a value that begins with '-' is written --study=VALUE" in capsys.readouterr().err
    assert build_parser().parse_args(["status", "--study=-x"]).study == "-x"


def test_abbreviated_options_are_refused_not_guessed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert exit_code(hpo_main, ["run", "--study", "s", "--gpu", "0,1"]) == 2
    assert "unrecognized arguments: --gpu" in capsys.readouterr().err
    assert not (tmp_path / "hpo.db").exists()


def test_monitoring_commands_create_no_database_and_write_nothing(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, as the CLI calls it
    typo = tmp_path / "typo.db"
    for command in (["studies"], ["status", "--study", "s"], ["best", "--study", "s"]):
        assert hpo_main([*command, "--storage", f"sqlite:///{typo}"]) == 2
        err = capsys.readouterr().err
        assert "no such file" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no database, no lock file
    folder = tmp_path / "studies"
    folder.mkdir()
    database = folder / "s.db"
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{database}")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    for command in (["studies"], ["status", "--study", "s"], ["best", "--study", "s"]):
        assert hpo_main([*command, "--storage", f"sqlite:///{database}"]) == 0, capsys.readouterr()
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_hpo_never_adopts_a_folder_it_did_not_make(tmp_path: Path) -> None:
    root = tmp_path / study_folder_name("P")
    mine = prepare_trial_folder(root, "P", "trial-0")
    users = root / "trial-2"
    (users / "best-model").mkdir(parents=True)
    (users / "best-model" / "weights").write_text("the user's")
    victim = tmp_path / "victim"
    victim.mkdir()
    (root / "trial-1").symlink_to(victim)
    for folder in ("trial-1", "trial-2"):
        with pytest.raises(FileExistsError, match="hpo did not make it"):
            prepare_trial_folder(root, "P", folder)
    assert prepare_trial_folder(root, "P", "trial-0") == mine  # a retry reuses its own folder
    with pytest.raises(FileExistsError):
        prepare_trial_folder(root, "another study", "trial-0")  # same folder, other marker
    study = optuna.create_study(study_name="P")
    remove_stale_checkpoints(study, root)
    assert (users / "best-model" / "weights").read_text() == "the user's"
    assert list(victim.iterdir()) == [] and not (users / ".hpo-trial").exists()


def test_a_reader_that_stops_reading_is_no_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    database = tmp_path / "s.db"
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{database}")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=30)
    command = (
        f"{sys.executable} -m hpo status --study s --json --storage sqlite:///{database}"
        " | head -c 10"
    )
    result = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--timeout", "inf"], "--timeout: got inf; must be a finite number"),
        (["--trial-timeout", "nan"], "--trial-timeout: got nan; must be a finite number"),
        (["--storage", ""], "--storage is empty"),
        (["--config", "/dev/null"], "/dev/null: not a regular file"),
    ],
    ids=["timeout inf", "trial-timeout nan", "empty storage", "config not a file"],
)
def test_odd_command_line_values_are_one_line(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    args: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, as the CLI calls it
    assert exit_code(hpo_main, ["run", "--study", "s", "--config", str(config), *args]) == 2
    err = capsys.readouterr().err
    assert expected in err, err[-2000:]
    assert "Traceback" not in err and not (tmp_path / "hpo.db").exists()


def test_a_trial_in_a_kept_trial_process_trains_exactly_as_in_a_new_one(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    # Nothing of one trial leaks into the next one in the same trial process: RNG states, the
    # model, the optimizer. The same configuration twice gives the same curve.
    url = f"sqlite:///{tmp_path / 'same.db'}"
    raw = tiny_config(
        *easy_data, study={"n_trials": 3, "pruner": {"type": "none"}, "checkpoints": False}
    )
    study = optuna.create_study(study_name="same", storage=url, direction="maximize")
    for learning_rate in (2e-3, 4e-3, 2e-3):
        study.enqueue_trial({"effective_batch_size": 8, "learning_rate": learning_rate})
    config = write_config(tmp_path / "c.yaml", raw)
    # hpo's main in this process: its trials run in trial processes forked from this process's
    # fork server, kept from one trial to the next as a worker's are.
    monkeypatch.chdir(tmp_path)
    assert hpo_main(["run", "--study", "same", "--config", str(config), "--storage", url]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    first, other, again = study.get_trials()
    assert all(t.state == TrialState.COMPLETE for t in (first, other, again))
    assert again.params == first.params and again.user_attrs["curve"] == first.user_attrs["curve"]
    assert other.user_attrs["curve"] != first.user_attrs["curve"]
    for trial in (first, other, again):  # the clocks bench/trial_overhead.py reads
        duration = (trial.datetime_complete - trial.datetime_start).total_seconds()
        attrs = trial.user_attrs
        assert 0 < attrs["train_s"] and 0 < attrs["eval_s"] and 0 < attrs["startup_s"]
        # startup_s ends after the first step, which train_s counts too.
        assert attrs["startup_s"] < duration and attrs["train_s"] + attrs["eval_s"] < duration
        parts = attrs["startup_parts"]  # where startup_s went, in order
        assert list(parts) == ["dispatch_s", "batch_s", "setup_s", "first_step_s"]
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) == pytest.approx(attrs["startup_s"], abs=0.01)


def test_monitoring_commands_read_a_database_in_a_read_only_folder(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    import subprocess

    folder = tmp_path / "read-only"
    folder.mkdir()
    database = folder / "s.db"
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{database}")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    # Root writes through permissions: as root the folder is made immutable instead.
    as_root = os.geteuid() == 0
    if as_root:
        made = subprocess.run(["chattr", "+i", str(database), str(folder)], capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"chattr +i does not work here: {made.stderr!r}")
    else:
        database.chmod(0o444)
        folder.chmod(0o555)
    try:
        monkeypatch.chdir(folder)  # hpo's main in this process, run from that folder
        for command in (["studies"], ["status", "--study", "s"], ["best", "--study", "s"]):
            code = hpo_main([*command, "--storage", f"sqlite:///{database}"])
            err = capsys.readouterr().err
            assert code == 0 and "Traceback" not in err, err[-3000:]
        assert sorted(p.name for p in folder.iterdir()) == ["s.db"]
    finally:
        if as_root:
            subprocess.run(["chattr", "-i", str(database), str(folder)], check=True)
        folder.chmod(0o755)
