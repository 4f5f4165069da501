"""The catalog of tasks: what each built-in task is called, its metrics and their directions, its
default metric and the transformers class that loads its model.

Light on purpose (no torch, no transformers): the config loader checks `task:` and
`study.metric` against it in well under a second. The task classes themselves, the code that
turns rows into tensors and logits into a loss and metrics, live one module per task beside it
(`trainer.tasks.base` says what a task is) and are imported only when a run needs one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.metrics import Direction

if TYPE_CHECKING:
    from trainer.config import DataConfig, TrainingConfig
    from trainer.data import PreparedData
    from trainer.tasks.base import Task

DEFAULT_TASK = "sequence_classification"


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
            },  # fmt: skip
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
            },  # fmt: skip
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
            },  # fmt: skip
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
            },  # fmt: skip
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
    """The catalog entry of task `name`; ValueError naming the tasks there are."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}") from None


def task_class(name: str) -> type[Task]:
    """The class that implements task `name` (its module imported now)."""
    module = importlib.import_module(f"trainer.tasks.{task_info(name).module}")
    cls: type[Task] = module.TASK
    return cls


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
    from trainer.config import TrainingConfig
    from trainer.data import prepare_splits

    return prepare_splits(config, tokenizer, make_task(task, config, training or TrainingConfig()))
