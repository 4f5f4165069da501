"""A saved model's predictions: its folder read (a whole model, or a LoRA adapter on its base), its
task and labels found, rows tokenized as in training and run forward in batches (on the GPU
where there is one), and each row's answer as its task gives it.

What a folder says of itself: `hpo_inference.json` (written beside every kept model since
issue 44: the task, the text columns, max_length, the multi-label threshold), else the retrain's
model card (its task), else config.json (its head's class and problem_type); the label names
are config.json's id2label.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hpo.trainer.batching import collate, eval_batches
from hpo.trainer.config import ModelConfig
from hpo.trainer.data import TokenizedSplit, flat_split
from hpo.trainer.errors import DataError, ModelError
from hpo.trainer.model import absolute_positions, check_weights, load_tokenizer, resolve_location
from hpo.trainer.model_factory import logits_of
from hpo.trainer.peft_adapters import ADAPTER_CONFIG, is_adapter_folder
from hpo.trainer.tasks import TASKS, auto_model_class
from hpo.trainer.text_window import cut_words, heads, window_chars

if TYPE_CHECKING:
    from hpo.trainer.config import TrainJob

log = logging.getLogger(__name__)

SETTINGS_FILE = "hpo_inference.json"
CARD_FILE = "hpo_model_card.json"  # hpo retrain's model card (hpo.study.retrain.CARD_JSON)
PREDICTED_TASKS = ("sequence_classification", "multi_label_classification", "regression")
TAGGER = "token_classification"
DEFAULT_MAX_LENGTH = 512  # a folder that names none: what BERT-like models hold


@dataclass(frozen=True)
class InferenceSettings:
    """What predicting needs that the weights do not say: the task and how rows were read."""

    task: str
    text_column: str = "text"
    text_pair_column: str | None = None
    max_length: int | None = None  # None: what the model and tokenizer hold
    threshold: float = 0.5  # multi-label: a label is predicted from this probability
    label_separator: str = "|"  # multi-label: how a CSV cell joins labels

    @property
    def columns(self) -> list[str]:
        """The input columns a row must have."""
        return [c for c in (self.text_column, self.text_pair_column) if c is not None]


def job_settings(job: TrainJob) -> InferenceSettings:
    """The settings of a training run, to save beside its model."""
    data = job.data
    return InferenceSettings(
        task=job.task,
        text_column=data.text_column,
        text_pair_column=data.text_pair_column,
        max_length=data.max_length,
        threshold=job.training.threshold,
        label_separator=data.label_separator,
    )


def save_settings(folder: Path, settings: InferenceSettings) -> bool:
    """`settings` into `folder` (a best model's); False when the disk refuses (logged: the
    model is kept all the same, and predict then reads its config.json)."""
    try:
        text = json.dumps(asdict(settings), indent=2) + "\n"
        (folder / SETTINGS_FILE).write_text(text, encoding="utf-8")
        return True
    except OSError as e:
        log.warning("%s not written to %s: %s", SETTINGS_FILE, folder, e.strerror or e)
        return False


def read_settings(folder: Path) -> InferenceSettings:
    """What `folder` says of its task and columns (see the module docstring)."""
    saved = _json_file(folder / SETTINGS_FILE)
    if isinstance(saved, dict) and isinstance(saved.get("task"), str):
        known = {k: v for k, v in saved.items() if k in InferenceSettings.__dataclass_fields__}
        problem = _settings_problem(known)
        if problem is not None:  # an edit: said here, not as a TypeError on the first row
            raise ModelError(
                f"model folder {folder}: {SETTINGS_FILE} is damaged ({problem}); copy the "
                "model folder again"
            )
        settings = InferenceSettings(**known)
    else:
        settings = _card_settings(folder)
    if settings.task not in TASKS:  # none said, or a task class of the user's: its head's
        settings = InferenceSettings(**{**asdict(settings), "task": _task_of_head(folder)})
    return settings


def _settings_problem(known: dict[str, Any]) -> str | None:
    """What is wrong with a settings file's values (each of the type hpo writes), or None."""
    for key in ("text_column", "label_separator"):
        if key in known and not (isinstance(known[key], str) and known[key]):
            return f"{key} is {known[key]!r:.40}, not text"
    pair, length = known.get("text_pair_column"), known.get("max_length")
    if not (pair is None or isinstance(pair, str)):
        return f"text_pair_column is {pair!r:.40}, not text"
    if not (length is None or (type(length) is int and length >= 1)):
        return f"max_length is {length!r:.40}, not a number of tokens"
    threshold = known.get("threshold", 0.5)
    if type(threshold) not in (int, float) or not 0 < threshold < 1:
        return f"threshold is {threshold!r:.40}, not a probability between 0 and 1"
    return None


def _card_settings(folder: Path) -> InferenceSettings:
    """What hpo retrain's model card says: the task and the multi-label threshold (the text
    columns are not on it: `text`, the default, is assumed)."""
    card = _json_file(folder / CARD_FILE)
    card = card if isinstance(card, dict) else {}
    task = card.get("task")
    training = card.get("training")
    threshold = training.get("threshold") if isinstance(training, dict) else None
    if not (isinstance(threshold, float) and 0 < threshold < 1):
        threshold = 0.5
    return InferenceSettings(task=task if isinstance(task, str) else "", threshold=threshold)


def _json_file(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(
            f"model folder {path.parent}: {path.name} is unreadable ({e}); copy the model "
            "folder again"
        ) from e


def _task_of_head(folder: Path) -> str:
    """The task a transformers config.json's head was built for."""
    config = _json_file(folder / "config.json")
    if not isinstance(config, dict):
        raise ModelError(
            f"{folder} is not a model folder (no config.json); give the folder hpo retrain or "
            "hpo best --download wrote"
        )
    architectures = " ".join(str(a) for a in config.get("architectures") or [])
    if "TokenClassification" in architectures:
        return TAGGER
    if "CausalLM" in architectures or "LMHead" in architectures:
        return "causal_lm"
    problem = config.get("problem_type")
    if problem in ("multi_label_classification", "regression"):
        return str(problem)
    return "sequence_classification"


class Predictor:
    """A saved model ready to predict: `predict(rows)` answers each row (a dict holding the
    text columns) in the model's task."""

    def __init__(self, folder: Path, device: torch.device, batch_size: int = 32) -> None:
        self.folder = folder
        self.settings = read_settings(folder)
        if self.settings.task not in (*PREDICTED_TASKS, TAGGER):
            raise ModelError(
                f"model {folder} is a {self.settings.task} model: predict labels, scores and "
                "tags, it does not generate text; use transformers' generate() on it"
            )
        self.device, self.batch_size = device, batch_size
        self.model = load_model(folder, self.settings.task).to(device).eval()
        self.tokenizer = load_tokenizer(ModelConfig(name_or_path=str(folder)), self.settings.task)
        id2label = getattr(self.model.config, "id2label", None) or {}
        self.labels: list[str] = (
            [] if self.settings.task == "regression" else [id2label[i] for i in sorted(id2label)]
        )
        self.max_length = self.settings.max_length or self._held_length()
        positions = absolute_positions(self.model.config)
        if positions is not None and self.max_length > positions:  # it would fail on a long row
            raise ModelError(
                f"model folder {folder}: {SETTINGS_FILE} says max_length {self.max_length}, but "
                f"the model holds at most {positions} positions; copy the model folder again"
            )
        self.pad_id = self.tokenizer.pad_token_id or 0

    def _held_length(self) -> int:
        """The longest input the tokenizer and the model both hold."""
        held = [getattr(self.tokenizer, "model_max_length", None)]
        held.append(getattr(self.model.config, "max_position_embeddings", None))
        return min([n for n in held if isinstance(n, int) and n > 1] + [DEFAULT_MAX_LENGTH])

    def predict(self, rows: Sequence[dict[str, Any]], first_row: int = 1) -> list[dict[str, Any]]:
        """Each row's prediction, in order; `first_row`: the number of rows[0], for messages."""
        if not rows:
            return []
        if self.settings.task == TAGGER:
            return self._tag(rows, first_row)
        split = self._encode(rows, first_row)
        logits = self._logits(split)
        return [self._answer(row_logits) for row_logits in logits]

    # -- rows into tokens ----------------------------------------------------------------------

    def _texts(self, rows: Sequence[dict[str, Any]], column: str, first_row: int) -> list[str]:
        texts = []
        for number, row in enumerate(rows, start=first_row):
            value = row.get(column) if isinstance(row, dict) else None
            if not isinstance(value, str):
                what = "has no" if value is None else f"holds {type(value).__name__}, not"
                raise DataError(
                    f"row {number} {what} text in column {column!r}; give every row its text"
                )
            texts.append(value)
        return texts

    def _encode(self, rows: Sequence[dict[str, Any]], first_row: int) -> TokenizedSplit:
        chars = window_chars(self.tokenizer, self.max_length)
        texts = heads(self._texts(rows, self.settings.text_column, first_row), chars)
        pair = self.settings.text_pair_column
        pairs = None if pair is None else heads(self._texts(rows, pair, first_row), chars)
        encoded = self.tokenizer(
            texts, pairs, truncation=True, max_length=self.max_length, padding=False
        )
        return flat_split(encoded["input_ids"], encoded.get("token_type_ids"))

    def _words(self, rows: Sequence[dict[str, Any]], first_row: int) -> list[list[str]]:
        column = self.settings.text_column
        chars = window_chars(self.tokenizer, self.max_length)
        found = []
        for number, row in enumerate(rows, start=first_row):
            value = row.get(column) if isinstance(row, dict) else None
            words = value.split() if isinstance(value, str) else value
            if (
                not isinstance(words, list)
                or not words
                or not all(isinstance(w, str) for w in words)
            ):
                raise DataError(
                    f"row {number} has no words in column {column!r}; give a list of words "
                    "(JSONL), or the words separated by spaces (CSV)"
                )
            found.append(cut_words(words, chars))
        return found

    # -- the forward ---------------------------------------------------------------------------

    @torch.inference_mode()
    def _logits(self, split: TokenizedSplit) -> list[np.ndarray]:
        """Every row's logits, in row order: batches in length order pad the least."""
        split.labels = np.zeros(len(split), dtype=np.int64)  # collate carries a label column
        out: list[np.ndarray] = [np.empty(0)] * len(split)
        for indices in eval_batches(split.lengths, self.batch_size):
            batch = collate(split, indices, self.pad_id)
            batch.pop("labels")
            inputs = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            logits = logits_of(self.model(**inputs)).float().cpu().numpy()
            for position, index in enumerate(indices):
                out[int(index)] = logits[position]
        return out

    def _answer(self, logits: np.ndarray) -> dict[str, Any]:
        task = self.settings.task
        if task == "regression":
            return {"value": float(logits.reshape(-1)[0])}
        if task == "multi_label_classification":
            chances = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
            chosen = [n for n, p in zip(self.labels, chances, strict=True) if p >= self.threshold]
            return {"labels": chosen, "probabilities": self._named(chances)}
        chances = _softmax(logits)
        return {
            "label": self.labels[int(np.argmax(chances))],
            "probabilities": self._named(chances),
        }

    @property
    def threshold(self) -> float:
        return self.settings.threshold

    def _named(self, chances: np.ndarray) -> dict[str, float]:
        return {name: float(p) for name, p in zip(self.labels, chances, strict=True)}

    def _tag(self, rows: Sequence[dict[str, Any]], first_row: int) -> list[dict[str, Any]]:
        """A tag per word (its first sub-token's, as training scored it) and its probability;
        None for the words max_length cut off."""
        words = self._words(rows, first_row)
        encoded = self.tokenizer(
            words, is_split_into_words=True, truncation=True, max_length=self.max_length
        )
        split = flat_split(encoded["input_ids"], encoded.get("token_type_ids"))
        answers = []
        for i, logits in enumerate(self._logits(split)):
            tags: list[str | None] = [None] * len(words[i])
            scores: list[float | None] = [None] * len(words[i])
            previous = None
            for position, word in enumerate(encoded.word_ids(i)):
                if word is not None and word != previous:
                    chances = _softmax(logits[position])
                    best = int(np.argmax(chances))
                    tags[word], scores[word] = self.labels[best], float(chances[best])
                previous = word
            answers.append({"tags": tags, "scores": scores})
        return answers


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits.astype(np.float64) - np.max(logits))
    return shifted / shifted.sum()


# -- the folder's model ------------------------------------------------------------------------

ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
STATE_DICT_FILE = "model_state_dict.pt"  # a module of the user's factory (trainer.checkpoint)


def load_model(folder: Path, task: str, merge: bool = True) -> torch.nn.Module:
    """The model of `folder` with `task`'s head: a whole model, or a LoRA adapter merged into
    its base (one forward's cost, as a whole model; `merge` False: peft's model, the adapter
    kept apart, so that other adapter weights can be loaded into it). ModelError naming what
    is missing."""
    if is_adapter_folder(folder):
        return _adapter_model(folder, task, merge)
    if (folder / STATE_DICT_FILE).is_file() and not (folder / "config.json").is_file():
        raise ModelError(
            f"{folder} holds a module of your model.factory (its state_dict), not a "
            "transformers model: build it with your factory and load the state_dict (see "
            "HPO_MODEL.md there)"
        )
    check_weights(folder, str(folder))
    try:
        model: torch.nn.Module = auto_model_class(task).from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ModelError(f"cannot load the model in {folder}: {_first_line(e)}") from e
    return model


def _adapter_model(folder: Path, task: str, merge: bool = True) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoConfig

    if not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        raise ModelError(
            f"{folder} has a LoRA adapter's config but no weights ({ADAPTER_WEIGHTS[0]}); "
            "download the model again"
        )
    adapter = _json_file(folder / ADAPTER_CONFIG)
    if not isinstance(adapter, dict):
        raise ModelError(
            f"{folder}: {ADAPTER_CONFIG} is not a LoRA adapter's config; download the model again"
        )
    base = resolve_location(str(adapter.get("base_model_name_or_path")))
    try:
        config = AutoConfig.from_pretrained(folder)  # the base's config with the task's head
        model = auto_model_class(task).from_pretrained(base, config=config)
        adapted = PeftModel.from_pretrained(model, folder)
        merged: torch.nn.Module = adapted.merge_and_unload() if merge else adapted
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ModelError(
            f"cannot load the LoRA adapter in {folder} on its base model {base!r}: "
            f"{_first_line(e)[:300]}; is the base model on this host? (hpo best --download "
            "--merge writes a model that needs no base)"
        ) from e
    return merged


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
