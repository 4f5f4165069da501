"""Plug-ins of hpo's trainer by import path: `task: package.module:ClassName` (a task class of the
user's) and `model.factory: package.module:name` (a function that builds the model). The config
rules, the checks before any trial, what the model's forward may return, each way user code can
fail in a trial, and examples/custom_task through `hpo run` and `hpo retrain`."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
import yaml

from hpo.config.loader import parse_config
from hpo.errors import ConfigError
from tests.conftest import MINILM_TOKENIZER, REPO, easy_rows, tiny_config, write_config, write_csv

EXAMPLE = REPO / "examples" / "custom_task"


@pytest.fixture
def user_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """tmp_path as the folder of the user's modules: what they import is forgotten after."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        module = sys.modules[name]
        if str(getattr(module, "__file__", "") or "").startswith(str(tmp_path)):
            del sys.modules[name]


def plugin_config(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    train = write_csv(tmp_path / "train.csv", easy_rows(32, 1))
    evaluation = write_csv(tmp_path / "eval.csv", easy_rows(16, 2))
    raw = tiny_config(train, evaluation)
    for name, value in sections.items():
        raw[name] = {**raw[name], **value} if isinstance(value, dict) else value
    return raw


def problems_of(raw: dict[str, Any], tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, base_dir=tmp_path)
    return str(caught.value)


# -- the config ------------------------------------------------------------------------------


def test_task_and_factory_by_import_path_in_the_config(tmp_path: Path) -> None:
    raw = plugin_config(tmp_path, task="my_task:Focal", study={"metric": "macro_f1"})
    raw["model"] = {"factory": "my_model:build", "tokenizer": raw["model"]["tokenizer"]}
    config = parse_config(raw, base_dir=tmp_path)
    assert config.task == "my_task:Focal" and config.model.factory == "my_model:build"
    assert config.study.objectives == ["macro_f1"]
    # a metric of the task class's own: its direction must be given
    raw = plugin_config(tmp_path, task="my_task:Focal", study={"metric": "kappa"})
    assert "study.direction: got null; kappa is not hpo's" in problems_of(raw, tmp_path)
    raw["study"]["direction"] = "maximize"
    assert parse_config(raw, base_dir=tmp_path).study.resolved_directions == ["maximize"]
    # the factory gets model.config as it is (no transformers model_type needed)
    raw = plugin_config(tmp_path, model={"factory": "my_model:build", "config": {"width": 8}})
    assert parse_config(raw, base_dir=tmp_path).model.config == {"width": 8}


def test_task_and_factory_config_problems(tmp_path: Path) -> None:
    raw = plugin_config(tmp_path, task="my_task.Focal")
    assert "task: got 'my_task.Focal'; must be one of sequence_classification" in (
        problems_of(raw, tmp_path)
    )
    assert "or your task class as `package.module:ClassName`" in problems_of(raw, tmp_path)
    raw = plugin_config(tmp_path, model={"factory": "my_model.build"})
    assert "model.factory: got 'my_model.build'; must be your function as " in (
        problems_of(raw, tmp_path)
    )
    raw = plugin_config(tmp_path)
    raw["model"] = {"factory": "my_model:build"}
    assert "model.tokenizer: is required with a factory" in problems_of(raw, tmp_path)
    raw = plugin_config(tmp_path)
    raw["model"] = {"factory": "m:b", "name_or_path": str(tmp_path), "peft": {"method": "lora"}}
    assert "model.peft: got 'lora'; not with a factory" in problems_of(raw, tmp_path)


def test_the_json_schema_takes_a_task_class_and_a_factory(tmp_path: Path) -> None:
    import jsonschema

    from hpo.config.json_schema import config_schema

    def valid(raw: dict[str, Any]) -> bool:
        return jsonschema.Draft7Validator(config_schema()).is_valid(raw)

    study = {"metric": "kappa", "direction": "maximize"}
    raw = plugin_config(tmp_path, task="my_task:Kappa", study=study)
    raw["model"] = {"factory": "my_model:build", "tokenizer": "tok"}
    assert valid(raw)
    raw["task"] = "sequence_classification"  # kappa is no metric of hpo's own tasks
    assert not valid(raw)


TASKS = """\
import torch
from hpo.trainer.tasks import TaskInfo
from hpo.trainer.tasks.base import Task
from hpo.trainer.tasks.sequence_classification import SequenceClassification


class Focal(SequenceClassification):
    pass


class Kappa(SequenceClassification):
    catalog = TaskInfo("kappa", "", {"kappa": "maximize", "eval_loss": "minimize"}, "kappa",
                       "AutoModelForSequenceClassification", "a task with a metric of its own")


class Unfinished(Task):
    name = "sequence_classification"


class Silent(SequenceClassification):
    name = "not_a_built_in_task"


class NotATask:
    pass


def not_a_class():
    pass
"""


def check_task(tmp_path: Path, spec: str, **study: Any) -> None:
    from hpo.plugins.loading import check_task_class

    (tmp_path / "tasks_mod.py").write_text(TASKS)
    raw = plugin_config(tmp_path, task=spec, study=study or {"metric": "accuracy"})
    check_task_class(parse_config(raw, base_dir=tmp_path))


def test_a_task_class_is_checked_before_any_trial(user_modules: Path) -> None:
    tmp_path = user_modules
    check_task(tmp_path, "tasks_mod:Focal")  # inherits sequence classification's catalog
    check_task(tmp_path, "tasks_mod:Kappa", metric="kappa", direction="maximize")
    for spec, study, said in [
        (
            "tasks_mod:NotATask",
            {},
            "task: tasks_mod:NotATask is the class NotATask; expected a "
            "subclass of trainer.tasks.base.Task",
        ),
        (
            "tasks_mod:not_a_class",
            {},
            "task: tasks_mod:not_a_class is function; expected a "
            "subclass of trainer.tasks.base.Task",
        ),
        (
            "tasks_mod:Unfinished",
            {},
            "task: tasks_mod:Unfinished leaves abstract methods of Task "
            "unwritten: chance_levels, encode, eval_outputs, label_names, loss_sum, metrics, "
            "worst_case_labels",
        ),
        (
            "tasks_mod:Silent",
            {},
            "task: tasks_mod:Silent says nothing of its metrics: subclass "
            "a built-in task, or set catalog = TaskInfo(...)",
        ),
        ("tasks_mod:Missing", {}, "task: tasks_mod:Missing: module tasks_mod ("),
        (
            "tasks_mod:Kappa",
            {"metric": "accuracy"},
            "study.metric: the task tasks_mod:Kappa has "
            "no metric accuracy; its metrics: kappa, eval_loss",
        ),
        (
            "tasks_mod:Kappa",
            {"metric": "kappa", "direction": "minimize"},
            "study.direction: metric kappa of the task tasks_mod:Kappa must be maximized",
        ),
    ]:
        with pytest.raises(ConfigError) as caught:
            check_task(tmp_path, spec, **study)
        assert said in str(caught.value), spec


def test_a_task_module_that_does_not_import_is_one_line_before_any_trial(
    user_modules: Path, hpo_main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    tmp_path = user_modules
    (tmp_path / "broken_task.py").write_text("import focal_losses_that_are_not_there\n")
    raw = plugin_config(tmp_path, task="broken_task:Focal")
    write_config(tmp_path / "config.yaml", raw)
    url = f"sqlite:///{tmp_path / 's.db'}"
    code = hpo_main(
        ["run", "--config", str(tmp_path / "config.yaml"), "--study", "s", "--storage", url]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert (
        err.strip()
        .splitlines()[-1]
        .endswith(
            "task: broken_task:Focal: module broken_task does not import (ModuleNotFoundError: No "
            "module named 'focal_losses_that_are_not_there')"
        )
    )
    assert "Traceback" not in err
    assert "s" not in optuna.get_all_study_names(url)  # no trial, no study


# -- the model factory -----------------------------------------------------------------------


def test_logits_of_each_form_a_forward_may_return() -> None:
    from transformers.modeling_outputs import SequenceClassifierOutput

    from hpo.trainer.model_factory import ModelOutputError, logits_of

    logits = torch.ones(2, 3)
    for output in (
        logits,
        {"logits": logits, "loss": None},
        (torch.tensor(0.5), logits),
        (logits,),
        SequenceClassifierOutput(logits=logits),
    ):
        assert logits_of(output) is logits
    for output in ({"scores": logits}, (1, 2, 3), None, "logits"):
        with pytest.raises(
            ModelOutputError,
            match="the model's forward returned .*; expected "
            "logits: a tensor, an object or dict with `logits`",
        ):
            logits_of(output)


FACTORY = """\
import torch


class Bag(torch.nn.Module):
    def __init__(self, vocab_size, num_labels):
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(vocab_size, 8)
        self.head = torch.nn.Linear(8, num_labels)

    def forward(self, input_ids, attention_mask, **_):
        return {"logits": self.head(self.embed(input_ids, per_sample_weights=None))}


SEEN = []


def build(request):
    SEEN.append(request)
    return Bag(request.vocab_size, request.num_labels)


def wrong(request):
    return [Bag(request.vocab_size, request.num_labels)]


def broken(request):
    return helper_that_breaks()


def helper_that_breaks():
    raise RuntimeError("factory broke")
"""


def factory_job(tmp_path: Path, spec: str) -> Any:
    from hpo.trainer.config import DataConfig, ModelConfig, TrainingConfig, TrainJob

    (tmp_path / "factory_mod.py").write_text(FACTORY)
    sys.path.insert(0, str(tmp_path))
    model = ModelConfig(factory=spec, tokenizer=MINILM_TOKENIZER, dropout=0.2)
    return TrainJob(
        DataConfig(max_length=16), model, TrainingConfig(learning_rate=3e-4, batch_search_max=16)
    )


def test_the_factory_builds_the_model_from_what_hpo_hands_it(
    user_modules: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.trainer.batch_finder import find_physical_batch_size
    from hpo.trainer.memory import BUDGET_ENV
    from hpo.trainer.model import build_model, model_fingerprint
    from hpo.trainer.model_factory import ModelFactoryError

    job = factory_job(user_modules, "factory_mod:build")
    model = build_model(job.model, ["neg", "pos"], seed=0, job=job)
    seen = sys.modules["factory_mod"].SEEN[-1]
    assert type(model).__name__ == "Bag" and seen.num_labels == 2
    assert seen.label_names == ["neg", "pos"] and seen.max_length == 16
    assert seen.model.dropout == 0.2 and seen.training.learning_rate == 3e-4  # the trial's
    assert seen.vocab_size == model.embed.num_embeddings == 30522  # the tokenizer's
    again = build_model(job.model, ["neg", "pos"], seed=0, job=job)
    assert torch.equal(again.head.weight, model.head.weight)  # seeded: each trial starts alike
    assert model_fingerprint(job.model) != model_fingerprint(factory_job(user_modules, "m:x").model)
    # the batch finder probes the factory's model (a simulated memory budget on the CPU)
    monkeypatch.setenv(BUDGET_ENV, str(64 * 2**20))
    search = find_physical_batch_size(job, ["neg", "pos"], torch.device("cpu"))
    assert search.chosen >= 1 and search.probes
    with pytest.raises(
        ModelFactoryError,
        match=r"factory_mod:wrong returned list; expected a "
        r"torch.nn.Module \(a transformers model, or a module whose forward "
        "returns logits",
    ):
        build_model(factory_job(user_modules, "factory_mod:wrong").model, ["a", "b"], seed=0)
    with pytest.raises(
        ModelFactoryError, match="factory_mod:broken raised RuntimeError: factory broke"
    ) as caught:
        build_model(factory_job(user_modules, "factory_mod:broken").model, ["a", "b"], seed=0)
    assert isinstance(caught.value.__cause__, RuntimeError)  # the user's traceback goes with it


def test_a_module_that_is_no_transformers_model_is_saved_as_its_state_dict(
    user_modules: Path,
) -> None:
    from hpo.trainer.checkpoint import CheckpointStore
    from hpo.trainer.model import build_model

    job = factory_job(user_modules, "factory_mod:build")
    model = build_model(job.model, ["neg", "pos"], seed=0, job=job)
    store = CheckpointStore(user_modules / "trial", resume=False)
    assert store.save_best_model(model)
    saved = store.best_model_path
    assert "model.load_state_dict(torch.load('model_state_dict.pt'" in (
        (saved / "HPO_MODEL.md").read_text()
    )
    fresh = build_model(job.model, ["neg", "pos"], seed=1, job=job)
    fresh.load_state_dict(torch.load(saved / "model_state_dict.pt", weights_only=True))
    assert torch.equal(fresh.head.weight, model.head.weight)


def test_a_factory_model_stopped_mid_run_resumes_to_the_same_weights(user_modules: Path) -> None:
    from hpo.trainer.checkpoint import CheckpointStore
    from hpo.trainer.config import DataConfig, TrainingConfig
    from hpo.trainer.loop import Trainer
    from hpo.trainer.model import load_tokenizer
    from hpo.trainer.tasks import prepare_data

    job = factory_job(user_modules, "factory_mod:build")
    train = write_csv(user_modules / "train.csv", easy_rows(32, 1))
    evaluation = write_csv(user_modules / "eval.csv", easy_rows(16, 2))
    job.data = DataConfig(train_file=str(train), eval_file=str(evaluation), max_length=16)
    # 32 examples / 8 = 4 steps, evaluations at steps 2 and 4; stopped after the first
    job.training = TrainingConfig(
        physical_batch_size=4, effective_batch_size=8, epochs=1, evals_per_epoch=2, device="cpu"
    )
    data = prepare_data(job.data, load_tokenizer(job.model), job.task, job.training)
    reference = Trainer(job, data)
    reference.fit()
    steps: list[int] = []
    stopped = Trainer(job, data).fit(
        checkpoints=CheckpointStore(user_modules / "t"),
        should_stop=lambda: len(steps) >= 1,
        on_evaluation=lambda e: steps.append(e.optimizer_step) or None,
    )
    assert stopped.status == "interrupted" and stopped.optimizer_steps == 3  # it checkpoints
    resumed = Trainer(job, data)
    result = resumed.fit(checkpoints=CheckpointStore(user_modules / "t", resume=True))
    assert result.resumed_at_step == 3 and result.status == "completed"
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name


# -- user code that fails inside a trial -----------------------------------------------------

FRAGILE = """\
from transformers import BertConfig, BertForSequenceClassification

from hpo.trainer.tasks.sequence_classification import SequenceClassification


class Fragile(SequenceClassification):
    def loss_sum(self, logits, labels, class_weights=None, label_smoothing=0.0):
        if self.training.learning_rate == 0.003:
            helper_that_breaks()
        return super().loss_sum(logits, labels, class_weights, label_smoothing)


def helper_that_breaks():
    raise ValueError("loss broke")


def build(request):
    if request.training.learning_rate == 0.004:
        raise RuntimeError("factory broke")
    if request.training.learning_rate == 0.005:
        return "not a model"
    config = BertConfig(vocab_size=request.vocab_size, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                        num_labels=request.num_labels)
    return BertForSequenceClassification(config)  # a transformers model, from a factory
"""


@pytest.mark.slow
def test_user_code_that_fails_ends_its_trial_and_the_worker_goes_on(
    user_modules: Path, hpo_main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    """One worker, a trial per way: the task's loss raises, the factory raises, the factory
    returns a string (each FAIL, named, the user's traceback kept where they raised); the last
    trains a transformers model the factory built, saved as transformers saves it."""
    tmp_path = user_modules
    (tmp_path / "fragile.py").write_text(FRAGILE)
    rates = [0.003, 0.004, 0.005, 0.002]
    raw = plugin_config(
        tmp_path,
        task="fragile:Fragile",
        study={
            "n_trials": 4,
            "trial_isolation": "none",
            "enqueue": [{"learning_rate": r} for r in rates],
        },
        search_space={
            "learning_rate": {"type": "categorical", "choices": rates},
            "effective_batch_size": {"type": "categorical", "choices": [8]},
        },
        training={"epochs": 1, "evals_per_epoch": 1},
    )
    raw["model"] = {"factory": "fragile:build", "tokenizer": raw["model"]["tokenizer"]}
    write_config(tmp_path / "config.yaml", raw)
    url = f"sqlite:///{tmp_path / 's.db'}"
    code = hpo_main(
        ["run", "--config", str(tmp_path / "config.yaml"), "--study", "s", "--storage", url]
    )
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    study = optuna.load_study(study_name="s", storage=url)
    trials = {t.params["learning_rate"]: t for t in study.trials}
    fail = optuna.trial.TrialState.FAIL
    loss = trials[0.003]
    assert loss.state == fail
    assert "fragile:Fragile: ValueError: loss broke" in loss.user_attrs["fail_reason"]
    assert 'fragile.py", line 14, in helper_that_breaks' in loss.user_attrs["traceback"]
    assert loss.user_attrs["traceback"].splitlines()[1].strip().startswith(f'File "{tmp_path}')
    assert 'fragile.py", line 14, in helper_that_breaks' in err  # the worker's log
    raised = trials[0.004]
    assert raised.state == fail
    assert "fragile:build: RuntimeError: factory broke" in raised.user_attrs["fail_reason"]
    assert 'fragile.py", line 19, in build' in raised.user_attrs["traceback"]
    wrong = trials[0.005]
    assert wrong.state == fail
    assert wrong.user_attrs["fail_reason"].startswith(
        "fragile:build returned str; expected a torch.nn.Module"
    )
    good = trials[0.002]
    assert good.state == optuna.trial.TrialState.COMPLETE, good.user_attrs
    assert (Path(good.user_attrs["best_model"]) / "config.json").is_file()  # save_pretrained


# -- examples/custom_task --------------------------------------------------------------------


def test_the_examples_focal_loss_is_cross_entropy_at_gamma_zero() -> None:
    sys.path.insert(0, str(EXAMPLE))
    try:
        from focal import FocalLoss  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLE))
    from hpo.trainer.config import DataConfig, TrainingConfig
    from hpo.trainer.tasks.sequence_classification import SequenceClassification

    logits = torch.tensor([[2.0, -1.0], [0.1, 0.3], [-2.0, 2.0]])
    labels = torch.tensor([0, 0, 1])
    plain = SequenceClassification(DataConfig(), TrainingConfig()).loss_sum(logits, labels)
    task = FocalLoss(DataConfig(), TrainingConfig())
    focal = task.loss_sum(logits, labels)
    assert 0 < focal < plain  # easy examples count less
    task.gamma = 0.0
    assert torch.allclose(task.loss_sum(logits, labels), plain)
    del sys.modules["focal"]


@pytest.mark.slow
def test_example_custom_task_runs_and_retrains(
    tmp_path: Path, hpo_main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/custom_task, cut to one trial of one epoch on the tests' tiny data: the focal
    task and the encoder factory train; the best model is the encoder's state_dict, which hpo
    best and hpo retrain's card say how to load."""
    for name in ("config.yaml", "focal.py", "encoder.py"):
        shutil.copy(EXAMPLE / name, tmp_path / name)
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    url = f"sqlite:///{tmp_path / 's.db'}"
    raw["study"].update(n_trials=1, storage=url, trial_isolation="none")
    train = write_csv(tmp_path / "train.csv", easy_rows(48, 1))
    evaluation = write_csv(tmp_path / "eval.csv", easy_rows(16, 2))
    raw["data"].update(train_file=str(train), eval_file=str(evaluation))
    raw["training"].update(epochs=1, evals_per_epoch=1, device="cpu")
    config = str(write_config(tmp_path / "config.yaml", raw))
    modules = set(sys.modules)
    try:
        assert hpo_main(["run", "--config", config, "--study", "ct"]) == 0
        (trial,) = optuna.load_study(study_name="ct", storage=url).trials
        assert trial.state == optuna.trial.TrialState.COMPLETE, capsys.readouterr().err[-3000:]
        study = optuna.load_study(study_name="ct", storage=url)
        assert study.user_attrs["task"] == "focal:FocalLoss"
        assert study.user_attrs["model_factory"] == "encoder:build"
        saved = Path(trial.user_attrs["best_model"])
        assert (saved / "model_state_dict.pt").is_file() and (saved / "tokenizer.json").is_file()
        capsys.readouterr()
        assert hpo_main(["best", "--study", "ct", "--storage", url]) == 0
        assert "encoder:build(request), then model.load_state_dict(" in capsys.readouterr().out
        out = tmp_path / "final"
        assert (
            hpo_main(
                [
                    "retrain",
                    "--config",
                    config,
                    "--study",
                    "ct",
                    "--top",
                    "1",
                    "--seeds",
                    "1",
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        assert (out / "model_state_dict.pt").is_file() and (out / "HPO_MODEL.md").is_file()
        assert "encoder:build(request)" in (out / "README.md").read_text()
    finally:
        for name in set(sys.modules) - modules:
            if name in ("focal", "encoder"):
                del sys.modules[name]
