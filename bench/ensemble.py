"""`hpo ensemble` on real studies (issue 44): per task and seed, a small `hpo run` that keeps its
top K models (`study.keep_models`), scored on a held-out test split (`data.test_file`) carved
out of the training file with a seeded split; then `hpo ensemble --top K` twice over the same
members (the first computes every member's predictions, the second reads the feature cache) and
once more with `--soup uniform`; then `hpo retrain --top N --seeds 1` and `hpo ensemble
--from-retrain` over the kept models and the retrain's together (`--retrain N`). Prints, per
task, the medians over seeds of the best single member, soft voting, greedy selection, the
uniform soup, stacking and what `hpo ensemble` saved (its choice, made without the test split;
over the kept models, and over kept + retrain), all on the test split, stacking and the saved
model minus the best member in points, and the cached/uncached wall time of `hpo ensemble`.

Everything is written to a temporary folder; nothing in the repository.

    .venv/bin/python bench/ensemble.py --quick   # 3 tasks x 3 seeds, small studies
    .venv/bin/python bench/ensemble.py --tasks demo,regression --seeds 5 --trials 8 --top 5
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
# Learning rates where the tiny BERT from scratch learns each task (the shipped multi-label and
# regression configs' range); the NLI scratch config's own range (1e-5 to 1e-1) leaves most
# trials at chance level, members an ensemble has nothing to gain from.
LEARNING_RATE = {"type": "float", "low": 3.0e-4, "high": 5.0e-3, "log": True}


@dataclass(frozen=True)
class Task:
    name: str
    config: Path  # a shipped config: model, data columns, training
    kind: str  # what the table says
    higher_is_better: bool = True
    own_learning_rate: bool = False  # keep the config's search space as it is
    # The model searched as configs/model-choice.yaml searches it (its whole search space): the
    # pretrained MiniLM against a tiny BERT with random weights and a tokenizer of its own,
    # trained on this task's texts (data/make_tiny_bert.py), in place of the config's model.
    models_searched: bool = False


TASKS = {
    "nli": Task("nli", REPO / "bench/configs/search-nli-scratch.yaml", "3 classes, accuracy"),
    "demo": Task("demo", REPO / "configs/demo.yaml", "binary, accuracy"),
    # A study that searches the model itself: the pretrained MiniLM against the tiny BERT from
    # scratch, each with its own learning rates (the most diverse members a study gives).
    "nli-models": Task(
        "nli-models",
        REPO / "configs/model-choice.yaml",
        "3 classes, accuracy, the model searched",
        own_learning_rate=True,
    ),
    "multilabel": Task("multilabel", REPO / "configs/multilabel.yaml", "multi-label, micro-F1"),
    "demo-models": Task(
        "demo-models",
        REPO / "configs/demo.yaml",
        "binary, accuracy, the model searched",
        own_learning_rate=True,
        models_searched=True,
    ),
    "multilabel-models": Task(
        "multilabel-models",
        REPO / "configs/multilabel.yaml",
        "multi-label, micro-F1, the model searched",
        own_learning_rate=True,
        models_searched=True,
    ),
    "regression": Task(
        "regression", REPO / "configs/regression.yaml", "regression, RMSE", higher_is_better=False
    ),
}
DEFAULT_TASKS = "nli,demo,multilabel"


@dataclass
class SeedResult:
    scores: dict[str, float]  # candidate -> test-split score
    best_learner: str
    saved: str
    uncached_s: float
    cached_s: float
    members: int
    features_s: float  # the feature stage alone, in process
    features_cached_s: float
    notes: list[str] = field(default_factory=list)
    # The same candidates over the kept models and hpo retrain's runs together (--retrain N).
    with_retrain: dict[str, float] = field(default_factory=dict)
    with_retrain_members: int = 0
    retrain_s: float = math.nan  # hpo retrain's wall time


# -- data ----------------------------------------------------------------------------------------


def read_rows(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            return list(reader), list(reader.fieldnames or [])
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return rows, list(rows[0]) if rows else []


def write_rows(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    if path.suffix == ".csv":
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        return
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def split_train(
    train: Path, folder: Path, seed: int, test_share: float, max_train: int | None
) -> tuple[Path, Path]:
    """The training file's rows shuffled by `seed`: `test_share` of them the test split no trial
    reads, the rest (at most `max_train`) the training split."""
    rows, columns = read_rows(train)
    random.Random(seed).shuffle(rows)
    cut = round(len(rows) * test_share)
    test, rest = rows[:cut], rows[cut:]
    if max_train is not None:
        rest = rest[:max_train]
    paths = folder / f"train{train.suffix}", folder / f"test{train.suffix}"
    write_rows(paths[0], rest, columns)
    write_rows(paths[1], test, columns)
    return paths


def study_config(task: Task, folder: Path, seed: int, args: argparse.Namespace) -> Path:
    raw = yaml.safe_load(task.config.read_text(encoding="utf-8"))
    data = raw["data"]
    for key in ("train_file", "eval_file"):
        data[key] = str((task.config.parent / data[key]).resolve())
    train, test = split_train(
        Path(data["train_file"]), folder, seed, args.test_share, args.max_train
    )
    data["train_file"], data["test_file"] = str(train), str(test)
    if task.models_searched:
        search_the_model(raw, train, folder)
    choices = raw["search_space"].get("model.name_or_path", {}).get("choices", [])
    for i, choice in enumerate(choices):  # folders relative to the shipped config
        if not str(choice).startswith("pkg://"):
            choices[i] = str((task.config.parent / choice).resolve())
    for rule in raw["search_space"].values():
        when: dict[str, Any] = (rule.get("when") if isinstance(rule, dict) else None) or {}
        for key, value in when.items():
            if key == "model.name_or_path" and not str(value).startswith("pkg://"):
                when[key] = str((task.config.parent / value).resolve())
    study = raw.setdefault("study", {})
    study.update(
        n_trials=args.trials,
        keep_models=args.top,
        sampler={"type": "tpe", "seed": seed, "n_startup_trials": args.trials},
        pruner={"type": "none"},  # every trial completes: K members to keep
        checkpoint_dir=str(folder / "checkpoints"),
    )
    if not task.own_learning_rate:
        raw["search_space"]["learning_rate"] = LEARNING_RATE
    training = raw.setdefault("training", {})
    training["seed"] = seed
    training["device"] = "cpu"
    training["physical_batch_size"] = 32  # what the batch finder settles on on a CPU
    if args.epochs is not None:
        training["epochs"] = args.epochs
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return config


MODEL_CHOICE = REPO / "configs/model-choice.yaml"
TINY_LOCK = threading.Lock()


def search_the_model(raw: dict[str, Any], train: Path, folder: Path) -> None:
    """`raw`'s model and search space replaced by configs/model-choice.yaml's: a categorical
    over the pretrained MiniLM and a tiny BERT (random weights, a WordPiece tokenizer trained
    on the training split's texts, saved in `folder`), each with its learning rate and batch."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_bert", REPO / "data/make_tiny_bert.py")
    assert spec is not None and spec.loader is not None
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    rows, _ = read_rows(train)
    data = raw["data"]
    columns = [
        data["text_column"],
        *([data["text_pair_column"]] if "text_pair_column" in data else []),
    ]
    texts = [str(row[c]) for row in rows for c in columns]
    with TINY_LOCK:  # transformers' lazy imports are not safe from two threads at once
        tiny = maker.save_tiny_bert(folder / "tiny-bert", texts)
    choice = yaml.safe_load(MODEL_CHOICE.read_text(encoding="utf-8"))["search_space"]
    shipped_tiny = choice["model.name_or_path"]["choices"][1]
    choice["model.name_or_path"]["choices"][1] = str(tiny)
    for rule in choice.values():
        if (rule.get("when") or {}).get("model.name_or_path") == shipped_tiny:
            rule["when"]["model.name_or_path"] = str(tiny)
    raw["search_space"] = choice
    raw.pop("model", None)  # the model is the searched one


# -- hpo ---------------------------------------------------------------------------------------


def hpo(*args: str, cwd: Path, env: dict[str, str]) -> float:
    """Run `python -m hpo ARGS`; its wall seconds."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "hpo", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"hpo {' '.join(args[:1])} failed in {cwd}:\n{done.stderr[-3000:]}")
    return wall


FEATURES_LOCK = threading.Lock()  # the feature stage runs in this process, one at a time


def feature_stage(config: Path, members: dict[str, str], cache: Path, threads: int | None) -> float:
    """Seconds `hpo ensemble`'s feature stage takes in this process (no Python start, no
    meta-learner fit): every member's predictions on the evaluation and test splits, through
    the feature cache in `cache`."""
    import torch

    from hpo.commands.ensemble import EnsembleRequest, _label_order, _split
    from hpo.commands.ensemble_members import data_of_config

    with FEATURES_LOCK:
        if threads is not None:
            torch.set_num_threads(threads)
        folders = {name: Path(path) for name, path in members.items()}
        data = data_of_config(str(config))
        order = _label_order(next(iter(folders.values())), data.task)
        request = EnsembleRequest(out="-", device="cpu", quiet=True, cache_dir=str(cache))
        started = time.perf_counter()
        for path in (data.evaluation, data.test):
            assert path is not None
            _split(folders, path, data, order, request)
        return time.perf_counter() - started


def retrain_members(folder: Path, url: str, retrained: int, env: dict[str, str]) -> list[Path]:
    """`hpo retrain --top N --seeds 1` of study `s`: its final model (--out) first, then the
    other configurations' runs' kept models (the final model's own run is the same weights)."""
    import optuna

    from hpo.ensemble import weights_sha256

    final = folder / "final"
    common = ["--study", "s", "--config", str(folder / "config.yaml"), "--storage", url]
    hpo("retrain", *common, "--top", str(retrained), "--seeds", "1", "--out", str(final),
        "--quiet", cwd=folder, env=env)  # fmt: skip
    names = optuna.study.get_all_study_names(storage=url)
    study = optuna.load_study(study_name=next(n for n in names if n != "s"), storage=url)
    runs = [Path(t.user_attrs["best_model"]) for t in study.get_trials(deepcopy=False)
            if "best_model" in t.user_attrs]  # fmt: skip
    sha = weights_sha256(final)
    others = [r for r in runs if (r / "config.json").is_file() and weights_sha256(r) != sha]
    return [final, *others]


SAVED = "saved (hpo ensemble's choice)"


def candidates(made: dict[str, Any], souped: dict[str, Any] | None) -> dict[str, float]:
    """The test-split scores an ensemble card gives each candidate, and what `made`'s command
    saved (stacking, the best member or a soup, chosen without the test split)."""
    stacking = made["stacking"]
    scores = {
        "best member": made["best_member"]["score"],
        "soft voting": made["soft_voting"]["score"],
        "greedy selection": made["greedy_selection"]["score"],
        "stacking": stacking["scores"][stacking["best_learner"]],
        "stacking (LR)": stacking["scores"].get("logistic_regression", math.nan),
        SAVED: made["saved"]["score"],
    }
    soup = (souped or {}).get("soup") or {}
    scores["uniform soup"] = soup["score"] if soup.get("score") is not None else math.nan
    return scores


def card(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "ensemble_card.json").read_text(encoding="utf-8"))


def one_seed(task: Task, seed: int, root: Path, args: argparse.Namespace) -> SeedResult:
    folder = root / f"{task.name}-{seed}"
    folder.mkdir()
    config = study_config(task, folder, seed, args)
    env = dict(os.environ, HPO_CACHE_DIR=str(folder / "cache"), PYTHONPATH=str(REPO))
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    url = f"sqlite:///{folder / 'study.db'}"
    started = time.perf_counter()
    hpo(
        "run",
        "--study",
        "s",
        "--config",
        str(config),
        "--storage",
        url,
        "--quiet",
        cwd=folder,
        env=env,
    )
    study_s = time.perf_counter() - started
    common = ["ensemble", "--study", "s", "--storage", url, "--config", str(config)]
    common += ["--top", str(args.top), "--device", "cpu", "--quiet"]
    common += [a for learner in args.learner for a in ("--learner", learner)]
    uncached = hpo(*common, "--out", str(folder / "e1"), cwd=folder, env=env)
    cached = hpo(*common, "--out", str(folder / "e2"), cwd=folder, env=env)
    hpo(*common, "--soup", "uniform", "--out", str(folder / "e3"), cwd=folder, env=env)
    first, again, souped = card(folder / "e1"), card(folder / "e2"), card(folder / "e3")
    if first["measured_on"] != "test_split":
        raise SystemExit(
            f"{task.name} seed {seed}: scored by {first['measured_on']}, not the test split"
        )
    if again["stacking"]["scores"] != first["stacking"]["scores"]:
        print(f"  note: the cached run's stacking scores differ: {again['stacking']['scores']}")
    timing = folder / "features-timing"
    features_s = feature_stage(config, first["members"], timing, args.threads)
    features_cached_s = feature_stage(config, first["members"], timing, args.threads)
    scores = candidates(first, souped)
    soup = souped.get("soup") or {}
    print(
        f"  {task.name} seed {seed}: study {study_s:.0f} s, {len(first['members'])} members; "
        + ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
        + f"; ensemble {uncached:.1f} s, cached {cached:.1f} s; feature stage "
        f"{features_s:.2f} s, cached {features_cached_s:.3f} s",
        flush=True,
    )
    result = SeedResult(
        scores,
        first["stacking"]["best_learner"],
        first["choice"],
        uncached,
        cached,
        len(first["members"]),
        features_s,
        features_cached_s,
        list(first.get("notes", [])) + ([soup["note"]] if soup.get("note") else []),
    )
    if args.retrain:
        with_retrain(task, seed, folder, url, env, first, result, args)
    return result


def with_retrain(
    task: Task,
    seed: int,
    folder: Path,
    url: str,
    env: dict[str, str],
    first: dict[str, Any],
    result: SeedResult,
    args: argparse.Namespace,
) -> None:
    """`hpo retrain` of the study's top configurations, then `hpo ensemble --from-retrain` over
    the kept models and the retrain's models together (with --soup uniform, which soups the
    same members): the second set of candidates in `result`."""
    started = time.perf_counter()
    retrained = retrain_members(folder, url, args.retrain, env)
    result.retrain_s = time.perf_counter() - started
    folders = [*first["members"].values(), *map(str, retrained)]
    command = ["ensemble", "--from-retrain", *folders, "--config", str(folder / "config.yaml")]
    command += ["--device", "cpu", "--quiet", "--soup", "uniform", "--out", str(folder / "e4")]
    command += [a for learner in args.learner for a in ("--learner", learner)]
    hpo(*command, cwd=folder, env=env)
    made = card(folder / "e4")
    result.with_retrain = candidates(made, made)
    result.with_retrain_members = len(made["members"])
    final = made["member_scores"].get("final", math.nan)
    result.with_retrain["hpo retrain's model"] = final
    print(
        f"  {task.name} seed {seed}: retrain {result.retrain_s:.0f} s; kept + retrain, "
        f"{result.with_retrain_members} members: "
        + ", ".join(f"{k} {v:.4f}" for k, v in result.with_retrain.items()),
        flush=True,
    )


# -- the table ---------------------------------------------------------------------------------

CANDIDATES = (
    "best member",
    "soft voting",
    "greedy selection",
    "uniform soup",
    "stacking",
    "stacking (LR)",  # logistic regression, the default learner, when it was among those fitted
    SAVED,  # the folder hpo ensemble wrote (kept: without --soup; kept + retrain: with it)
)


def median(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def gain(task: Task, result: SeedResult, retrain: bool = False, of: str = "stacking") -> float:
    """`of` (stacking, or the saved model) minus the best member, in points (x100), positive
    when it is better; `retrain`: over the kept models and hpo retrain's together."""
    sign = 1.0 if task.higher_is_better else -1.0
    scores = result.with_retrain if retrain else result.scores
    return 100 * sign * (scores[of] - scores["best member"])


def table(task: Task, results: list[SeedResult]) -> str:
    lines = [f"### {task.name} ({task.kind}), {len(results)} seeds, medians on the test split", ""]
    retrain = all(r.with_retrain for r in results)
    if retrain:
        counts = f"{results[0].members} kept / {results[0].with_retrain_members} kept + retrain"
        lines += [
            f"| candidate | kept models | kept + retrain | per seed (kept; kept + retrain; "
            f"members {counts}) |",
            "|---|---:|---:|---|",
        ]
    else:
        lines += ["| candidate | median | per seed |", "|---|---:|---|"]
    for name in (*CANDIDATES, "hpo retrain's model"):
        values = [r.scores.get(name, math.nan) for r in results]
        each = ", ".join(f"{v:.4f}" for v in values)
        if not retrain:
            if name in CANDIDATES:
                lines.append(f"| {name} | {median(values):.4f} | {each} |")
            continue
        also = [r.with_retrain.get(name, math.nan) for r in results]
        lines.append(
            f"| {name} | {median(values):.4f} | {median(also):.4f} | {each}; "
            f"{', '.join(f'{v:.4f}' for v in also)} |"
        )
    gains = [gain(task, r) for r in results]
    if retrain:
        more = [gain(task, r, retrain=True) for r in results]
        lines += [
            "",
            f"kept + retrain: stacking - best member: median {median(more):+.2f} points (per seed "
            f"{', '.join(f'{g:+.2f}' for g in more)}); hpo retrain wall median "
            f"{median([r.retrain_s for r in results]):.0f} s",
        ]
    ratios = [r.uncached_s / r.cached_s for r in results]
    lines += [
        "",
        f"stacking - best member: median {median(gains):+.2f} points "
        f"(per seed {', '.join(f'{g:+.2f}' for g in gains)}; "
        f"{'lower RMSE is better, so the sign is flipped; ' if not task.higher_is_better else ''}"
        f"learners chosen: {', '.join(r.best_learner for r in results)}; "
        f"saved: {', '.join(r.saved for r in results)})",
        f"hpo ensemble wall: uncached median {median([r.uncached_s for r in results]):.1f} s, "
        f"cached {median([r.cached_s for r in results]):.1f} s, "
        f"uncached/cached {median(ratios):.1f}x (per seed {', '.join(f'{x:.1f}' for x in ratios)})",
        f"feature stage alone (in process): uncached median "
        f"{median([r.features_s for r in results]):.2f} s, cached "
        f"{median([r.features_cached_s for r in results]):.3f} s, uncached/cached "
        f"{median([r.features_s / r.features_cached_s for r in results]):.0f}x",
    ]
    notes = sorted({n for r in results for n in r.notes})
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def goals(tasks: list[Task], results: dict[str, list[SeedResult]], retrain: bool = False) -> str:
    gains = {t.name: median([gain(t, r, retrain) for r in results[t.name]]) for t in tasks}
    saved = {t.name: median([gain(t, r, retrain, SAVED) for r in results[t.name]]) for t in tasks}
    ratios = [r.uncached_s / r.cached_s for rs in results.values() for r in rs]
    never_below = all(g >= 0 for g in gains.values())
    plus_one = [n for n, g in gains.items() if g >= 1.0]
    worst = min(ratios)
    stage = [r.features_s / r.features_cached_s for rs in results.values() for r in rs]
    return "\n".join(
        [
            f"Goals (medians over seeds; members: {'kept + retrain' if retrain else 'kept'}):",
            f"- stacking never below the best member on any task: "
            f"{'MET' if never_below else 'NOT MET'} "
            f"({', '.join(f'{n} {g:+.2f}' for n, g in gains.items())} points)",
            f"- what hpo ensemble saved (chosen without the test split) never below the best "
            f"member: {'MET' if all(g >= 0 for g in saved.values()) else 'NOT MET'} "
            f"({', '.join(f'{n} {g:+.2f}' for n, g in saved.items())} points)",
            f"- at least +1 point on two tasks: {'MET' if len(plus_one) >= 2 else 'NOT MET'} "
            f"({', '.join(plus_one) or 'none'})",
            f"- cached second run at least 10x faster: {'MET' if worst >= 10 else 'NOT MET'} "
            f"(uncached/cached: median {median(ratios):.1f}x, worst {worst:.1f}x, "
            "wall time of the command, Python start and meta-learner fits included; "
            f"the feature stage alone: median {median(stage):.0f}x, worst {min(stage):.0f}x)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default=DEFAULT_TASKS, help=f"of {', '.join(TASKS)}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1"
    )
    parser.add_argument("--trials", type=int, default=8, help="trials per study (8)")
    parser.add_argument("--top", type=int, default=5, help="members: study.keep_models and --top")
    parser.add_argument("--epochs", type=int, default=None, help="instead of the config's")
    parser.add_argument("--test-share", type=float, default=0.2, help="of the training file")
    parser.add_argument("--max-train", type=int, default=None, help="training rows at most")
    parser.add_argument(
        "--jobs", type=int, default=1, help="studies run at once (each its own processes)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process")
    parser.add_argument(
        "--retrain",
        type=int,
        default=2,
        help="hpo retrain's --top (1 seed each): its models join the kept ones in a second "
        "ensemble (2; 0: none)",
    )
    parser.add_argument(
        "--learner",
        action="append",
        default=[],
        help="hpo ensemble's --learner (repeat; default: the command's own default)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="4 trials, top 3, 800 training rows, 2 epochs, 2 jobs of 1 thread",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.top, args.max_train, args.epochs = 4, 3, 800, 2
        args.jobs, args.threads = 2, 1
    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        parser.error(f"--tasks: unknown {', '.join(unknown)}; give some of {', '.join(TASKS)}")
    if args.top < 2 or args.trials < args.top:
        parser.error("--top must be at least 2 and at most --trials")
    if not 0 <= args.retrain <= args.trials:
        parser.error("--retrain must be from 0 to --trials")
    tasks = [TASKS[n] for n in names]
    print(
        f"tasks {', '.join(names)}; {args.seeds} seeds, {args.trials} trials, top {args.top}, "
        f"epochs {args.epochs or 'the config'}, training rows {args.max_train or 'all'}, "
        f"test share {args.test_share}, retrain top {args.retrain}",
        flush=True,
    )
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="hpo-bench-ensemble-") as work,
        ThreadPoolExecutor(max_workers=args.jobs) as pool,  # each job runs subprocesses
    ):
        # Seed by seed: a run cut short has every task's first seeds (each printed when done).
        futures: dict[str, list[Any]] = {task.name: [] for task in tasks}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for task in tasks:
                futures[task.name].append(pool.submit(one_seed, task, seed, Path(work), args))
        results = {name: [f.result() for f in done] for name, done in futures.items()}
    print()
    for task in tasks:
        print(table(task, results[task.name]), "\n")
    print(goals(tasks, results))
    if args.retrain:
        print(goals(tasks, results, retrain=True))
    print(f"\nwall {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
