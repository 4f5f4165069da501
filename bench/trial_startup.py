"""Where a fresh trial process spends its time before training runs at speed: CUDA context,
model build, the move to the GPU, DataLoader workers, and the first optimizer steps. Runs each
phase in a new process, as `trial_isolation: process` does, several times.
Run: python bench/trial_startup.py [--config bench/configs/bert-base-nli.yaml] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def phases(config_path: str) -> dict[str, float]:
    started = time.perf_counter()
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks[name] = time.perf_counter() - started - sum(marks.values())

    import torch

    from hpo.config.loader import load_config
    from hpo.config.search_paths import with_params
    from hpo.trainer.loop import Trainer
    from hpo.trainer.model import load_tokenizer
    from hpo.trainer.tasks import prepare_data

    mark("imports")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.init()
        torch.zeros(1, device=device)
    mark("cuda context")
    config = load_config(config_path)
    data = prepare_data(
        config.data, load_tokenizer(config.model, config.task), config.task, config.training
    )
    mark("data (cached tokens)")
    training = dataclasses.replace(
        config.training, physical_batch_size=64, effective_batch_size=64, device=device.type
    )
    job = dataclasses.replace(with_params(config, {}), training=training)
    trainer = Trainer(job, data)
    mark("model build, to device, optimizer, loaders")
    steps = trainer._steps(0)
    _, micro_batches = next(steps)
    mark("first batch (DataLoader workers start)")
    for i, (_, micro_batches) in enumerate(steps):
        trainer._try_step(micro_batches)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i == 0:
            mark("first optimizer step")
        if i == 10:
            mark("next 10 steps")
            break
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(REPO / "bench" / "configs" / "bert-base-nli.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    runs = []
    for _ in range(args.repeats):  # not a Pool: its daemonic processes cannot start loaders
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            runs.append(pool.submit(phases, args.config).result())
    print("| phase | " + " | ".join(f"run {i + 1} s" for i in range(len(runs))) + " |")
    print("|---|" + "---:|" * len(runs))
    for name in runs[0]:
        print(f"| {name} | " + " | ".join(f"{run[name]:.2f}" for run in runs) + " |")


if __name__ == "__main__":
    main()
