"""What a task is: how rows become tensors, which model head, which loss, which metrics, and
the worst-case batch the batch finder probes. One subclass per task, one module each.

The contract with the training loop:
- `encode` turns a table's rows into a `TokenizedSplit`: token ids, and either one target per
  example (`labels`: class ids, numbers or multi-hot rows) or one per token (`token_labels`,
  IGNORE where a token counts for nothing);
- `loss_sum` is the loss *summed* over the units that count (examples, or tokens) and `units`
  how many there are, so that an optimizer step's loss is the sum over all its micro-batches
  divided by the units of the whole step: accumulated micro-batches then give exactly the
  gradient of one large batch, also when micro-batches hold different numbers of tokens;
- `eval_outputs` keeps what the metrics need of one evaluation batch (on the device, small),
  and `metrics` turns them, brought to the host once per evaluation, into named values;
- `prepare_model` may fit a fresh model's head to the training targets before the first step
  (regression: the output's bias at the mean target).

A task of the user's (`task: package.module:ClassName` in hpo's config) is a subclass of one of
these: of a built-in task to change a part (its loss, say), its catalog entry (metrics, their
directions, the model class) then inherited; of `Task` for a new kind of problem, with
`catalog` its own TaskInfo.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
import torch

from hpo.trainer.config import DataConfig, TrainingConfig
from hpo.trainer.data import TokenizedSplit
from hpo.trainer.errors import DataError
from hpo.trainer.labels import text_column
from hpo.trainer.model_factory import logits_of
from hpo.trainer.tasks import TaskInfo, task_info
from hpo.trainer.token_cache import tokenize_texts

IGNORE = -100  # a token label that counts for nothing (transformers' convention too)


class Task(ABC):
    """One kind of problem; an instance holds the settings it reads (data and training)."""

    name: ClassVar[str]
    # What is known of the task: its metrics and their directions, its default metric, the
    # transformers Auto class of its model. None: the built-in task `name`'s catalog entry.
    catalog: ClassVar[TaskInfo | None] = None

    def __init__(self, data: DataConfig, training: TrainingConfig) -> None:
        self.data, self.training = data, training

    @classmethod
    def describe(cls) -> TaskInfo:
        """The task's catalog entry: `catalog`, or the built-in task's it inherits."""
        return cls.catalog if cls.catalog is not None else task_info(cls.name)

    @property
    def info(self) -> TaskInfo:
        return self.describe()

    @classmethod
    def config_name(cls) -> str:
        """How hpo's config names the task: a built-in's name, a user's class by import path."""
        if cls.__module__.startswith("hpo.trainer.tasks."):
            return cls.name
        return f"{cls.__module__}:{cls.__qualname__}"

    # -- data ----------------------------------------------------------------------------------

    def required_columns(self) -> list[str]:
        """Columns every split must have. With the columns the data settings name, they are
        all a table holds: a task that reads another column lists it here."""
        return [self.data.text_column, self.data.label_column]

    @abstractmethod
    def label_names(self, table: dict[str, list[Any]], source: str) -> list[str]:
        """The names of the model's outputs in id order, read from the training table (class
        names, tag names); [] where the outputs are not named (one number, the vocabulary)."""

    @abstractmethod
    def encode(
        self, table: dict[str, list[Any]], source: str, tokenizer: Any, label_names: list[str]
    ) -> TokenizedSplit:
        """Every row of `table` tokenized with its target; DataError naming the row and the fix
        for a row that cannot be used."""

    def cache_parts(self) -> dict[str, Any]:
        """The settings besides the data, tokenizer and label names that decide what `encode`
        returns: part of the token cache's key."""
        return {"task": self.config_name()}

    def check_split(self, split: TokenizedSplit, source: str) -> None:  # noqa: B027
        """A split that encodes but cannot train or score (no counted token, say): DataError.
        Nothing to check by default."""

    # -- model ---------------------------------------------------------------------------------

    @classmethod
    def head_options(cls, label_names: list[str]) -> dict[str, Any]:
        """Settings of the model config that shape its head (num_labels, problem_type, names)."""
        return {
            "num_labels": len(label_names),
            "id2label": dict(enumerate(label_names)),
            "label2id": {name: i for i, name in enumerate(label_names)},
        }

    # Whether the model config takes settings from the tokenizer (`tokenizer_options`): only
    # then does building a model load the tokenizer.
    model_follows_tokenizer: ClassVar[bool] = False

    @classmethod
    def tokenizer_options(cls, tokenizer: Any) -> dict[str, Any]:
        """Settings of the model config that must agree with the tokenizer (the special tokens
        a generating model starts, ends and pads with); read where model_follows_tokenizer."""
        return {}

    @classmethod
    def tokenizer_to_save(cls, tokenizer: Any) -> Any:
        """The tokenizer as it is saved beside the model, for users to load with it."""
        return tokenizer

    def prepare_model(self, model: torch.nn.Module, train: TokenizedSplit) -> None:  # noqa: B027
        """Fit a freshly built model's head to the training targets before its first step (the
        output's bias, say); a resumed run then loads its checkpoint over it. Nothing by
        default."""

    # -- loss ----------------------------------------------------------------------------------

    def logits(
        self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's logits for a batch and the labels they answer: every position's here; a
        task may compute only those its loss counts (and then returns those labels alone)."""
        return logits_of(model(**inputs)), labels

    @abstractmethod
    def loss_sum(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        class_weights: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """The loss summed over the units of a batch that count (see the module docstring)."""

    def units(self, labels: torch.Tensor) -> torch.Tensor | int:
        """How many units `loss_sum` sums over: examples here, tokens in token tasks (a device
        tensor then, so that counting costs no host sync)."""
        return len(labels)

    def class_weights(self, split: TokenizedSplit, label_names: list[str]) -> np.ndarray | None:
        """The per-class loss weights `training.class_weights` asks for, or None."""
        if self.training.class_weights is not None:
            raise ValueError(f"training.class_weights: the task {self.name} has no classes")
        return None

    # -- evaluation ----------------------------------------------------------------------------

    @abstractmethod
    def eval_outputs(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the metrics need of one evaluation batch; kept on the device until the end."""

    @abstractmethod
    def metrics(
        self, outputs: dict[str, list[np.ndarray]], eval_loss: float, label_names: list[str]
    ) -> dict[str, float]:
        """Every metric of the task (its catalog entry's names) from the evaluation's outputs,
        one array per batch under each name, and its mean loss."""

    @abstractmethod
    def chance_levels(self, split: TokenizedSplit, label_names: list[str]) -> dict[str, float]:
        """What a model that learned nothing scores on `split` (the majority class, the mean
        target, the unigram distribution): the baseline a trial must beat."""

    # -- the batch finder ----------------------------------------------------------------------

    @abstractmethod
    def worst_case_labels(self, size: int, length: int, num_labels: int) -> torch.Tensor:
        """Targets of a batch of `size` examples of `length` tokens that costs the most memory
        (every token counted, in token tasks)."""


def text_columns(
    data: DataConfig, table: dict[str, list[Any]], source: str
) -> tuple[list[str], list[str] | None]:
    """The text and (for pairs) the second text of every row."""
    texts = text_column(table, data.text_column, source, "text_column")
    pairs = None
    if data.text_pair_column is not None:
        pairs = text_column(table, data.text_pair_column, source, "text_pair_column")
    return texts, pairs


def encode_texts(
    data: DataConfig, table: dict[str, list[Any]], source: str, tokenizer: Any
) -> TokenizedSplit:
    """The rows' texts (or text pairs) tokenized, without targets yet."""
    texts, pairs = text_columns(data, table, source)
    return tokenize_texts(tokenizer, texts, pairs, data.max_length)


def missing_target(value: Any) -> bool:
    """A cell that holds no target: None or an empty string. A NaN is a value (JSON's NaN, a
    float column's): it is refused as what it is, a number that is not finite."""
    return value is None or (isinstance(value, str) and value == "")


def check_target_present(values: list[Any], source: str, column: str) -> None:
    for row, value in enumerate(values, start=1):
        if missing_target(value):
            raise DataError(
                f"{source}: row {row} has no value in column {column!r}; fill it in or drop the row"
            )


class TokenTask(Task):
    """A task with a target per token (tags, next tokens): the loss is cross-entropy summed
    over every token whose label is not IGNORE, and its units are those counted tokens."""

    def loss_sum(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        class_weights: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            weight=class_weights,
            ignore_index=IGNORE,
            label_smoothing=label_smoothing,
            reduction="sum",
        )

    def units(self, labels: torch.Tensor) -> torch.Tensor:
        return (labels != IGNORE).sum()  # on the device: counting costs no host sync

    def worst_case_labels(self, size: int, length: int, num_labels: int) -> torch.Tensor:
        return torch.zeros((size, length), dtype=torch.long)  # every token counted


def set_output_bias(model: torch.nn.Module, bias: np.ndarray) -> None:
    """The bias of the model's output layer (its last linear layer with one output per entry of
    `bias`) set to `bias`; a head without a bias is left as it is."""
    heads = [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module.out_features == len(bias)
    ]
    if heads and heads[-1].bias is not None:
        target = heads[-1].bias
        with torch.no_grad():
            target.copy_(torch.as_tensor(bias, dtype=target.dtype, device=target.device))
