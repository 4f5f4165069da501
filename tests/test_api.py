"""The Python API: hpo.run and hpo.open_study do what `hpo run`, `hpo best` and `hpo report` do,
fail with hpo's own errors and the CLI's lines, and `import hpo` stays light."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest

import hpo
from tests.conftest import REPO, tiny_config, write_config


def test_import_hpo_loads_no_heavy_library_until_a_name_is_used() -> None:
    code = (
        "import sys, hpo\n"
        "heavy = ('torch', 'optuna', 'transformers', 'hpo.api')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "hpo.ConfigError, hpo.HPOError, hpo.DataError, hpo.__version__\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "print(hpo.run.__module__, 'run' in dir(hpo))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "[]", "hpo.api True"]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        hpo.nope  # noqa: B018


def test_errors_are_hpo_s_own_classes() -> None:
    from hpo import errors

    assert hpo.ConfigError is errors.ConfigError and issubclass(hpo.ConfigError, hpo.HPOError)
    assert hpo.DataError is errors.DataError and issubclass(hpo.DataError, hpo.TrainerError)


def test_run_from_a_dict_and_a_file_then_read_download_and_report(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    """Two workers of one study, one from a dict and one from a file, on the default storage
    (./hpo.db); then the study read, its best model downloaded and its report written."""
    monkeypatch.chdir(tmp_path)
    store = f"file://{tmp_path / 'store'}"
    # Four optimizer steps and one evaluation a trial: what is checked is what the API returns
    # and reads back, not what the model learned.
    training = {"epochs": 1, "max_steps": 4, "evals_per_epoch": 1}
    raw = tiny_config(*easy_data, study={"n_trials": 1, "artifact_store": store}, training=training)
    raw["data"]["train_file"] = easy_data[0]  # a Path, as Python code writes it
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    first = hpo.run(raw, study="api")
    assert isinstance(raw["data"]["train_file"], Path)  # the caller's dict is left as it was
    assert (first.study, first.trials_run, first.trials) == ("api", 1, {"complete": 1})
    assert first.stopped_by is None and first.pareto_front == ()
    assert first.best is not None and set(first.best.metrics) == {"accuracy"}
    assert first.best.value == first.best.metrics["accuracy"]
    assert set(first.best.params) == {"effective_batch_size", "learning_rate"}
    assert first.best.physical_batch_size == 4 and first.best.grad_accum_steps == 2
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers

    # A second worker, from a file, joins the study: the budget counts across both.
    config = write_config(
        tmp_path / "c.yaml", {**raw, "data": {**raw["data"], "train_file": str(easy_data[0])}}
    )
    second = hpo.run(config, study="api", n_trials=2)
    assert second.trials_run == 1 and second.trials == {"complete": 2}
    assert (tmp_path / "hpo.db").is_file()

    with hpo.open_study("api") as study:
        trials = study.trials()
        assert [t.number for t in trials] == [0, 1]
        assert all(t.state == "complete" and t.model for t in trials)
        best = study.best()
        assert best == max(trials, key=lambda t: t.metrics["accuracy"])
        assert study.trials(["pruned"]) == [] and study.metric_names == ("accuracy",)
        model = study.download(tmp_path / "best-model")
        assert model == tmp_path / "best-model" and (model / "config.json").is_file()
        page = study.report(tmp_path)
        assert page.name.startswith("hpo-report-api") and page.suffix == ".html"
        assert "api" in page.read_text(encoding="utf-8")
        assert "# " in study.report(tmp_path / "r.md").read_text(encoding="utf-8")
        assert study.status()["trials"] == {"complete": 2}
        with pytest.raises(hpo.HPOError, match="exists and is not an empty folder"):
            study.download(tmp_path / "best-model")

    # The CLI answers the same.
    capsys.readouterr()
    assert hpo_main(["best", "--study", "api", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["number"], shown["value"], shown["params"]) == (
        best.number,
        best.value,
        best.params,
    )


def test_a_bad_config_is_the_cli_s_config_error_and_writes_nothing(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    monkeypatch.chdir(tmp_path)
    raw = tiny_config(*easy_data, training={"epochs": 0, "lerning_rate": 1e-3})
    path = write_config(tmp_path / "bad.yaml", raw)
    assert hpo_main(["run", "--study", "s", "--config", str(path)]) == 2
    printed = capsys.readouterr().err.split("hpo: error: ", 1)[1].rstrip("\n")
    with pytest.raises(hpo.ConfigError) as from_file:
        hpo.run(path, study="s")
    assert str(from_file.value) == printed and "2 problems" in printed
    with pytest.raises(hpo.ConfigError) as from_dict:
        hpo.run(raw, study="s")
    assert from_dict.value.problems == from_file.value.problems
    assert "unknown key (did you mean 'learning_rate'?)" in str(from_dict.value)
    raw["data"]["eval_file"] = "eval.csv"  # a dict's relative paths: from the working folder
    with pytest.raises(
        hpo.ConfigError, match=f"looked for {tmp_path / 'eval.csv'}.*relative to the working folder"
    ):
        hpo.run(raw, study="s")
    assert not (tmp_path / "hpo.db").exists()


@pytest.mark.parametrize(
    ("config", "options", "message"),
    [
        ([1, 2], {}, "the config must be a file path or a mapping of sections, got list"),
        ({}, {"n_trials": 0}, "n_trials: got 0; must be a positive integer"),
        ({}, {"n_trials": "3"}, "n_trials: got '3'; must be a positive integer"),
        ({}, {"timeout": float("inf")}, "timeout: got inf; must be a finite number > 0 seconds"),
        ({}, {"storage": 5}, "storage: got 5; give it as text (a string) or leave it out"),
    ],
)
def test_bad_arguments_are_config_errors_named_as_the_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: object, options: dict, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(hpo.ConfigError) as error:
        hpo.run(config, study="s", **options)  # type: ignore[arg-type]
    assert message in str(error.value)
    assert not (tmp_path / "hpo.db").exists()


def test_a_bad_study_name_or_device_is_named_as_run_s_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    demo = REPO / "configs" / "demo.yaml"
    with pytest.raises(hpo.HPOError, match='^study: the study name is empty; .* study="demo"$'):
        hpo.run(demo, study=" ")
    with pytest.raises(hpo.ConfigError) as error:
        hpo.run(demo, study="s", device="tpu")
    assert str(error.value) == "hpo.run: device: got 'tpu'; must be auto, cpu, cuda or cuda:N"
    assert not (tmp_path / "hpo.db").exists()


def test_open_study_on_a_missing_study_or_database_is_one_clear_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    optuna.create_study(study_name="other", storage=url)
    with pytest.raises(hpo.HPOError) as missing:
        hpo.open_study("nope", url)
    assert str(missing.value) == f"no study 'nope' in {url}; see `hpo studies`"
    with pytest.raises(hpo.StorageError):
        hpo.open_study("nope", f"sqlite:///{tmp_path / 'typo.db'}")
    assert not (tmp_path / "typo.db").exists()  # looking creates no database
    with pytest.raises(hpo.StorageError) as refused:
        hpo.open_study("s", "postgresql+psycopg2://me:hunter2@127.0.0.1:1/none")
    assert "hunter2" not in str(refused.value) and "***" in str(refused.value)


def test_a_study_s_trials_states_and_best_read_as_plain_values(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    study = optuna.create_study(study_name="known", storage=url, direction="maximize")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    pruned = study.ask()
    pruned.set_user_attr("prune_reason", "oom: out of memory at physical batch 1")
    study.tell(pruned, state=optuna.trial.TrialState.PRUNED)
    both = optuna.create_study(study_name="two", storage=url, directions=["maximize"] * 2)
    both.optimize(lambda t: (t.suggest_float("a", 0, 1), t.suggest_float("b", 0, 1)), 3)

    with hpo.open_study("known", url) as known:
        (cut,) = known.trials(["pruned"])
        assert (cut.number, cut.state, cut.values, cut.value) == (2, "pruned", None, None)
        assert cut.reason == "oom: out of memory at physical batch 1" and cut.model is None
        best = known.best()
        assert best.value == study.best_value and best.metrics == {"value": study.best_value}
        assert best.params == study.best_params and known.directions == ("maximize",)
        with pytest.raises(dataclasses.FrozenInstanceError):
            best.number = 5  # type: ignore[misc]
        with pytest.raises(hpo.ConfigError, match="states: got 'done'"):
            known.trials(["done"])
        with pytest.raises(hpo.HPOError, match="has no artifact store"):
            known.download(tmp_path / "m")
        assert not (tmp_path / "m").exists()
    with hpo.open_study("two", url) as two:
        with pytest.raises(hpo.HPOError, match="2 objectives, so no single best trial"):
            two.best()
        front = two.pareto_front()
        assert front and all(set(t.metrics) == {"objective_0", "objective_1"} for t in front)


def test_a_run_at_the_top_of_a_script_is_refused_in_the_trial_process_that_imports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """multiprocessing imports the caller's script in each trial process as `__mp_main__`: an
    unguarded hpo.run() there is one line that says how to guard it, and starts nothing."""
    import types

    script = types.ModuleType("__mp_main__")
    script.__file__ = str(tmp_path / "tune.py")
    monkeypatch.setitem(sys.modules, "__mp_main__", script)  # as runpy.run_path sets it
    monkeypatch.chdir(tmp_path)
    with pytest.raises(hpo.HPOError, match=r"imported .*tune.py: put the call under `if __name"):
        hpo.run({}, study="s")
    # A stale alias (a notebook's kernel replaced __main__ after multiprocessing loaded) is not
    # a trial process: the run goes on to check its config.
    monkeypatch.setitem(sys.modules, "__mp_main__", types.ModuleType("__main__"))
    with pytest.raises(hpo.ConfigError):
        hpo.run({}, study="s")
    assert not (tmp_path / "hpo.db").exists()


def test_a_storage_url_s_password_is_in_no_error_of_run(
    tmp_path: Path, easy_data: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = "postgresql+psycopg2://me:hunter2@127.0.0.1:1/none"
    with pytest.raises(hpo.StorageError) as refused:
        hpo.run(tiny_config(*easy_data), study="s", storage=url)
    assert "hunter2" not in str(refused.value) and "me:***@127.0.0.1:1/none" in str(refused.value)
    raw = tiny_config(*easy_data, study={"storage": [url]})  # shown back in the message
    with pytest.raises(hpo.ConfigError) as bad:
        hpo.run(raw, study="s")
    assert "hunter2" not in str(bad.value) and "study.storage" in str(bad.value)
    assert "me:***@127.0.0.1:1/none" in str(bad.value)


def test_a_sigterm_stops_the_running_trial_and_run_returns_saying_so(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    """A scheduler's SIGTERM to a script in hpo.run: the trial is handed back (queued again for
    the next worker), and run() returns with `stopped_by` for the script to go on."""
    from tests.conftest import wait_until_training

    script = tmp_path / "tune.py"
    script.write_text(
        "import json, sys\nimport hpo\n\n"
        "if __name__ == '__main__':\n"
        "    result = hpo.run(sys.argv[1], study='stop', storage=sys.argv[2])\n"
        "    print(json.dumps([result.stopped_by, result.trials_run, result.trials]))\n",
        encoding="utf-8",
    )
    endless = tiny_config(
        *easy_data, study={"pruner": {"type": "none"}, "stop_timeout": 5}, training={"epochs": 1000}
    )
    config = write_config(tmp_path / "endless.yaml", endless)
    url = f"sqlite:///{tmp_path / 'stop.db'}"
    command = [sys.executable, str(script), str(config), url]
    worker = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_until_training(url, "stop", [worker])
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=90)
    finally:
        worker.kill()
    assert worker.returncode == 0, err[-3000:]
    # No trial finished here: the interrupted one is recorded and queued again.
    assert json.loads(out.splitlines()[-1]) == ["SIGTERM", 0, {"fail": 1, "waiting": 1}]
    assert "Traceback" not in err, err[-3000:]


def test_api_messages_name_its_arguments_not_the_cli_s_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An API user never typed --storage, --download, --merge or --out: each message names the
    argument of the call they made."""
    from types import SimpleNamespace

    from hpo.services import API_DOWNLOAD, download_best

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HPO_STORAGE", raising=False)
    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    optuna.create_study(study_name="known", storage=url).optimize(lambda t: 1.0, n_trials=1)
    errors = []
    for call in (
        lambda: hpo.open_study("", url),
        lambda: hpo.open_study("known", f"sqlite:///{tmp_path / 'typo.db'}"),
        lambda: hpo.run(REPO / "configs" / "demo.yaml", study="s", storage=" "),
        lambda: hpo.open_study("known", url).report(tmp_path / "no" / "r.html"),
    ):
        with pytest.raises((hpo.HPOError, hpo.StorageError)) as refused:
            call()
        errors.append(str(refused.value))
    assert errors[0].startswith("name: the study name is empty")
    assert "check storage or $HPO_STORAGE" in errors[1]
    assert errors[2].startswith("storage is empty; give a database URL")
    assert errors[3].startswith(f"report path {tmp_path / 'no' / 'r.html'}: no such folder")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    study = SimpleNamespace(study_name="known", user_attrs={})
    best = [{"number": 0, "user_attrs": {}}]
    with pytest.raises(hpo.HPOError) as refused:
        download_best(study, best, object(), str(tmp_path / "full"), False, API_DOWNLOAD)  # type: ignore[arg-type]
    errors.append(str(refused.value))
    with pytest.raises(hpo.HPOError) as refused:
        download_best(study, best, object(), " ", False, API_DOWNLOAD)  # type: ignore[arg-type]
    errors.append(str(refused.value))
    assert errors[4].startswith(f"download folder {tmp_path / 'full'}: exists and is not")
    assert errors[5].endswith('e.g. download("best-model")')
    assert not any("--" in error for error in errors), errors
    assert not (tmp_path / "typo.db").exists() and not (tmp_path / "hpo.db.lock").exists()


def test_run_s_gpu_arguments_are_checked_and_keep_the_storage_off_the_command_line(
    tmp_path: Path,
) -> None:
    from hpo.api import _gpu_options, _worker_command
    from hpo.commands.requests import RunRequest

    path = tmp_path / "c.yaml"
    assert _gpu_options([0, 1], None, path) == ("0,1", None)
    assert _gpu_options("auto", "AUTO", str(path)) == ("auto", "auto")
    with pytest.raises(hpo.ConfigError) as refused:
        _gpu_options(1.5, 0, {"training": {}})
    assert str(refused.value).splitlines() == [
        "hpo.run: 3 problems; fix them and run again:",
        "  - gpus: got 1.5; give 'auto', 'none', or GPU ids like [0, 1] or '0,1'",
        "  - workers_per_gpu: got 0; give 1 to 16 workers per GPU, or 'auto'",
        "  - config: with gpus or workers_per_gpu, give the config as a file path: each worker "
        "is a process of its own that reads it",
    ]
    secret = "postgresql+psycopg2://me:hunter2@db/hpo"
    request = RunRequest(
        "s",
        path,
        storage=secret,
        n_trials=4,
        trial_timeout=30.0,
        artifact_store="file:///shared",
        gpus="0,1",
    )
    argv, env = _worker_command(request)
    assert argv == [
        "run",
        "--config",
        str(path),
        "--study",
        "s",
        "--n-trials",
        "4",
        "--trial-timeout",
        "30.0",
    ]
    assert env == {"HPO_STORAGE": secret, "HPO_ARTIFACT_STORE": "file:///shared"}


@pytest.mark.slow
def test_run_starts_a_worker_per_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hpo.run(gpus=...) as `hpo run --gpus`: one worker process per (simulated) GPU, sharing
    the study's budget; the storage reaches them through their environment."""
    monkeypatch.setenv("HPO_TEST_FAKE_GPUS", "2")
    monkeypatch.delenv("HPO_STORAGE", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train_fn.py").write_text("def train(ctx):\n    return ctx.params['x'] ** 2\n")
    raw = {
        "training": {"entrypoint": "train_fn:train", "device": "cpu"},
        "study": {"metric": "loss", "direction": "minimize", "trial_isolation": "none"},
        "search_space": {"x": {"type": "float", "low": -1.0, "high": 1.0}},
    }
    config = write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 'g.db'}"
    with pytest.raises(hpo.ConfigError, match="device: cannot be combined with gpus, which"):
        hpo.run(config, study="g", storage=url, gpus="auto", device="cpu")
    with pytest.raises(hpo.ConfigError, match=r"gpus: GPU 3 is not visible on this host \("):
        hpo.run(config, study="g", storage=url, gpus=[3])
    result = hpo.run(config, study="g", storage=url, n_trials=4, gpus="auto")
    assert result.trials == {"complete": 4} and result.trials_run is None
    assert result.best is not None and result.best.value is not None
    trials = optuna.load_study(study_name="g", storage=url).get_trials()
    assert {t.user_attrs["gpu"] for t in trials} <= {"gpu0", "gpu1"}
    assert len({t.user_attrs["worker"] for t in trials}) >= 1


def test_run_from_stdin_or_an_interactive_session_says_what_a_trial_process_cannot_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script read from stdin: every trial process failed to start (multiprocessing runs the
    main script again, and `<stdin>` is no file); a notebook's own function named
    `__main__:train`: every trial failed with "has no train". Now one line before any trial
    for the script, and the notebook's function sent to the trial processes by value."""
    import types

    from hpo.config.loader import parse_config
    from hpo.plugins.loading import check_trial_processes_import

    raw = {
        "training": {"entrypoint": "__main__:train", "device": "cpu"},
        "study": {"metric": "m", "direction": "minimize"},
        "search_space": {"x": {"type": "float", "low": -1.0, "high": 1.0}},
    }
    config = parse_config(raw, base_dir=tmp_path)
    stdin = types.ModuleType("__main__")
    stdin.__file__ = "<stdin>"
    monkeypatch.setitem(sys.modules, "__main__", stdin)
    with pytest.raises(hpo.ConfigError, match="and <stdin> is no file .a script read from stdin"):
        check_trial_processes_import(config)
    notebook = types.ModuleType("__main__")  # a notebook's: its function is sent by value
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    with pytest.raises(hpo.ConfigError, match="__main__:train: module __main__ .* has no train"):
        check_trial_processes_import(config)

    def train(ctx: object) -> float:
        return 1.0

    notebook.train = train  # type: ignore[attr-defined]
    check_trial_processes_import(config)
    from hpo.plugins import by_value

    assert "__main__:train" in by_value.packed()
    by_value.forget()
    config.study.trial_isolation = "none"  # trained in the worker, which has the function
    check_trial_processes_import(config)
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "tune.py")
    (tmp_path / "tune.py").write_text("")
    monkeypatch.setitem(sys.modules, "__main__", script)
    config.study.trial_isolation = "process"
    check_trial_processes_import(config)  # a script's file: imported again there


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ("hpo.run('missing.yaml', study='s')\n", True),
        ("if __name__ == '__main__':\n    hpo.run('missing.yaml', study='s')\n", False),
        ("if '__main__' == __name__:\n    x = 1\n    hpo.run('missing.yaml', study='s')\n", False),
        ("def main():\n    hpo.run('missing.yaml', study='s')\n\nmain()\n", False),
    ],
)
def test_a_run_at_a_scripts_top_level_without_the_main_guard_is_refused_first(
    tmp_path: Path, body: str, refused: bool
) -> None:
    # Issue 42: every trial process imported the script and ran it again, each trial failing
    # with a multiprocessing traceback while the budget burned. Refused before anything else;
    # a guarded call (or one in a function) goes on to the next check, the missing config.
    script = tmp_path / "tune.py"
    script.write_text("import hpo\n\n" + body, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    guard = 'outside `if __name__ == "__main__":`'
    assert (guard in done.stderr) is refused, done.stderr[-2000:]
    assert ("missing.yaml" in done.stderr) is not refused or "line 3" in done.stderr
