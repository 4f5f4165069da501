"""The catalog of tasks: what each built-in task is called, its metrics and their directions, its
default metric and the transformers class that loads its model.

Light on purpose (no torch, no transformers): the config loader checks `task:` and
`study.metric` against it in well under a second. The task classes themselves, the code that
turns rows into tensors and logits into a loss and metrics, live one module per task beside it
(`hpo.trainer.tasks.base` says what a task is) and are imported only when a run needs one.

A task of the user's is named by import path (`task: package.module:ClassName`): a subclass of
`hpo.trainer.tasks.base.Task`, imported where a run needs it, its catalog entry its `describe()`.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpo.trainer.metrics import Direction

if TYPE_CHECKING:
    from hpo.trainer.config import DataConfig, TrainingConfig
    from hpo.trainer.data import PreparedData
    from hpo.trainer.tasks.base import Task

DEFAULT_TASK = "sequence_classification"
# A task of the user's: `package.module:ClassName` (trainer.config.ENTRYPOINT's form).
TASK_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


class TaskClassError(TypeError):
    """`task: package.module:ClassName` names what is not a task class (the message says what
    it is and what was expected)."""


def is_task_path(name: str) -> bool:
    """Whether `task` names a class of the user's by import path rather than a built-in task."""
    return TASK_PATH.fullmatch(name) is not None


@dataclass(frozen=True)
class TaskInfo:
    """What is known of a task without importing its code."""

    name: str
    module: str  # the module under trainer.tasks whose `TASK` class implements it
    metrics: dict[str, Direction]  # every metric its evaluation reports, with its direction
    default_metric: str
    auto_model: str  # the transformers Auto class that loads its model: AutoModelFor...
    summary: str
    # Settings that mean something only for some tasks: refused (config check) for the others.
    class_weights: bool = False  # training.class_weights
    label_smoothing: bool = True  # training.label_smoothing (cross-entropy losses)
    text_pairs: bool = True  # data.text_pair_column
    prompts: bool = False  # data.prompt_column and data.completion_column
    # Whether rows arrive as words (is_split_into_words): a byte-level BPE tokenizer (RoBERTa,
    # GPT-2) must then put the space before each word that running text has there.
    words: bool = False

    def unused_settings(self) -> list[str]:
        """The settings (dotted paths) that mean nothing for this task: refused when set, and
        when searched."""
        unused = {
            "training.class_weights": not self.class_weights,
            "training.label_smoothing": not self.label_smoothing,
            "data.text_pair_column": not self.text_pairs,
            "data.prompt_column": not self.prompts,
            "data.completion_column": not self.prompts,
        }
        return [path for path, is_unused in unused.items() if is_unused]


TASKS: dict[str, TaskInfo] = {
    info.name: info
    for info in (
        TaskInfo(
            "sequence_classification",
            "sequence_classification",
            {
                "accuracy": "maximize",
                "macro_f1": "maximize",
                "micro_f1": "maximize",
                "roc_auc": "maximize",
                "eval_loss": "minimize",
            },
            "accuracy",
            "AutoModelForSequenceClassification",
            "one class per text or text pair",
            class_weights=True,
        ),
        TaskInfo(
            "multi_label_classification",
            "multi_label",
            {
                "micro_f1": "maximize",
                "macro_f1": "maximize",
                "subset_accuracy": "maximize",
                "eval_loss": "minimize",
            },
            "micro_f1",
            "AutoModelForSequenceClassification",
            "any number of classes per text",
            label_smoothing=False,
        ),
        TaskInfo(
            "regression",
            "regression",
            {
                "mse": "minimize",
                "rmse": "minimize",
                "mae": "minimize",
                "pearson": "maximize",
                "spearman": "maximize",
                "r2": "maximize",
                "eval_loss": "minimize",
            },
            "rmse",
            "AutoModelForSequenceClassification",
            "one number per text",
            label_smoothing=False,
        ),
        TaskInfo(
            "token_classification",
            "token_classification",
            {
                "f1": "maximize",
                "precision": "maximize",
                "recall": "maximize",
                "token_accuracy": "maximize",
                "eval_loss": "minimize",
            },
            "f1",
            "AutoModelForTokenClassification",
            "a tag per word (named entities in BIO tags)",
            text_pairs=False,
            words=True,
        ),
        TaskInfo(
            "causal_lm",
            "causal_lm",
            {"eval_loss": "minimize", "perplexity": "minimize"},
            "eval_loss",
            "AutoModelForCausalLM",
            "next-token prediction on text, or on a completion given a prompt",
            text_pairs=False,
            prompts=True,
        ),
    )
}

# Every metric of every task; a name means the same thing (and direction) in each task.
METRIC_DIRECTIONS: dict[str, Direction] = {
    name: direction for info in TASKS.values() for name, direction in info.metrics.items()
}


def task_info(name: str) -> TaskInfo:
    """The catalog entry of task `name` (a user's task class: what its `describe()` says);
    ValueError naming the tasks there are."""
    if name in TASKS:
        return TASKS[name]
    if is_task_path(name):
        return task_class(name).describe()
    raise ValueError(
        f"unknown task {name!r}; tasks: {', '.join(TASKS)}, or your task class as "
        "`package.module:ClassName`"
    )


def task_class(name: str) -> type[Task]:
    """The class that implements task `name` (its module imported now). A user's class by
    import path: its module must be importable (hpo puts the config's folder on sys.path);
    TaskClassError when the name is not a subclass of trainer.tasks.base.Task."""
    if is_task_path(name):
        return _user_task_class(name)
    module = importlib.import_module(f"hpo.trainer.tasks.{task_info(name).module}")
    cls: type[Task] = module.TASK
    return cls


def _user_task_class(spec: str) -> type[Task]:
    from hpo.trainer.tasks.base import Task

    module_name, _, class_name = spec.partition(":")
    found = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(found, type) and issubclass(found, Task)):
        what = f"the class {found.__name__}" if isinstance(found, type) else type(found).__name__
        raise TaskClassError(
            f"{spec} is {what}; expected a subclass of trainer.tasks.base.Task (e.g. of "
            "hpo.trainer.tasks.sequence_classification.SequenceClassification)"
        )
    if getattr(found, "__abstractmethods__", None):
        missing = ", ".join(sorted(found.__abstractmethods__))
        raise TaskClassError(f"{spec} leaves abstract methods of Task unwritten: {missing}")
    try:
        info = found.describe()
    except (ValueError, AttributeError) as e:  # no catalog, and no built-in task's name
        raise TaskClassError(
            f"{spec} says nothing of its metrics: subclass a built-in task, or "
            "set catalog = TaskInfo(...) on the class"
        ) from e
    if not isinstance(info, TaskInfo) or info.default_metric not in info.metrics:
        raise TaskClassError(
            f"{spec}: describe() returned {info!r}; expected a "
            "hpo.trainer.tasks.TaskInfo with its metrics and a default_metric among "
            "them"
        )
    return found


def make_task(name: str, data: DataConfig, training: TrainingConfig) -> Task:
    """An instance of task `name` for these settings."""
    return task_class(name)(data, training)


def auto_model_class(name: str) -> Any:
    """The transformers Auto class that builds and loads task `name`'s model."""
    import transformers

    return getattr(transformers, task_info(name).auto_model)


def prepare_data(
    config: DataConfig,
    tokenizer: Any,
    task: str = DEFAULT_TASK,
    training: TrainingConfig | None = None,
) -> PreparedData:
    """Both splits of `config` read, checked and tokenized for `task` (cached on disk)."""
    from hpo.trainer.config import TrainingConfig
    from hpo.trainer.token_cache import prepare_splits

    return prepare_splits(config, tokenizer, make_task(task, config, training or TrainingConfig()))
