"""Training throughput of one trial across 1, 2, 4 ranks (training.distributed, trainer.launch)
against one process: the same model, data and batch per rank (weak scaling). NCCL on GPUs, gloo on
the CPU (where the ranks share the cores: it checks the path, it measures no speed-up).
Run: .venv/bin/python bench/distributed_scaling.py [--config FILE] [--ranks 1,2,4] [--steps 20]
[--bucket-mb 0,25] (the gradient all-reduce: one per parameter (0), or in buckets of 25 MB)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

from hpo.config.loader import load_config
from hpo.config.search_paths import with_params
from hpo.trainer import device as dev
from hpo.trainer.config import DistributedSettings, TrainJob
from hpo.trainer.data import PreparedData
from hpo.trainer.distributed import BUCKET_MB_ENV
from hpo.trainer.launch import train_distributed
from hpo.trainer.loop import train
from hpo.trainer.model import load_tokenizer
from hpo.trainer.result import TrainResult
from hpo.trainer.tasks import prepare_data

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--ranks", default="1,2,4", help="rank counts to measure, e.g. 1,2,4")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps timed per run")
    parser.add_argument("--batch-per-rank", type=int, default=32, help="examples per rank a step")
    parser.add_argument("--physical-batch-size", type=int, default=32)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--repeats", type=int, default=1, help="runs per rank count (median)")
    parser.add_argument(
        "--bucket-mb", default="25", help="gradient bucket sizes to compare (0: per parameter)"
    )
    parser.add_argument(
        "--threads", type=int, help="CPU threads of one process; each of N ranks gets 1/N"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ranks = [int(n) for n in args.ranks.split(",")]
    device = dev.resolve_device(args.device)
    if device.type == "cuda" and max(ranks) > torch.cuda.device_count():
        print(f"{max(ranks)} ranks asked, {torch.cuda.device_count()} GPUs here", file=sys.stderr)
        return 2
    job = with_params(load_config(args.config), {})
    training = dataclasses.replace(
        job.training,
        device=args.device,
        physical_batch_size=args.physical_batch_size,
        max_steps=args.steps,
        evals_per_epoch=1,
        early_stopping_patience=None,
    )
    job = dataclasses.replace(job, training=training)
    data = prepare_data(job.data, load_tokenizer(job.model, job.task), job.task, job.training)
    print(
        f"{dev.device_name(device)}; {args.config}; {args.batch_per_rank} examples per rank a "
        f"step, physical {args.physical_batch_size}, {args.steps} steps; load "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    # Untimed: the first run pays for loading kernels and warming caches.
    warm_up = dataclasses.replace(job, training=dataclasses.replace(job.training, max_steps=2))
    measure(warm_up, data, 1, args.batch_per_rank)
    baseline: float | None = None
    for n in ranks:
        for bucket_mb in args.bucket_mb.split(",") if n > 1 else ["-"]:
            os.environ[BUCKET_MB_ENV] = bucket_mb if n > 1 else "25"  # read by each rank
            results = [measure(job, data, n, args.batch_per_rank) for _ in range(args.repeats)]
            rate = statistics.median(r.samples_per_s for r in results)
            baseline = baseline or (rate if n == 1 else None)
            buckets = f"buckets {bucket_mb:>3} MB" if n > 1 else " " * 14
            line = f"{n} rank{'s' if n > 1 else ' '} {buckets}: {rate:9.1f} samples/s"
            if baseline:
                line += f"  {rate / baseline:5.2f}x one process, {rate / baseline / n:4.0%} linear"
            print(f"{line}  [{results[0].device_name}]")
    return 0


def measure(job: TrainJob, data: PreparedData, ranks: int, batch_per_rank: int) -> TrainResult:
    """One run at `ranks` (1: trainer.loop.train in this process). Samples/s counts training
    only (TrainResult.train_s: evaluation and startup are not in it)."""
    settings = DistributedSettings(ranks) if ranks > 1 else None
    training = dataclasses.replace(
        job.training, effective_batch_size=batch_per_rank * ranks, distributed=settings
    )
    job = dataclasses.replace(job, training=training)
    return train(job, data) if ranks == 1 else train_distributed(job, data)


if __name__ == "__main__":
    sys.exit(main())
