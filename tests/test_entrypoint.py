"""The user's own training function (training.entrypoint): the config rules, the context, the
example MLP run through `hpo run`, and each way user code can fail."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from hpo.config.loader import parse_config
from hpo.errors import ConfigError
from tests.conftest import REPO, run_hpo, study_exists

EXAMPLE = REPO / "examples" / "mlp" / "config.yaml"


def entrypoint_config(**study: Any) -> dict[str, Any]:
    return {
        "training": {"entrypoint": "train_fn:train", "device": "cpu"},
        "study": {"metric": "val_loss", "direction": "minimize", "n_trials": 2, **study},
        "search_space": {"lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True}},
    }


def problems_of(raw: dict[str, Any], tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=tmp_path)
    return str(caught.value)


def test_entrypoint_config_needs_no_model_data_or_task(tmp_path: Path) -> None:
    config = parse_config(entrypoint_config(), base_dir=tmp_path)
    assert config.training.entrypoint == "train_fn:train"
    assert list(config.search_space) == ["lr"]  # hpo's default space is not added
    assert config.study.objectives == ["val_loss"]
    assert config.study.resolved_directions == ["minimize"]


def test_entrypoint_config_problems_name_what_to_fix(tmp_path: Path) -> None:
    raw = entrypoint_config()
    raw["model"] = {"name_or_path": "bert-base-uncased"}
    assert "model: means nothing with training.entrypoint" in problems_of(raw, tmp_path)
    raw = entrypoint_config()
    del raw["study"]["direction"]
    assert "study.direction: got null; with training.entrypoint give minimize or maximize" in (
        problems_of(raw, tmp_path)
    )
    raw = entrypoint_config()
    raw["training"]["entrypoint"] = "train_fn.train"
    assert "training.entrypoint: got 'train_fn.train'; must be `package.module:function`" in (
        problems_of(raw, tmp_path)
    )
    raw = entrypoint_config()
    raw["search_space"]["effective_batch_size"] = {"type": "categorical", "choices": [32, 0]}
    assert "search_space.effective_batch_size: value 0 must be a positive integer" in (
        problems_of(raw, tmp_path)
    )


def test_a_training_function_s_space_may_have_conditions(tmp_path: Path) -> None:
    """`when` with training.entrypoint: the user's own names and values; a parameter whose
    condition does not hold is never sampled, so it is not in ctx.params."""
    from hpo.trial.search_space import sample

    raw = entrypoint_config()
    raw["search_space"] = {
        "optimizer": {"type": "categorical", "choices": ["SGD", "Adam"]},
        "momentum": {"type": "float", "low": 0.0, "high": 0.99, "when": {"optimizer": "SGD"}},
        "lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
    }
    config = parse_config(raw, base_dir=tmp_path)
    assert config.search_space["momentum"].when == {"optimizer": ["SGD"]}
    study = optuna.create_study()
    study.enqueue_trial({"optimizer": "Adam"})
    study.enqueue_trial({"optimizer": "SGD"})
    adam, sgd = sample(study.ask(), config.search_space), sample(study.ask(), config.search_space)
    assert set(adam) == {"optimizer", "lr"} and set(sgd) == {"optimizer", "momentum", "lr"}
    raw["search_space"]["momentum"]["when"] = {"optimizer": "Nadam"}
    assert "search_space.momentum.when.optimizer: got 'Nadam'; optimizer never takes it" in (
        problems_of(raw, tmp_path)
    )
    raw["search_space"]["momentum"]["when"] = {"optimiser": "SGD"}
    assert "optimiser is not searched" in problems_of(raw, tmp_path)
    raw["search_space"]["momentum"]["when"] = {"optimizer": "SGD"}
    raw["study"]["sampler"] = {"type": "grid"}
    assert "the grid sampler tries every combination" in problems_of(raw, tmp_path)


@pytest.mark.parametrize(
    ("source", "spec", "said"),
    [
        (
            "",
            "nosuchmodule:train",
            "module nosuchmodule does not import (ModuleNotFoundError: "
            "No module named 'nosuchmodule')",
        ),
        (
            "import nosuchdependency\n",
            "user_fn:train",
            "module user_fn does not import "
            "(ModuleNotFoundError: No module named 'nosuchdependency')",
        ),
        (
            "raise SystemExit(3)\n",
            "user_fn:train",
            "module user_fn does not import (SystemExit: 3)",
        ),
        ("def other(ctx): pass\n", "user_fn:train", "has no train"),
        ("train = 3\n", "user_fn:train", "train is not callable (it is int); name a function"),
        (
            "def train(ctx):\n    yield 1\n",
            "user_fn:train",
            "train is a generator function (it yields), so calling it runs none of its body",
        ),
        (
            "async def train(ctx):\n    return 1\n",
            "user_fn:train",
            "train is an async function (`async def`; await it in a plain def with asyncio.run)",
        ),
        (
            "def train(ctx): pass\n",
            "user_fn.py:train",
            "No module named 'user_fn.py'; 'user_fn' is not a package); name the module "
            "without its .py: user_fn:train",
        ),
    ],
)
def test_entrypoint_that_cannot_be_called_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, spec: str, said: str
) -> None:
    from hpo.plugins.entrypoint import load_entrypoint

    monkeypatch.setattr(sys, "path", list(sys.path))  # load_entrypoint adds the folder
    monkeypatch.delitem(sys.modules, "user_fn", raising=False)

    folder = tmp_path / spec.replace(":", "_")
    folder.mkdir()
    (folder / "user_fn.py").write_text(source)
    with pytest.raises(ConfigError) as caught:
        load_entrypoint(spec, str(folder))
    message = str(caught.value)
    assert said in message and message.count("\n") == 0
    assert message.startswith(f"config: training.entrypoint: {spec}: ")


def test_a_module_named_like_python_s_own_is_named_as_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.plugins.entrypoint import load_entrypoint

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "os.py").write_text("def train(ctx):\n    return 1.0\n")
    with pytest.raises(ConfigError) as caught:
        load_entrypoint("os:train", str(tmp_path))
    assert str(caught.value).endswith(
        f"has no train; your {tmp_path / 'os.py'} is not the module "
        "imported under that name (Python's own or another one "
        "loaded first): rename your file"
    )


def test_a_nan_value_is_named_and_others_are_not() -> None:
    from hpo.study.loop import nan_objectives

    assert nan_objectives(["loss", "acc"], [float("nan"), 0.5]) == "loss=nan"
    assert nan_objectives(["loss"], float("nan")) == "loss=nan"
    assert nan_objectives(["loss"], float("inf")) == "" and nan_objectives(["loss"], 0.1) == ""


def test_report_and_return_values_are_checked() -> None:
    from hpo.plugins.context import ReportError, checked_metrics
    from hpo.plugins.entrypoint import TrainingFunctionError, trial_values

    with pytest.raises(ReportError, match=r"no 'val_loss' among the metrics given \(loss, acc\)"):
        checked_metrics({"loss": 1.0, "acc": 0.5}, "val_loss", "ctx.report")
    with pytest.raises(ReportError, match="metric 'acc' is str 'high'; expected a number"):
        checked_metrics({"val_loss": 1.0, "acc": "high"}, "val_loss", "ctx.report")

    class Context:
        last_metrics: dict[str, float] | None = None

    context: Any = Context()
    with pytest.raises(TrainingFunctionError, match="m:f returned list; expected a dict of"):
        trial_values([0.1], context, ["val_loss"], "m:f")
    with pytest.raises(TrainingFunctionError, match="returned None and never called ctx.report"):
        trial_values(None, context, ["val_loss"], "m:f")
    assert trial_values(0.25, context, ["val_loss"], "m:f") == [0.25]
    import numpy as np
    import torch

    for number in (np.float32(0.5), np.array(0.5), torch.tensor([0.5]), np.int64(0)):
        assert trial_values(number, context, ["val_loss"], "m:f") == [
            float(number)
        ]  # hostile F: np
    with pytest.raises(TrainingFunctionError, match="m:f returned str_; expected a dict"):
        trial_values(np.str_("0.5"), context, ["val_loss"], "m:f")
    with pytest.raises(ReportError, match="metric 'val_loss' is bool np.True_; expected a number"):
        checked_metrics({"val_loss": np.bool_(True)}, "val_loss", "ctx.report")
    context.last_metrics = {"val_loss": 0.5, "accuracy": 0.9}
    assert trial_values(None, context, ["val_loss", "accuracy"], "m:f") == [0.5, 0.9]


def test_cli_refuses_a_missing_function_before_any_trial(tmp_path: Path) -> None:
    (tmp_path / "train_fn.py").write_text("def trian(ctx):\n    return 0.0\n")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(entrypoint_config()))
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
            "training.entrypoint: train_fn:train: module train_fn ("
            + str(tmp_path / "train_fn.py")
            + ") has no train"
        )
    )
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "s.db").exists() or not optuna.get_all_study_summaries(
        "sqlite:///" + str(tmp_path / "s.db")
    )


@pytest.mark.slow
def test_example_mlp_is_tuned_by_hpo_run(tmp_path: Path) -> None:
    """The plain-PyTorch example, end to end: trials complete, the enqueued too-small learning
    rate is pruned, and the study's best is the best completed trial."""
    url = f"sqlite:///{tmp_path / 'mlp.db'}"
    done = run_hpo(
        "run",
        "--config",
        str(EXAMPLE),
        "--study",
        "mlp",
        "--storage",
        url,
        "--n-trials",
        "4",
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="mlp", storage=url)
    states = [t.state for t in study.trials]
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) >= 2, states
    pruned = study.trials[2]  # the enqueued learning rate of 1e-5
    assert pruned.state == optuna.trial.TrialState.PRUNED, states
    reason = pruned.user_attrs["prune_reason"]  # a training function reports steps
    assert reason.startswith("median pruner: ") and "step" in reason and "val_loss" in reason
    assert "above the median" in reason, reason
    assert study.best_value == min(t.value for t in complete)
    best = study.best_trial.user_attrs
    assert best["entrypoint"] == "train_mlp:train"
    assert best["metrics"]["accuracy"] > 0.9  # the spirals are learnt
    assert (
        best["physical_batch_size"] * best["grad_accum_steps"]
        >= study.best_params["effective_batch_size"]
    )
    assert f"best trial #{study.best_trial.number}: val_loss=" in done.stdout
    assert "no saved model" not in done.stdout
    fetch = run_hpo("best", "--study", "mlp", "--storage", url, "--download", "m", cwd=tmp_path)
    assert fetch.returncode == 2
    assert "ran your training function (train_mlp:train), which keeps its own model" in (
        fetch.stderr
    )
    # hpo retrain calls the same function with new seeds (ctx.params["seed"]).
    retrain = ("retrain", "--config", str(EXAMPLE), "--study", "mlp", "--storage", url)
    again = run_hpo(*retrain, "--top", "1", "--seeds", "2", "--out", "final", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "final model: none saved by hpo (training.entrypoint" in again.stdout
    (retrain_name,) = [s for s in optuna.get_all_study_names(url) if s.startswith("mlp [retrain")]
    runs = optuna.load_study(study_name=retrain_name, storage=url).trials
    assert sorted(t.params["seed"] for t in runs) == [43, 44]
    assert all(t.params["learning_rate"] == study.best_params["learning_rate"] for t in runs)
    assert len({t.value for t in runs}) == 2  # the seed reached the function


FAILING_FUNCTION = """
import time


def helper_that_breaks(value):
    raise RuntimeError(f"user code broke at {value}")


def train(ctx):
    mode = ctx.params["mode"]
    if mode == "raise":
        helper_that_breaks(42)
    if mode == "hang":
        while True:  # ignores ctx.should_stop: the trial timeout must end it
            time.sleep(0.1)
    if mode == "wrong":
        return [0.5]
    if mode == "exit":
        raise SystemExit(3)
    if mode == "missing":
        ctx.report({"loss": 0.5}, step=0)
    if mode == "stops":  # heeds ctx.should_stop at the trial timeout: pruned, not failed
        while not ctx.should_stop:
            time.sleep(0.05)
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode == "nan":
        return {"val_loss": float("nan")}
    if mode == "unsettle":  # what a kept trial process must not carry to its next trial
        import os, signal

        os.chdir("/")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "settled":
        import os, signal

        assert os.getcwd() == ctx.params["folder"] and signal.getsignal(signal.SIGTERM) not in (
            signal.SIG_IGN, signal.SIG_DFL)
    ctx.report({"val_loss": 0.5}, step=0)
    return None
"""


@pytest.mark.slow
def test_user_code_failures_end_their_trial_and_the_worker_goes_on(tmp_path: Path) -> None:
    """One worker, one trial each: a function that raises (FAIL, the user's traceback kept in
    the trial and the log), hangs (ended by study.trial_timeout), returns a list or reports
    without study.metric (FAIL, named), raises KeyboardInterrupt (FAIL, its traceback kept),
    returns NaN (FAIL, the worker goes on), stops at the timeout (PRUNED, no traceback), changes
    the working folder and SIGTERM's handler (undone before the kept process's next trial)."""
    (tmp_path / "train_fn.py").write_text(FAILING_FUNCTION)
    modes = [
        "ok",
        "raise",
        "hang",
        "wrong",
        "missing",
        "exit",
        "stops",
        "interrupt",
        "nan",
        "unsettle",
        "settled",
    ]
    enqueue = [{"mode": m, "folder": str(tmp_path)} for m in modes]
    raw = entrypoint_config(n_trials=len(modes), trial_timeout=3, stop_timeout=2, enqueue=enqueue)
    raw["search_space"] = {
        "mode": {"type": "categorical", "choices": modes},
        "folder": {"type": "categorical", "choices": [str(tmp_path)]},
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
    raised = trials["raise"]
    assert raised.state == state.FAIL
    assert "RuntimeError: user code broke at 42" in raised.user_attrs["fail_reason"]
    user_traceback = raised.user_attrs["traceback"]
    assert 'train_fn.py", line 6, in helper_that_breaks' in user_traceback
    assert user_traceback.splitlines()[1].strip().startswith('File "' + str(tmp_path))
    assert 'train_fn.py", line 6, in helper_that_breaks' in done.stderr  # the worker's log
    assert trials["hang"].state == state.PRUNED
    assert trials["hang"].user_attrs["prune_reason"].startswith("timeout: ")
    wrong = trials["wrong"].user_attrs["fail_reason"]
    assert trials["wrong"].state == state.FAIL
    assert "train_fn:train returned list; expected a dict of metrics with 'val_loss'" in wrong
    assert "traceback" not in trials["wrong"].user_attrs  # hpo's frames: nothing of the user's
    assert trials["missing"].state == state.FAIL
    assert (
        "ctx.report: no 'val_loss' among the metrics given (loss)"
        in (trials["missing"].user_attrs["fail_reason"])
    )
    assert trials["ok"].state == state.COMPLETE and trials["ok"].value == 0.5
    assert trials["exit"].state == state.FAIL  # sys.exit() ends the trial, not the worker
    assert "train_fn:train raised SystemExit: 3" in trials["exit"].user_attrs["fail_reason"]
    stops = trials["stops"]
    assert stops.state == state.PRUNED and stops.user_attrs["prune_reason"].startswith("timeout")
    assert "traceback" not in stops.user_attrs and "fail_reason" not in stops.user_attrs
    interrupt = trials["interrupt"]
    assert (
        interrupt.state == state.FAIL
        and "in train\n    raise KeyboardInterrupt" in (interrupt.user_attrs["traceback"])
    )
    assert "train_fn:train raised KeyboardInterrupt" in interrupt.user_attrs["fail_reason"]
    assert trials["nan"].state == state.FAIL
    assert trials["nan"].user_attrs["fail_reason"].startswith("the trial's value is NaN (val_loss")
    assert trials["unsettle"].state == trials["settled"].state == state.COMPLETE
    assert trials["settled"].user_attrs["process_trials"] > 1  # the same, kept process


RESUMABLE_FUNCTION = """
import os
import time

import numpy as np
import torch

EPOCHS = 40


def hold_once(ctx):
    # After the third report, once in the study: wait for the worker's SIGTERM (a fast machine
    # would otherwise train all 40 epochs before it came), with a deadline.
    try:
        os.close(os.open("held", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    deadline = time.monotonic() + 120
    while not ctx.should_stop and time.monotonic() < deadline:
        time.sleep(0.02)


def train(ctx):
    state = ctx.restore()
    first = 0 if state is None else int(state["epoch"])
    if state is not None:  # what the stop saved, with its types (numpy's too: issue 42)
        assert torch.equal(state["weights"], torch.full((3,), float(first - 1)))
        assert state["means"].dtype == np.float32
        assert state["means"].tolist() == np.full((2, 2), first - 1, np.float32).tolist()
        assert type(state["loss"]) is np.float64 and state["loss"] == 1.0 / first
    for epoch in range(first, EPOCHS):
        time.sleep(0.1)
        ctx.report({"val_loss": 1.0 / (epoch + 1)}, step=epoch)
        if epoch == 2:
            hold_once(ctx)
        if ctx.should_stop:
            ctx.save({"epoch": epoch + 1, "weights": torch.full((3,), float(epoch)),
                      "means": np.full((2, 2), epoch, np.float32),
                      "loss": np.float64(1.0 / (epoch + 1))})
            return None
    return {"val_loss": 1.0 / EPOCHS, "first_epoch": first}
"""


@pytest.mark.slow
@pytest.mark.parametrize("other_host", [False, True])
def test_stopped_trial_resumes_from_what_the_function_saved(
    tmp_path: Path, other_host: bool
) -> None:
    """SIGTERM to the worker: the function sees ctx.should_stop, saves (tensors and numpy
    arrays) and returns; the trial is queued again, and the next worker's attempt starts from
    ctx.restore(), with the same arrays. `other_host`:
    the local checkpoints are gone (another host), the artifact store has the state. The function
    holds after its third report until the SIGTERM arrives."""
    import shutil
    import signal

    from tests.conftest import start_hpo

    (tmp_path / "train_fn.py").write_text(RESUMABLE_FUNCTION)
    store = {"artifact_store": (tmp_path / "store").as_uri()} if other_host else {}
    raw = entrypoint_config(n_trials=1, pruner={"type": "none"}, **store)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    url = f"sqlite:///{tmp_path / 's.db'}"
    args = ("run", "--config", "config.yaml", "--study", "s", "--storage", url)
    worker = start_hpo(*args, cwd=tmp_path)
    reported = 0
    deadline = time.monotonic() + 120
    while reported < 3 and time.monotonic() < deadline and worker.poll() is None:
        time.sleep(0.3)
        # Optuna's storage would create the tables beside the worker's own creation: only once
        # the worker made the study is it loaded.
        if study_exists(f"sqlite:///{tmp_path / 's.db'}", "s"):
            trials = optuna.load_study(study_name="s", storage=url).trials
            reported = len(trials[0].intermediate_values) if trials else 0
    assert reported >= 3, worker.communicate()[1][-3000:]
    worker.send_signal(signal.SIGTERM)
    _, stderr = worker.communicate(timeout=60)
    stopped = optuna.load_study(study_name="s", storage=url).trials[0]
    saved_at = max(stopped.intermediate_values) + 1
    assert stopped.state != optuna.trial.TrialState.COMPLETE, stderr[-3000:]
    if other_host:
        shutil.rmtree(tmp_path / "hpo-checkpoints")
    done = run_hpo(*args, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="s", storage=url)
    (resumed,) = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    # The report of the epoch it stopped after may not reach the study (the worker stops
    # relaying once it asked the trial to stop): it saved after the last recorded epoch or one.
    first = resumed.user_attrs["metrics"]["first_epoch"]
    assert first in (saved_at, saved_at + 1)
    assert min(resumed.intermediate_values) == first  # no epoch trained twice
    if other_host:
        assert resumed.user_attrs["resumed_from"].startswith("file://")


class RecordingTrial:
    """A trial that keeps what training code tells it."""

    number = 0

    def __init__(self) -> None:
        self.attrs: dict[str, Any] = {}
        self.reports: list[tuple[float, int]] = []

    def set_user_attr(self, key: str, value: Any) -> None:
        self.attrs[key] = value

    def report(self, value: float, step: int) -> None:
        self.reports.append((value, step))

    def should_prune(self) -> bool:
        return False


def context_for(trial: RecordingTrial, effective_batch_size: int, **training: Any) -> Any:
    import torch

    from hpo.plugins.context import TrainingContext
    from hpo.trainer.config import TrainingConfig

    return TrainingContext(
        params={},
        device=torch.device("cpu"),
        effective_batch_size=effective_batch_size,
        trial_number=0,
        metric="val_loss",
        _trial=trial,
        _training=TrainingConfig(**training),
        _should_stop=lambda: False,
    )


def test_find_batch_size_probes_the_users_step_and_splits_the_effective_batch() -> None:
    """Fake OOMs past 40 examples: the finder grows, bisects to 40, keeps the 0.9 margin (36),
    and the effective batch of 256 becomes 8 passes of 36; what is not an OOM propagates."""
    import torch

    tried: list[int] = []

    def step(size: int) -> None:
        tried.append(size)
        if size > 40:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    trial = RecordingTrial()
    ctx = context_for(trial, 256)
    assert ctx.physical_batch_size == 256 and ctx.grad_accum_steps == 1  # no search: whole
    assert ctx.find_batch_size(step) == 36
    assert (ctx.physical_batch_size, ctx.grad_accum_steps) == (36, 8)
    assert tried[:6] == [8, 16, 32, 64, 48, 40] and max(tried) == 64
    assert trial.attrs["grad_accum_steps"] == 8
    assert context_for(RecordingTrial(), 16).find_batch_size(step) == 14  # at most the effective
    assert context_for(RecordingTrial(), 64, physical_batch_size=16).physical_batch_size == 16

    def broken(size: int) -> None:
        raise ValueError("shapes do not match")

    with pytest.raises(ValueError, match="shapes do not match"):
        context_for(RecordingTrial(), 64).find_batch_size(broken)

    def never_fits(size: int) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(optuna.TrialPruned, match="not even a batch of 1 fits"):
        context_for(RecordingTrial(), 64).find_batch_size(never_fits)


def test_report_prunes_when_the_pruner_says_so_and_only_with_one_objective() -> None:
    class PruningTrial(RecordingTrial):
        def should_prune(self) -> bool:
            return len(self.reports) >= 2

    trial = PruningTrial()
    ctx = context_for(trial, 32)
    ctx.report({"val_loss": 0.9, "accuracy": 0.5}, step=0)
    with pytest.raises(optuna.TrialPruned, match="pruner: val_loss=0.8000 at step 1"):
        ctx.report({"val_loss": 0.8}, step=1)
    assert trial.reports == [(0.9, 0), (0.8, 1)]
    assert trial.attrs["prune_reason"] == "pruner: val_loss=0.8000 at step 1"
    with pytest.raises(ValueError, match="step must be an integer >= 0, got 1.5"):
        ctx.report({"val_loss": 0.8}, step=1.5)

    several = PruningTrial()
    ctx = context_for(several, 32)
    ctx._prunes = False  # a study of several objectives: Optuna takes no intermediate values
    for step in range(3):
        ctx.report({"val_loss": 0.5, "accuracy": 0.9}, step=step)
    assert several.reports == [] and ctx.last_metrics == {"val_loss": 0.5, "accuracy": 0.9}


def test_save_refuses_what_a_resume_could_not_read(tmp_path: Path) -> None:
    """A state that a resume could not read back is refused when it is saved, naming the key
    and its type, even in a study that keeps no checkpoints; a plain one comes back from
    restore() in the retry."""
    import numpy as np
    import torch

    from hpo.trainer.checkpoint import CheckpointStore

    class Mine:
        pass

    no_checkpoints = context_for(RecordingTrial(), 32)
    with pytest.raises(
        TypeError,
        match=r"state\['opt'\]\[1\] is tests\.test_entrypoint\..*Mine, "
        "which a resume could not read",
    ):
        no_checkpoints.save({"epoch": 1, "opt": [1, Mine()]})
    ctx = context_for(RecordingTrial(), 32)
    ctx._store, ctx._fingerprint = CheckpointStore(tmp_path / "trial"), "f"
    with pytest.raises(TypeError, match=r"state\['rows'\] is a numpy array of dtype object"):
        ctx.save({"epoch": 1, "rows": np.array([{"a": 1}], dtype=object)})
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state = {"epoch": 2, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    assert ctx.save(state)
    retry = context_for(RecordingTrial(), 32)
    retry._store, retry._fingerprint = CheckpointStore(tmp_path / "trial", resume=True), "f"
    restored = retry.restore()
    assert restored is not None and restored["epoch"] == 2
    assert torch.equal(restored["model"]["weight"], model.weight)
    other = context_for(RecordingTrial(), 32)  # another configuration's retry
    other._store, other._fingerprint = CheckpointStore(tmp_path / "trial", resume=True), "g"
    assert other.restore() is None


def test_numpy_arrays_and_scalars_saved_come_back_with_their_types(tmp_path: Path) -> None:
    """Numpy arrays (any numeric dtype and shape), numpy scalars, tensors and plain values,
    nested in dicts, lists and tuples, are saved and restored as they were (issue 42: numpy
    failed the trial, and only at the stop that saved it)."""
    from collections import OrderedDict

    import numpy as np
    import torch

    from hpo.trainer.checkpoint import CheckpointStore

    state = {
        "epoch": 3,
        "weights": np.arange(12, dtype=np.float32).reshape(3, 4),
        "rng": np.random.default_rng(0).bit_generator.state["state"]["state"],
        "best": np.float64(0.25),
        "steps": np.int64(7),
        "tensor": torch.arange(4),
        "nested": {"history": [np.array([1, 2], dtype=np.int16), (np.bool_(True), "x")]},
        "ordered": OrderedDict(a=np.zeros(2), b=1.5),
        "empty": np.zeros((0, 3), dtype=np.uint8),
    }
    ctx = context_for(RecordingTrial(), 32)
    ctx._store, ctx._fingerprint = CheckpointStore(tmp_path / "trial"), "f"
    assert ctx.save(state)
    assert isinstance(state["weights"], np.ndarray)  # the caller's state is left as it was
    retry = context_for(RecordingTrial(), 32)
    retry._store, retry._fingerprint = CheckpointStore(tmp_path / "trial", resume=True), "f"
    restored = retry.restore()
    assert restored is not None and set(restored) == set(state)
    assert restored["weights"].dtype == np.float32
    np.testing.assert_array_equal(restored["weights"], state["weights"])
    assert restored["rng"] == state["rng"]
    assert type(restored["best"]) is np.float64 and restored["best"] == 0.25
    assert type(restored["steps"]) is np.int64 and restored["steps"] == 7
    assert torch.equal(restored["tensor"], state["tensor"])
    history = restored["nested"]["history"]
    assert history[0].dtype == np.int16 and history[0].tolist() == [1, 2]
    assert type(history[1]) is tuple and type(history[1][0]) is np.bool_ and history[1][1] == "x"
    assert type(restored["ordered"]) is OrderedDict and restored["ordered"]["b"] == 1.5
    assert restored["empty"].shape == (0, 3) and restored["empty"].dtype == np.uint8


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*/config.yaml")), ids=str)
def test_every_example_config_loads_and_its_function_imports(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jsonschema

    from hpo.config.json_schema import config_schema
    from hpo.config.loader import load_config
    from hpo.plugins.entrypoint import load_entrypoint
    from hpo.plugins.loading import load_plugin, load_user_code
    from hpo.trainer.tasks import is_task_path

    monkeypatch.setattr(sys, "path", list(sys.path))
    config = load_config(path)
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    jsonschema.validate(raw, config_schema(), cls=jsonschema.Draft7Validator)
    plugins = {
        "search_space": config.search_space_function,
        "metrics": config.metrics,
        "task": config.task if is_task_path(config.task) else None,
        "model.factory": config.model.factory,
    }
    for key, spec in plugins.items():  # a plug-in example's functions import too
        if spec is not None:
            assert callable(load_plugin(spec, config.base_dir, key))
    load_user_code(config)  # a task class is a Task, with the study's metric
    if config.training.entrypoint is None:
        assert any(plugins.values()), f"{path}: an example of your own code names none"
        return
    assert callable(load_entrypoint(config.training.entrypoint, config.base_dir))
    # Without the entrypoint, hpo's own metrics and settings apply: the schema says so.
    del raw["training"]["entrypoint"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, config_schema(), cls=jsonschema.Draft7Validator)
