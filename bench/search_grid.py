"""Train every point of a grid over a task's search space with hpo's own trainer, several
training seeds per point, and store each run's full learning curve in bench/data/, for
bench/search_efficiency.py to replay search strategies against.

Each line of the output (JSON Lines) is one run: its parameters, training seed, status and, per
evaluation, the optimizer step, samples trained, seconds since the run started (training and
evaluation, and the model's build) and the metrics. Runs already in
the file are skipped: an interrupted grid goes on where it stopped.

Run: .venv/bin/python bench/search_grid.py --task nli-scratch|demo|lora|ner|regression [--jobs 2]
(ner and regression write their synthetic data first when it is missing: bench/search_data.py)
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for folder in (REPO, REPO / "bench"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

# The tasks: the config (its search space is what strategies sample) and the grid trained.
# Float dimensions are covered by points spread over their range; the replay snaps a sampled
# value to the nearest point (in log space for log-scaled parameters).
BAND = [6e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2]  # regression's good learning rates
TASKS: dict[str, dict[str, Any]] = {
    "nli-scratch": {
        "config": REPO / "bench/configs/search-nli-scratch.yaml",
        "grid": {
            "learning_rate": [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1],
            "effective_batch_size": [16, 32, 64, 128],
            "warmup_ratio": [0.0, 0.15, 0.3],
            "weight_decay": [0.0, 0.2],
        },
        "seeds": [1, 2],
    },
    "demo": {
        "config": REPO / "configs/demo.yaml",
        "grid": {
            "effective_batch_size": [16, 32, 64, 128],
            "learning_rate": [3e-5, 7e-5, 1.6e-4, 3.9e-4, 9e-4, 2.1e-3, 5e-3],
            "warmup_ratio": [0.0, 0.2],
        },
        "seeds": [1, 2],
    },
    # A conditional parameter: full fine-tuning points have no rank (model.peft.r applies only
    # when model.peft.method is lora), so the grid is the union of one grid per method.
    "lora": {
        "config": REPO / "bench/configs/search-lora.yaml",
        "grid": [
            {
                "model.peft.method": ["none"],
                "learning_rate": [3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2],
                "effective_batch_size": [32],
            },
            {
                "model.peft.method": ["lora"],
                "model.peft.r": [4, 16],
                "learning_rate": [3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2],
                "effective_batch_size": [32],
            },
        ],
        "seeds": [1, 2],
    },
    # Token classification (bench/search_data.py writes the data): entity F1 sits at 0 while
    # the model tags every word 'O', then jumps; when depends on the learning rate and batch.
    "ner": {
        "config": REPO / "bench/configs/search-ner.yaml",
        "data": "ner",
        "grid": {
            "learning_rate": [1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 3e-2],
            "effective_batch_size": [8, 16, 32],
            "warmup_ratio": [0.0, 0.15, 0.3],
        },
        "seeds": [1, 2, 3],
    },
    # Regression with noisy targets, R² on a small evaluation set four times an epoch: noisy
    # evaluations. Only a narrow band of learning rates (about 1e-3 to 1e-2, small batches)
    # leaves the mean within 3 epochs; the grid is denser there.
    "regression": {
        "config": REPO / "bench/configs/search-regression.yaml",
        "data": "regression",
        "grid": {
            "learning_rate": [1e-5, 3e-5, 1e-4, 3e-4, *BAND, 3e-2, 1e-1],
            "effective_batch_size": [8, 16, 32],
            "warmup_ratio": [0.0, 0.3],
        },
        "seeds": [1, 2],
    },
}


def data_path(task: str) -> Path:
    return REPO / "bench" / "data" / f"search-{task}.jsonl"


def grid_points(task: str) -> list[dict[str, Any]]:
    """Every point of the task's grid. A grid is one product of values per parameter, or a list
    of products (a space with conditions: each product holds only the parameters that apply)."""
    grid = TASKS[task]["grid"]
    points = []
    for product in grid if isinstance(grid, list) else [grid]:
        names = list(product)
        for values in itertools.product(*(product[n] for n in names)):
            points.append(dict(zip(names, values, strict=True)))
    return points


def grid_runs(task: str) -> list[dict[str, Any]]:
    """Every (point, seed) of the task's grid, in a fixed shuffled order: a grid stopped
    part way is a uniform sample of it."""
    runs = [
        {"params": params, "seed": seed}
        for params in grid_points(task)
        for seed in TASKS[task]["seeds"]
    ]
    random.Random(0).shuffle(runs)
    return runs


def run_key(run: dict[str, Any]) -> str:
    return json.dumps([sorted(run["params"].items()), run["seed"]])


def done_keys(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    keys = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            keys.add(run_key(json.loads(line)))
    return keys


_STATE: dict[str, Any] = {}


def _init(task: str) -> None:
    """Per process: one thread (the jobs share the cores), the config, tokenizer and data."""
    import torch

    torch.set_num_threads(1)
    from hpo.config.loader import load_config
    from hpo.trainer.model import load_tokenizer
    from hpo.trainer.tasks import prepare_data

    config = load_config(TASKS[task]["config"])
    if config.training.physical_batch_size == "auto":
        # What the batch finder settles on for these tiny models on a CPU; the same
        # gradients either way (accumulation), and no search per run.
        config.training.physical_batch_size = 32
    _STATE["config"] = config
    _STATE["data"] = prepare_data(
        config.data, load_tokenizer(config.model, config.task), config.task, config.training
    )


def train_point(run: dict[str, Any]) -> dict[str, Any]:
    """Train one grid point with one seed through hpo's trainer; its curve and status."""
    from hpo.config.search_paths import with_params
    from hpo.trainer.loop import Evaluation, train

    config = _STATE["config"]
    job = with_params(config, {**run["params"], "seed": run["seed"]})
    evaluations: list[dict[str, Any]] = []
    started = time.perf_counter()

    def on_evaluation(evaluation: Evaluation) -> None:
        evaluations.append(
            {
                "index": evaluation.index,
                "step": evaluation.optimizer_step,
                "samples": evaluation.optimizer_step * job.training.effective_batch_size,
                "seconds": round(time.perf_counter() - started, 3),
                "metrics": {k: round(v, 6) for k, v in evaluation.metrics.items()},
            }
        )

    result = train(job, _STATE["data"], on_evaluation, config.study.primary_metric)
    return {
        **run,
        "status": result.status,
        "stop_reason": result.stop_reason,
        "wall_s": round(result.wall_s, 3),
        "train_s": round(result.train_s, 3),
        "eval_s": round(result.eval_s, 3),
        "evaluations": evaluations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--limit", type=int, help="train at most this many runs (a test)")
    parser.add_argument("--out", type=Path, help="JSON Lines file (default bench/data/...)")
    args = parser.parse_args()
    path = args.out or data_path(args.task)
    if "data" in TASKS[args.task]:
        import search_data

        if not all(f.is_file() for f in search_data.files(TASKS[args.task]["data"])):
            search_data.write(TASKS[args.task]["data"])
    metric = _metric(args.task)
    done = done_keys(path)
    todo = [run for run in grid_runs(args.task) if run_key(run) not in done]
    if args.limit is not None:
        todo = todo[: args.limit]
    print(f"{args.task}: {len(done)} runs stored, {len(todo)} to train with {args.jobs} jobs")
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with (
        context.Pool(args.jobs, initializer=_init, initargs=(args.task,)) as pool,
        path.open("a", encoding="utf-8") as out,
    ):
        for i, record in enumerate(pool.imap_unordered(train_point, todo), 1):
            out.write(json.dumps(record) + "\n")
            out.flush()
            best = max((e["metrics"][metric] for e in record["evaluations"]), default=0.0)
            elapsed = time.perf_counter() - started
            print(
                f"[{i}/{len(todo)} {elapsed:.0f}s] {record['params']} seed {record['seed']}: "
                f"{record['status']}, best {metric} {best:.3f}",
                flush=True,
            )


def _metric(task: str) -> str:
    from hpo.config.loader import load_config

    return load_config(TASKS[task]["config"]).study.primary_metric


if __name__ == "__main__":
    main()
