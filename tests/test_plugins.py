"""Plug-ins named in the config by import path: `search_space: package.module:name`, a
define-by-run function that samples each trial's parameters. The config rules, the check of what
it returns, each way it can fail, and runs through `hpo run`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from hpo.config.loader import parse_config
from hpo.config.param_checks import function_params
from hpo.errors import ConfigError
from tests.conftest import REPO, easy_rows, run_hpo, tiny_config, write_config, write_csv


def space_config(tmp_path: Path, **study: Any) -> dict[str, Any]:
    """A config for hpo's own trainer whose search space is a function."""
    train = write_csv(tmp_path / "train.csv", easy_rows(32, 1))
    evaluation = write_csv(tmp_path / "eval.csv", easy_rows(16, 2))
    raw = tiny_config(train, evaluation, study=study)
    raw["search_space"] = "space_fn:space"
    return raw


def problems_of(raw: dict[str, Any], tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=tmp_path)
    return str(caught.value)


def test_a_function_search_space_replaces_the_mapping(tmp_path: Path) -> None:
    config = parse_config(space_config(tmp_path), base_dir=tmp_path)
    assert config.search_space_function == "space_fn:space"
    assert config.search_space == {}  # hpo's default space is not added: the function says all
    raw = space_config(tmp_path, enqueue=[{"lr": 0.01, "layers": 2}])
    assert parse_config(raw, base_dir=tmp_path).study.enqueue == [{"lr": 0.01, "layers": 2}]


def test_function_search_space_config_problems(tmp_path: Path) -> None:
    raw = space_config(tmp_path)
    raw["search_space"] = "space_fn.space"
    assert (
        "search_space: got 'space_fn.space'; must be a mapping of parameter name to spec, or "
        "your function as `package.module:name`" in problems_of(raw, tmp_path)
    )
    raw = space_config(tmp_path, sampler={"type": "grid"})
    assert "study.sampler.type: grid needs a search space mapping" in problems_of(raw, tmp_path)
    raw = space_config(tmp_path, enqueue=[{"lr": [1, 2]}])
    assert "study.enqueue[0].lr: got [1, 2]; must be a single value" in problems_of(raw, tmp_path)
    raw = space_config(tmp_path, enqueue=[{}])
    assert "study.enqueue[0]: names no parameter" in problems_of(raw, tmp_path)


def test_what_the_function_returns_is_checked_like_a_yaml_space(tmp_path: Path) -> None:
    config = parse_config(space_config(tmp_path), base_dir=tmp_path)
    returned = {
        "learning_rate": 1e-3,
        "training.epochs": 2.0,
        "model.dropout": 0.1,
        "data.max_length": 16,
    }
    got = function_params(config, returned, "m:f")
    # short and dotted names, as a YAML space takes them; whole floats become whole numbers
    assert got == {"learning_rate": 1e-3, "epochs": 2, "model.dropout": 0.1, "data.max_length": 16}
    assert isinstance(got["epochs"], int)
    with pytest.raises(
        ValueError,
        match=r"m:f returned learning_rat: unknown parameter \(did you "
        r"mean 'learning_rate'\?\)",
    ):
        function_params(config, {"learning_rat": 1e-3}, "m:f")
    with pytest.raises(ValueError, match="m:f returned epochs: got 'many'; must be an integer"):
        function_params(config, {"epochs": "many"}, "m:f")
    with pytest.raises(ValueError, match="m:f returned learning_rate: value -1"):
        function_params(config, {"learning_rate": -1.0}, "m:f")
    with pytest.raises(ValueError, match=r"m:f returned a list \[1\]; expected a dict"):
        function_params(config, [1], "m:f")
    with pytest.raises(
        ValueError, match="m:f returned lr: unknown parameter.*; m:f returned epochs: got 'x'"
    ):
        function_params(config, {"lr": 1.0, "epochs": "x"}, "m:f")  # every problem at once


def test_a_training_function_takes_any_identifier(tmp_path: Path) -> None:
    raw = {
        "training": {"entrypoint": "train_fn:train", "device": "cpu"},
        "study": {"metric": "val_loss", "direction": "minimize"},
        "search_space": "space_fn:space",
    }
    config = parse_config(raw, base_dir=tmp_path)
    assert function_params(config, {"hidden": 64, "lr": 0.1}, "m:f") == {"hidden": 64, "lr": 0.1}
    with pytest.raises(ValueError, match="m:f returned not a name: a parameter's name must"):
        function_params(config, {"not a name": 1}, "m:f")


SPACE = """\
def space(trial):
    mode = trial.suggest_categorical("mode", ["ok", "raise", "wrong", "unknown", "exit", "hang"])
    if mode == "raise":
        helper_that_breaks(7)
    if mode == "wrong":
        return [mode]
    if mode == "unknown":
        return {"mode": mode, "learning_rat": 0.1}
    if mode == "exit":
        raise SystemExit(4)
    if mode == "hang":  # ended by study.trial_timeout
        __import__("time").sleep(600)
    layers = trial.suggest_int("layers", 1, 3)  # a loop over layers, as Optuna writes it
    return {"mode": mode, "widths": [trial.suggest_int(f"w{i}", 4, 8) for i in range(layers)]}


def helper_that_breaks(n):
    raise RuntimeError(f"space broke at {n}")
"""


def sampled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raw: dict[str, Any], mode: str) -> Any:
    """A worker's Sampler on one trial of an in-memory study, `mode` enqueued."""
    from hpo.trial.search_space import Sampler

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "space_fn", raising=False)
    (tmp_path / "space_fn.py").write_text(SPACE)
    sampler = Sampler(parse_config(raw, base_dir=tmp_path))
    study = optuna.create_study()
    study.enqueue_trial({"mode": mode, "layers": 2})
    trial = study.ask()
    try:
        return sampler(trial)
    finally:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        sampled.attrs = trial.user_attrs  # type: ignore[attr-defined]


def test_sampler_calls_the_function_and_names_each_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.trial.search_space import SearchSpaceError

    raw = {
        "training": {"entrypoint": "train_fn:train", "device": "cpu"},
        "study": {"metric": "val_loss", "direction": "minimize"},
        "search_space": "space_fn:space",
    }
    params = sampled(tmp_path, monkeypatch, raw, "ok")
    assert params["mode"] == "ok" and len(params["widths"]) == 2  # the enqueued layers: 2
    assert sampled.attrs["params"] == params  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="space broke at 7"):
        sampled(tmp_path, monkeypatch, raw, "raise")
    kept = sampled.attrs["traceback"]  # type: ignore[attr-defined]
    assert 'space_fn.py", line 18, in helper_that_breaks' in kept
    assert kept.splitlines()[1].strip().startswith('File "' + str(tmp_path))  # the user's frames
    assert "space_fn:space: RuntimeError: space broke at 7" in sampled.attrs["fail_reason"]  # type: ignore[attr-defined]
    with pytest.raises(SearchSpaceError, match=r"space_fn:space returned a list"):
        sampled(tmp_path, monkeypatch, raw, "wrong")
    with pytest.raises(SearchSpaceError, match="space_fn:space raised SystemExit: 4"):
        sampled(tmp_path, monkeypatch, raw, "exit")
    own = space_config(tmp_path)
    with pytest.raises(SearchSpaceError, match="returned learning_rat: unknown parameter .did you"):
        sampled(tmp_path, monkeypatch, own, "unknown")
    assert "learning_rate" in sampled.attrs["fail_reason"]  # type: ignore[attr-defined]


def test_cli_refuses_a_missing_space_function_before_any_trial(tmp_path: Path) -> None:
    (tmp_path / "space_fn.py").write_text("def spaec(trial):\n    return {}\n")
    raw = {
        "training": {"entrypoint": "train_fn:train", "device": "cpu"},
        "study": {"metric": "val_loss", "direction": "minimize", "n_trials": 1},
        "search_space": "space_fn:space",
    }
    (tmp_path / "train_fn.py").write_text("def train(ctx):\n    return 0.0\n")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    done = run_hpo(
        "run",
        "--config",
        "config.yaml",
        "--study",
        "s",
        "--storage",
        "sqlite:///s.db",
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    where = tmp_path / "space_fn.py"
    assert last.endswith(f"search_space: space_fn:space: module space_fn ({where}) has no space")
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "s.db").exists() or not optuna.get_all_study_summaries(
        "sqlite:///" + str(tmp_path / "s.db")
    )


TRAIN = """\
def train(ctx):
    return float(sum(ctx.params["widths"]))
"""


@pytest.mark.slow
def test_space_failures_end_their_trial_and_the_worker_goes_on(tmp_path: Path) -> None:
    """One worker, a trial per way: the function raises (FAIL, the user's traceback kept),
    returns a list, exits (FAIL, named), hangs (FAIL at the trial timeout); the enqueued `ok`
    trial trains with what it returned."""
    (tmp_path / "space_fn.py").write_text(SPACE)
    (tmp_path / "train_fn.py").write_text(TRAIN)
    modes = ["raise", "wrong", "exit", "hang", "ok"]
    raw = {
        "training": {"entrypoint": "train_fn:train", "device": "cpu"},
        "study": {
            "metric": "width",
            "direction": "minimize",
            "n_trials": len(modes),
            "trial_timeout": 2,
            "enqueue": [{"mode": m, "layers": 2, "w0": 4, "w1": 5} for m in modes],
        },
        "search_space": "space_fn:space",
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    url = f"sqlite:///{tmp_path / 's.db'}"
    done = run_hpo(
        "run",
        "--config",
        "config.yaml",
        "--study",
        "s",
        "--storage",
        url,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trials = {t.params["mode"]: t for t in optuna.load_study(study_name="s", storage=url).trials}
    state = optuna.trial.TrialState
    assert trials["raise"].state == state.FAIL
    assert 'space_fn.py", line 18, in helper_that_breaks' in trials["raise"].user_attrs["traceback"]
    assert 'space_fn.py", line 18, in helper_that_breaks' in done.stderr  # the worker's log
    assert trials["wrong"].state == state.FAIL
    assert "space_fn:space returned a list" in trials["wrong"].user_attrs["fail_reason"]
    assert trials["exit"].state == state.FAIL
    assert trials["hang"].state == state.FAIL
    assert trials["hang"].user_attrs["fail_reason"].startswith("timeout: the search space")
    assert trials["ok"].state == state.COMPLETE and trials["ok"].value == 9.0  # widths 4 + 5
    assert trials["ok"].user_attrs["params"] == {"mode": "ok", "widths": [4, 5]}


EXAMPLE = REPO / "examples" / "plugins"


@pytest.mark.slow
def test_plugins_example_trains_with_what_its_space_returns(tmp_path: Path) -> None:
    """examples/plugins, cut to one trial of one epoch on the tests' tiny data: hpo's trainer
    trains with what space.py returns, exactly as if sampled from YAML (the enqueued warm start
    fixes the names it suggests), and f_beta.py's f2 is the trial's value."""
    for name in ("config.yaml", "space.py", "f_beta.py"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    raw["study"].update(n_trials=1, storage=f"sqlite:///{tmp_path / 's.db'}")
    train = write_csv(tmp_path / "train.csv", easy_rows(32, 1))
    evaluation = write_csv(tmp_path / "eval.csv", easy_rows(16, 2))
    raw["data"].update(train_file=str(train), eval_file=str(evaluation))
    raw["training"].update(epochs=1, evals_per_epoch=1, physical_batch_size=4, device="cpu")
    write_config(tmp_path / "config.yaml", raw)
    done = run_hpo("run", "--config", "config.yaml", "--study", "s", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (trial,) = optuna.load_study(study_name="s", storage=raw["study"]["storage"]).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert trial.params == raw["study"]["enqueue"][0]  # Optuna's own record: the names suggested
    trained = trial.user_attrs["params"]
    assert trained == {
        "learning_rate": 0.002,
        "effective_batch_size": 32,
        "lr_schedule": "linear",
        "warmup_ratio": 0.1,
    }
    assert trial.user_attrs["search_space"] == "space:space"
    metrics = trial.user_attrs["best_evaluation"]["metrics"]
    assert trial.value == metrics["f2"] and {"recall", "accuracy"} <= set(metrics)


# -- metrics: package.module:name ------------------------------------------------------------


def metrics_config(tmp_path: Path, **study: Any) -> dict[str, Any]:
    raw = space_config(tmp_path, **study)
    raw["search_space"] = {"learning_rate": {"type": "float", "low": 1e-3, "high": 5e-3}}
    raw["metrics"] = "my_metrics:f2"
    return raw


def test_study_metric_may_name_the_functions_metrics(tmp_path: Path) -> None:
    raw = metrics_config(tmp_path, metric="f2", direction="maximize")
    config = parse_config(raw, base_dir=tmp_path)
    assert config.metrics == "my_metrics:f2"
    assert config.study.objectives == ["f2"] and config.study.resolved_directions == ["maximize"]
    raw = metrics_config(tmp_path, metric=["f2", "accuracy"], direction=["maximize", "maximize"])
    assert parse_config(raw, base_dir=tmp_path).study.objectives == ["f2", "accuracy"]
    assert parse_config(metrics_config(tmp_path), base_dir=tmp_path).study.metric == "accuracy"


def test_metrics_function_config_problems(tmp_path: Path) -> None:
    raw = metrics_config(tmp_path, metric="f2")
    assert (
        "study.direction: got null; f2 is not hpo's: give minimize or maximize for each "
        "metric (f2)" in problems_of(raw, tmp_path)
    )
    raw = metrics_config(tmp_path, metric=["f2", "accuracy"], direction=["maximize", "minimize"])
    assert "study.direction: metric accuracy must be maximized" in problems_of(raw, tmp_path)
    raw = metrics_config(tmp_path)
    raw["metrics"] = "my_metrics.f2"
    assert "metrics: got 'my_metrics.f2'; must be your function as `package.module:name`" in (
        problems_of(raw, tmp_path)
    )
    raw = metrics_config(tmp_path)
    raw["task"] = "token_classification"
    raw["study"]["metric"] = "f1"
    assert "metrics: the task token_classification has a target per token" in (
        problems_of(raw, tmp_path)
    )
    raw = metrics_config(tmp_path)  # the study may not name a metric without the function
    del raw["metrics"]
    raw["study"].update(metric="f2", direction="maximize")
    assert "study.metric" in problems_of(raw, tmp_path)
    raw = {
        "training": {"entrypoint": "train_fn:train"},
        "study": {"metric": "val_loss", "direction": "minimize"},
        "metrics": "my_metrics:f2",
    }
    assert "metrics: means nothing with training.entrypoint" in problems_of(raw, tmp_path)


def test_what_the_metrics_function_returns_is_checked() -> None:
    import numpy as np

    from hpo.trainer.user_metrics import MetricsFunctionError, UserMetrics

    def f2(logits: Any, labels: Any) -> Any:
        return {"f2": np.float32(0.5), "hits": int((logits.argmax(1) == labels).sum())}

    user = UserMetrics(f2, "m:f2")
    logits, labels = np.array([[0.1, 0.9], [0.8, 0.2]], np.float32), np.array([1, 1])
    got = user(logits, labels, {"accuracy": 0.5})
    assert got == {"f2": 0.5, "hits": 1.0} and all(type(v) is float for v in got.values())
    for returned, said in [
        ([0.5], "m:f returned list; expected a dict of metric name to number"),
        ({"f2": "high"}, "m:f returned 'f2': str 'high'; expected a number"),
        ({"f2": True}, "m:f returned 'f2': bool True; expected a number"),
        ({"f2": np.ones(3)}, "m:f returned 'f2': ndarray"),
        ({1: 0.5}, "m:f returned the key 1; a metric's name is text"),
        ({"accuracy": 0.5}, "m:f returned 'accuracy', a metric the task has already (accuracy)"),
    ]:
        with pytest.raises(
            MetricsFunctionError, match=said.replace("(", r"\(").replace(")", r"\)")
        ):
            UserMetrics(lambda _x, _y, r=returned: r, "m:f")(logits, labels, {"accuracy": 0.5})

    def broken(logits: Any, labels: Any) -> Any:
        raise ZeroDivisionError("no positives")

    with pytest.raises(
        MetricsFunctionError, match="m:b raised ZeroDivisionError: no positives"
    ) as e:
        UserMetrics(broken, "m:b")(logits, labels, {})
    assert isinstance(e.value.__cause__, ZeroDivisionError)  # the user's traceback goes with it


def test_cli_refuses_a_metrics_module_that_does_not_import(tmp_path: Path) -> None:
    (tmp_path / "my_metrics.py").write_text("import sklearn_that_is_not_there\n")
    write_config(
        tmp_path / "config.yaml", metrics_config(tmp_path, metric="f2", direction="maximize")
    )
    done = run_hpo(
        "run",
        "--config",
        "config.yaml",
        "--study",
        "s",
        "--storage",
        "sqlite:///s.db",
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "metrics: my_metrics:f2: module my_metrics does not import (ModuleNotFoundError: No "
            "module named 'sklearn_that_is_not_there')"
        )
    )
    assert "Traceback" not in done.stderr


METRICS = """\
import numpy as np


def f2(logits, labels):
    assert logits.shape == (16, 2) and logits.dtype == np.float32  # every eval row, 2 classes
    assert labels.shape == (16,) and set(labels.tolist()) == {0, 1}
    return helper_that_breaks()


def helper_that_breaks():
    raise ZeroDivisionError("no positives")
"""


@pytest.mark.slow
def test_a_metrics_function_that_raises_fails_its_trial_with_its_traceback(tmp_path: Path) -> None:
    """hpo's trainer, one trial of one epoch: the metrics function sees the logits and labels of
    every evaluation example, then raises: the trial fails with the user's traceback kept, and
    the worker ends normally (examples/plugins runs one that works)."""
    (tmp_path / "my_metrics.py").write_text(METRICS)
    raw = metrics_config(tmp_path, metric="f2", direction="maximize", n_trials=1)
    raw["training"].update(epochs=1, evals_per_epoch=1)
    write_config(tmp_path / "config.yaml", raw)
    url = f"sqlite:///{tmp_path / 's.db'}"
    done = run_hpo(
        "run",
        "--config",
        "config.yaml",
        "--study",
        "s",
        "--storage",
        url,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (trial,) = optuna.load_study(study_name="s", storage=url).trials
    assert trial.state == optuna.trial.TrialState.FAIL
    assert "my_metrics:f2 raised ZeroDivisionError: no positives" in trial.user_attrs["fail_reason"]
    assert 'my_metrics.py", line 11, in helper_that_breaks' in trial.user_attrs["traceback"]
    assert 'my_metrics.py", line 11, in helper_that_breaks' in done.stderr  # the worker's log


def test_the_json_schema_takes_plugins_and_still_refuses_unknown_metrics(tmp_path: Path) -> None:
    import jsonschema

    from hpo.config.json_schema import config_schema

    def valid(raw: dict[str, Any]) -> bool:
        return jsonschema.Draft7Validator(config_schema()).is_valid(raw)

    raw = metrics_config(tmp_path, metric="f2", direction="maximize")
    raw["search_space"] = "space_fn:space"
    assert valid(raw)
    raw["search_space"] = "space_fn.space"  # not an import path
    assert not valid(raw)
    raw = metrics_config(tmp_path, metric="f2", direction="maximize")
    del raw["metrics"]  # without the function, f2 is no metric of hpo's
    assert not valid(raw)


def test_a_study_keeps_its_search_space_function(tmp_path: Path) -> None:
    """The first worker records the function; one whose config names another, or a mapping,
    is refused (both would record an empty search space)."""
    from hpo.storage import open_storage, resolve_storage_url
    from hpo.study.join import open_study

    storage = open_storage(resolve_storage_url(f"sqlite:///{tmp_path / 's.db'}", None))
    config = parse_config(space_config(tmp_path), base_dir=tmp_path)
    open_study(storage, "s", config)
    open_study(storage, "s", config)  # the same function: joins
    other = parse_config(space_config(tmp_path), base_dir=tmp_path)
    other.search_space_function = "other_fn:space"
    with pytest.raises(
        ConfigError,
        match="study 's' samples with space_fn:space, but this config with other_fn:space",
    ):
        open_study(storage, "s", other)
    mapping = parse_config(metrics_config(tmp_path), base_dir=tmp_path)
    mapping.search_space = {}
    with pytest.raises(ConfigError, match="but this config with a search space mapping"):
        open_study(storage, "s", mapping)


def test_retrain_refuses_a_function_search_space(tmp_path: Path) -> None:
    from hpo.errors import HPOError
    from hpo.study import retrain

    config = parse_config(space_config(tmp_path), base_dir=tmp_path)
    study = optuna.create_study(direction="maximize")
    with pytest.raises(
        HPOError,
        match="search_space: space_fn:space samples in Python; retrain "
        "needs the search space as a mapping",
    ):
        retrain.make_plan(study, config, top=1, seeds=2)


def test_hpo_enqueue_takes_the_functions_own_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], hpo_main: Any
) -> None:
    from hpo.storage import open_storage, resolve_storage_url
    from hpo.study.join import open_study

    url = f"sqlite:///{tmp_path / 's.db'}"
    open_study(
        open_storage(resolve_storage_url(url, None)),
        "s",
        parse_config(space_config(tmp_path), base_dir=tmp_path),
    )
    args = ["enqueue", "--study", "s", "--storage", url, "--params"]
    assert hpo_main([*args, '{"lr": 0.01, "layers": 2}']) == 0  # no search space to check them
    [waiting] = optuna.load_study(study_name="s", storage=url).get_trials()
    assert waiting.params == {} and waiting.system_attrs["fixed_params"] == {
        "lr": 0.01,
        "layers": 2,
    }
    capsys.readouterr()
    assert hpo_main([*args, '{"lr": [0.01]}']) == 2
    assert "--params.lr: got [0.01]; must be a single value" in capsys.readouterr().err


def test_a_space_function_may_prune_its_trial(tmp_path: Path) -> None:
    from hpo.trial.search_space import sample_function

    def space(trial: optuna.Trial) -> dict[str, Any]:
        if trial.suggest_int("layers", 1, 3) > 0:
            raise optuna.TrialPruned("nothing to try here")
        return {}

    config = parse_config(space_config(tmp_path), base_dir=tmp_path)
    trial = optuna.create_study().ask()
    with pytest.raises(optuna.TrialPruned, match="nothing to try here"):
        sample_function(trial, config, space)
    assert "traceback" not in trial.user_attrs and "fail_reason" not in trial.user_attrs


def test_a_space_function_that_hangs_fails_its_trial_at_the_trial_timeout(tmp_path: Path) -> None:
    """Known gap of issue 27: the function runs in the worker, before any trial process, so
    the trial timeout did not reach it. Now it is waited for study.trial_timeout, then its
    trial fails with reason "timeout" naming it, and the worker goes on (the call is left in a
    daemon thread); a stop request is heard while it runs."""
    import threading

    from hpo.stopping import Interrupted, StopRequest
    from hpo.trial.search_space import SearchSpaceTimedOut, sample_function

    release = threading.Event()

    def space(trial: optuna.Trial) -> dict[str, Any]:
        trial.suggest_int("layers", 1, 3)
        release.wait()
        return {}

    config = parse_config(space_config(tmp_path, trial_timeout=0.3), base_dir=tmp_path)
    trial = optuna.create_study().ask()
    with pytest.raises(SearchSpaceTimedOut):
        sample_function(trial, config, space)
    assert trial.user_attrs["fail_reason"].startswith(
        "timeout: the search space space_fn:space did not return within 0.3 s (study.trial_timeout)"
    )
    stop = StopRequest()
    stop.note("SIGTERM")
    config.study.trial_timeout = None  # no limit: only the stop ends the wait
    with pytest.raises(Interrupted):
        sample_function(optuna.create_study().ask(), config, space, stop)
    release.set()


def test_a_space_function_cannot_take_the_workers_signals(tmp_path: Path) -> None:
    """A plug-in that sets a signal handler would replace the worker's (Ctrl-C would no longer
    hand the trial back): it runs outside the main thread, so signal.signal refuses and the
    trial fails with the user's traceback."""
    import signal

    def space(trial: optuna.Trial) -> dict[str, Any]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return {}

    from hpo.trial.search_space import sample_function

    before = signal.getsignal(signal.SIGTERM)
    config = parse_config(space_config(tmp_path), base_dir=tmp_path)
    trial = optuna.create_study().ask()
    with pytest.raises(ValueError, match="signal only works in main thread"):
        sample_function(trial, config, space)
    assert signal.getsignal(signal.SIGTERM) is before
    assert "in space\n    signal.signal" in trial.user_attrs["traceback"]


UNSETTLING_SPACE = """\
import os


def space(trial):
    os.chdir("/")  # the worker's working folder, changed by a plug-in
    return {"mode": trial.suggest_categorical("mode", ["unsettle", "settled"])}
"""

UNSETTLING_TRAIN = """\
import os
import signal


def train(ctx):
    settled = os.getcwd() != "/" and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    if ctx.params["mode"] == "unsettle":
        os.chdir("/")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return {"m": 0.0 if settled else 1.0}
"""


def test_user_code_in_the_worker_leaves_its_folder_and_signals_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hpo_main: Any
) -> None:
    """A search-space function (always in the worker) and a training function trained in the
    worker (study.trial_isolation: none) that change the working folder or SIGTERM's handler:
    both are put back before the next step of the worker (its relative paths, its clean stop)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("space_fn", "train_fn"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    (tmp_path / "space_fn.py").write_text(UNSETTLING_SPACE)
    (tmp_path / "train_fn.py").write_text(UNSETTLING_TRAIN)
    raw = {
        "training": {"entrypoint": "train_fn:train", "device": "cpu"},
        "study": {
            "metric": "m",
            "direction": "minimize",
            "n_trials": 2,
            "trial_isolation": "none",
            "checkpoints": False,
            "enqueue": [{"mode": "unsettle"}, {"mode": "settled"}],
        },
        "search_space": "space_fn:space",
    }
    write_config(tmp_path / "c.yaml", raw)
    url = f"sqlite:///{tmp_path / 's.db'}"
    assert hpo_main(["run", "--config", "c.yaml", "--study", "s", "--storage", url]) == 0
    trials = optuna.load_study(study_name="s", storage=url).trials
    assert [(t.params["mode"], t.value) for t in trials] == [("unsettle", 0.0), ("settled", 0.0)]
    assert Path.cwd() == tmp_path
