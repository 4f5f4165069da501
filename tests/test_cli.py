"""The `hpo` command as a user runs it: help, bad input, and a real study on SQLite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import exit_code, run_hpo, run_study, tiny_config, write_config
from tests.study_checks import check_small_study, run_small_study


def test_help_explains_every_option(
    capsys: pytest.CaptureFixture[str], hpo_main: Callable[[list[str]], int]
) -> None:
    assert exit_code(hpo_main, ["--help"]) == 0
    assert "run" in capsys.readouterr().out
    assert exit_code(hpo_main, ["run", "--help"]) == 0
    help_text = capsys.readouterr().out
    for option in (
        "--study",
        "--config",
        "--storage",
        "--n-trials",
        "--timeout",
        "--trial-timeout",
        "--device",
        "--gpus",
        "--allow-changed-setup",
        "--debug",
    ):
        assert option in help_text
    assert "HPO_STORAGE" in help_text and "hpo.db" in help_text
    # What each timeout does: one ends the worker's run between trials, one stops a trial.
    text = " ".join(help_text.split())
    assert "this worker starts no new trial; the running trial finishes" in text
    assert "past it the trial checkpoints, stops and is pruned" in text
    assert "The change is recorded in the study and `hpo status` says the study mixes" in text


def test_study_on_sqlite(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    check_small_study(run_small_study(tmp_path, easy_data, url, "cli-sqlite", hpo_main, capsys))


def test_default_storage_is_hpo_db_in_the_working_directory(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    # hpo's main in this process, run from that folder; the trial trains in the worker.
    raw = tiny_config(
        *easy_data, study={"n_trials": 1, "trial_isolation": "none"}, training={"max_steps": 2}
    )
    config = write_config(tmp_path / "c.yaml", raw)
    monkeypatch.chdir(tmp_path)
    assert hpo_main(["run", "--study", "s", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert f"SQLite file {tmp_path / 'hpo.db'} (from default)" in err, err[-2000:]
    assert (tmp_path / "hpo.db").is_file()


def test_a_worker_with_another_search_space_is_refused(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Both workers run hpo's main in this process (the first trains in itself): a subprocess
    # took seconds to start.
    raw = tiny_config(
        *easy_data, study={"n_trials": 1, "trial_isolation": "none"}, training={"max_steps": 1}
    )
    url = f"sqlite:///{tmp_path / 's.db'}"
    a = write_config(tmp_path / "a.yaml", raw)
    assert hpo_main(["run", "--study", "s", "--config", str(a), "--storage", url]) == 0
    raw["search_space"]["learning_rate"]["high"] = 0.1
    b = write_config(tmp_path / "b.yaml", raw)
    assert hpo_main(["run", "--study", "s", "--config", str(b), "--storage", url]) == 2
    refused = capsys.readouterr().err
    assert "created with another search space (it differs in learning_rate)" in refused, refused


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"training": {"physical_batch_size": -1}}, "training.physical_batch_size: got -1"),
        ({"study": {"n_trails": 3}}, "did you mean 'n_trials'"),
        ({"data": {"text_column": "nope"}}, "no column 'nope'"),
        (
            {"model": {"tokenizer": "pkg://not_installed_pkg/model"}},
            "'not_installed_pkg' is not installed",
        ),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    change: dict,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    raw = tiny_config(*easy_data)
    for section, values in change.items():
        raw[section].update(values)
    config = write_config(tmp_path / "bad.yaml", raw)
    database = tmp_path / "must-not-exist.db"
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, as the CLI calls it
    storage = f"sqlite:///{database}"
    assert hpo_main(["run", "--study", "s", "--config", str(config), "--storage", storage]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not database.exists()


def test_bad_storage_url_is_one_masked_line(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, as the CLI calls it
    storage = "postgresql+psycopg2://me:hunter2@127.0.0.1:1/none"
    assert hpo_main(["run", "--study", "s", "--config", str(config), "--storage", storage]) == 2
    result = capsys.readouterr()
    assert "hunter2" not in result.err + result.out
    errors = [line for line in result.err.splitlines() if line.startswith("hpo: error")]
    assert len(errors) == 1 and "me:***@127.0.0.1:1/none" in errors[0]


def test_missing_config_file(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    monkeypatch.chdir(tmp_path)  # hpo's main in this process, as the CLI calls it
    assert hpo_main(["run", "--study", "s", "--config", "absent.yaml"]) == 2
    assert "absent.yaml: no such file" in capsys.readouterr().err


def test_a_failing_trial_never_stops_the_worker(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    # A compiler backend that does not exist: every trial raises at its first training step
    # (a setting the data refutes, such as class weights for the wrong number of labels, is
    # refused before the first trial instead).
    # HPO_FORK_SERVER: the default fork server, whatever the developer's environment says.
    broken = {"HPO_TEST_COMPILE_BACKEND": "no_such_backend", "HPO_FORK_SERVER": ""}
    raw = tiny_config(*easy_data, study={"n_trials": 2}, model={"compile": True})
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    result = run_study(config, url, tmp_path, env=broken)
    assert result.returncode == 0, result.stderr[-2000:]
    import optuna

    trials = optuna.load_study(study_name="s", storage=url).get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.FAIL] * 2
    reasons = [t.user_attrs["fail_reason"] for t in trials]
    assert all("no_such_backend" in reason for reason in reasons), reasons
    assert "no completed trial yet" in result.stdout
    # One line per failed trial with its reason; the traceback only with --debug.
    failed_lines = [line for line in result.stderr.splitlines() if "failed: " in line]
    assert len(failed_lines) == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "BackendCompilerFailed" in failed_lines[0]
    # One failing trial is enough to show its traceback.
    debug = run_hpo(
        "run",
        "--study",
        "d",
        "--config",
        str(config),
        "--storage",
        url,
        "--debug",
        "--n-trials",
        "1",
        cwd=tmp_path,
        env=broken,
    )
    assert debug.returncode == 0 and "Traceback" in debug.stderr
    # Its trial processes came from a copy of the worker: no second load of torch (5-6 s).
    assert "their fork server is a copy of this worker" in debug.stderr, debug.stderr[-3000:]


def test_debug_shows_hpo_s_debug_lines_but_not_the_libraries_own() -> None:
    """--debug once printed a line per autograd op per step: 1,845 lines for one tiny trial."""
    import logging

    from hpo.logs import setup_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging(logging.DEBUG)
        assert logging.getLogger("hpo").getEffectiveLevel() == logging.DEBUG
        for library in ("torch", "botocore"):
            assert logging.getLogger(library).getEffectiveLevel() == logging.INFO
        setup_logging(logging.INFO)
        assert logging.getLogger("torch").getEffectiveLevel() == logging.WARNING
    finally:
        root.handlers, root.level = saved[0], saved[1]
        for library in ("torch", "botocore", "boto3", "s3transfer"):
            logging.getLogger(library).setLevel(logging.NOTSET)


def test_run_without_config_says_it_uses_the_demo(tmp_path: Path) -> None:
    # Issue 42: from a user's own folder, `hpo run --study x` trained the demo's data silently.
    # Said once the input is known good (bad input stays one line): a run out of time at once.
    result = run_hpo("run", "--study", "x", "--timeout", "0.1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no --config given: using the demo config" in result.stderr
    assert "pass --config FILE" in result.stderr
    bad = run_hpo("run", "--study", "x", "--storage", "sqlite:////proc/hpo.db", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr[-2000:]


def test_the_command_line_asks_by_a_typed_request_that_check_inputs_only_checks(
    tmp_path: Path, easy_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hpo run`'s flags become a frozen RunRequest (hpo.run builds the same; retrain's flags a
    RetrainRequest around one). check_inputs takes it and only checks: the fork server of the
    trial processes starts where the work starts (worker_inputs), not while checking."""
    import dataclasses

    from hpo.cli.app import retrain_request, run_request
    from hpo.cli.parser import build_parser
    from hpo.commands import run
    from hpo.commands.requests import RetrainRequest, RunRequest
    from hpo.trial import fork_start, worker_copy

    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    url = f"sqlite:///{tmp_path / 'r.db'}"
    argv = ["run", "--study", "s", "--config", str(config), "--storage", url, "--n-trials", "3"]
    args = build_parser().parse_args(argv)
    args.argv, args.started, args.own_process = argv, 1.0, True
    request = run_request(args)
    assert request == RunRequest(
        "s", config, url, n_trials=3, own_process=True, argv=tuple(argv), started=1.0
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.study = "t"  # type: ignore[misc]
    assert request.option("n_trials") == "--n-trials"
    assert dataclasses.replace(request, from_python=True).option("n_trials") == "n_trials"

    started: list[tuple] = []
    monkeypatch.setattr(worker_copy, "use_nvml_for_cuda_checks", lambda: None)
    monkeypatch.setattr(fork_start, "prepare_fork_server", lambda user_function: 7)
    monkeypatch.setattr(fork_start, "start_fork_server", lambda *given: started.append(given))
    checked = run.check_inputs(request)
    assert (checked.study, checked.config.study.n_trials, checked.gpus) == ("s", 3, [])
    assert checked.copy_worker and checked.native_threads == 7 and started == []
    inputs = run.worker_inputs(checked)
    assert started == [(False, 7)]
    assert inputs.workers_per_gpu == 1 and len(inputs.data.train) > 0
    assert list(tmp_path.glob("*.db")) == []  # checked and prepared: nothing written yet

    argv = ["retrain", "--study", "s", "--top", "2", "--as-worker"]
    args = build_parser().parse_args(argv)
    args.argv, args.started, args.own_process = argv, 1.0, False
    assert retrain_request(args) == RetrainRequest(
        run=RunRequest("s", argv=tuple(argv), started=1.0), top=2, as_worker=True
    )
