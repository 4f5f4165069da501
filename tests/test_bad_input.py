"""Every kind of bad input through the real CLI: one clear line naming the problem and the fix,
exit code 2, no traceback, nothing written to the study database."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import run_hpo, tiny_config, write_config, write_csv


def _config_change(tmp_path: Path, data: tuple[Path, Path], kind: str) -> dict[str, Any]:
    """A config that is bad in one way; data files are written here where the case needs it."""
    train, evaluation = data
    raw = tiny_config(train, evaluation)
    if kind == "config":
        raw["study"]["n_trails"] = 3
        raw["training"]["physical_batch_size"] = 0
        raw["training"]["epochs"] = "two"
        raw["search_space"]["learning_rate"] = {"type": "float", "low": 1e-2, "high": 1e-4}
        raw["search_space"]["warmup_ratio"] = {"type": "categorical", "choices": []}
        raw["search_space"]["weight_decay"] = {"type": "float", "low": 0, "high": 0.1, "log": True}
    elif kind == "missing file":
        raw["data"]["train_file"] = str(tmp_path / "nope.csv")
    elif kind == "not utf-8":
        bad = tmp_path / "latin1.csv"
        bad.write_bytes("text,label\ngood,pos\ncaf\xe9 awful,neg\n".encode("latin-1"))
        raw["data"]["train_file"] = str(bad)
    elif kind == "missing label":
        rows = [{"text": "good", "label": "pos"}, {"text": "bad", "label": ""}]
        raw["data"]["train_file"] = str(write_csv(tmp_path / "t.csv", rows))
    elif kind == "label only in evaluation":
        rows = [{"text": "meh", "label": "neutral"}]
        raw["data"]["eval_file"] = str(write_csv(tmp_path / "e.csv", rows))
    elif kind == "one class":
        rows = [{"text": t, "label": "pos"} for t in ("good", "fine", "great")]
        raw["data"]["train_file"] = str(write_csv(tmp_path / "t.csv", rows))
    elif kind == "repeated columns":
        repeated = tmp_path / "repeated.csv"
        repeated.write_text("text,label,text\ngood,pos,x\nbad,neg,y\n")
        raw["data"]["train_file"] = str(repeated)
    elif kind == "row over max_row_mib":
        huge = tmp_path / "huge.csv"
        huge.write_text("text,label\ngood,pos\n" + "x" * 2**20 + ",neg\n")
        raw["data"].update(train_file=str(huge), max_row_mib=1)
    elif kind == "header too wide":
        wide = tmp_path / "wide.csv"
        wide.write_text(",".join(f"c{i}" for i in range(20_000)) + ",text,label\n")
        raw["data"]["train_file"] = str(wide)
    elif kind == "empty file":
        empty = tmp_path / "empty.csv"
        empty.write_text("text,label\n")
        raw["data"]["train_file"] = str(empty)
    elif kind == "missing model folder":
        raw["model"] = {"name_or_path": str(tmp_path / "no-model"), "tokenizer": "pkg://x/y"}
    elif kind == "unknown architecture":
        raw["model"]["config"] = {"model_type": "not-a-real-architecture"}
    elif kind == "hub name without network":
        raw["model"] = {"name_or_path": "some-org/some-model-that-is-not-here"}
    return raw


CASES = [
    (
        "config",
        [
            "study.n_trails: unknown key (did you mean 'n_trials'?)",
            "training.physical_batch_size: got 0",
            "training.epochs: got 'two'",
            "search_space.learning_rate.low: got 0.01; must be <= high",
            "search_space.warmup_ratio.choices: got []",
            "search_space.weight_decay.low: got 0.0; must be > 0 for a log-scale",
        ],
    ),
    ("missing file", ["data.train_file", "not found", "paths are relative to the config file"]),
    ("not utf-8", ["line 3 is not valid UTF-8 (byte 0xe9 at column 4); save the file as UTF-8"]),
    ("missing label", ["row 2 has no label"]),
    ("label only in evaluation", ["labels ['neutral'] never appear in the training data"]),
    ("one class", ["has the label 'pos'; a classifier needs at least two classes"]),
    ("repeated columns", ["column names ['text'] appear more than once; give each column"]),
    (
        "row over max_row_mib",
        [
            "huge.csv: row 2 (from line 3) is longer than 1 MiB "
            "(data.max_row_mib), so it is not read"
        ],
    ),
    ("header too wide", ["wide.csv: the header has 20,002 columns, more than hpo reads"]),
    ("empty file", ["no rows; the file is empty"]),
    ("missing model folder", ["model.name_or_path", "not found"]),
    ("unknown architecture", ["cannot load model config"]),
    ("hub name without network", ["cannot load model config 'some-org/some-model-that-is-not"]),
]


# Through the real CLI in a process of its own, as a user runs it; the other cases call the
# same main() in the test's process (a second apiece instead of a worker's start-up).
AS_A_USER_RUNS_IT = {"not utf-8", "hub name without network"}


@pytest.mark.parametrize(("kind", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_message_and_nothing_is_written(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    kind: str,
    expected: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    config = write_config(tmp_path / "bad.yaml", _config_change(tmp_path, easy_data, kind))
    database = tmp_path / "study.db"
    args = ["run", "--study", "s", "--config", str(config), "--storage", f"sqlite:///{database}"]
    started = time.monotonic()
    if kind in AS_A_USER_RUNS_IT:
        # The tests run with HF_HUB_OFFLINE=1 (read when transformers loads); a user's shell
        # usually has no such setting.
        online = {"HF_HUB_OFFLINE": ""} if kind == "hub name without network" else None
        result = run_hpo(*args, cwd=tmp_path, env=online)
    else:  # the same main() in this process: the message and the exit code, in a fraction
        monkeypatch.chdir(tmp_path)
        code = hpo_main(args)
        out, err = capsys.readouterr()
        result = subprocess.CompletedProcess(args, code, out, err)
    assert result.returncode == 2, result.stderr[-3000:]
    if kind == "hub name without network":
        # One question to the hub, not half a minute of retries with a warning each.
        assert time.monotonic() - started < 30, result.stderr[-3000:]
        assert "retry" not in result.stderr.lower(), result.stderr[-3000:]
    for fragment in expected:
        assert fragment in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not database.exists()  # nothing written: the inputs are checked first
    if kind == "not utf-8":  # once: --debug adds the traceback
        debug = run_hpo(
            "run",
            "--study",
            "s",
            "--config",
            str(config),
            "--storage",
            f"sqlite:///{database}",
            "--debug",
            cwd=tmp_path,
        )
        assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_a_config_without_eval_file_is_one_line_saying_what_to_give(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    # The first thing a user with one CSV meets: hpo does not split it, so the line says how.
    raw = tiny_config(*easy_data)
    del raw["data"]["eval_file"]
    config = write_config(tmp_path / "one-file.yaml", raw)
    database = tmp_path / "study.db"
    monkeypatch.chdir(tmp_path)
    args = ["run", "--study", "s", "--config", str(config), "--storage", f"sqlite:///{database}"]
    code = hpo_main(args)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [
        f"hpo: error: {config}: data.eval_file: is required: a path to held-out rows each "
        "trial is scored on, in train_file's formats; with one file, move about a tenth of "
        "its rows into another and name that here"
    ]
    assert not database.exists()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql+psycopg2://hpo:topsecret@no-such-host.invalid:5432/hpo", "no-such-host"),
        ("postgresql+psycopg2://hpo:topsecret@127.0.0.1:1/hpo", "127.0.0.1:1"),
        ("postgresql+psycopg2://postgres:topsecret@127.0.0.1:5432/no_such_db_x", "no_such_db_x"),
        ("postgres://hpo:topsecret@db/hpo", "write it postgresql+psycopg2://"),
    ],
    ids=["unknown host", "nothing listening", "no such database", "bad URL"],
)
def test_an_unusable_database_is_one_masked_line_within_10_seconds(
    tmp_path: Path, easy_data: tuple[Path, Path], url: str, expected: str
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    started = time.monotonic()
    result = run_hpo("run", "--study", "s", "--config", str(config), "--storage", url, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("hpo: error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
    assert "topsecret" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    # Python, torch and the data come first; the database verdict itself takes seconds.
    assert time.monotonic() - started < 10 + 20


def _bomb(key: str) -> str:
    """A "billion laughs" value: 9 levels of 9 aliases, 387 million strings once expanded."""
    lines = [f"{key}:", "  - &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


_SPACE = "search_space:\n  effective_batch_size: {type: categorical, choices: [8]}\n"
FILE_CASES = [
    (
        "empty file",
        [],
        "",
        [
            "model.name_or_path: give exactly one of name_or_path or config",
            "data.train_file: is required",
            "data.eval_file: is required",
        ],
    ),
    ("no model section", ["model"], "", ["model.name_or_path: give exactly one of"]),
    (
        "no data section",
        ["data"],
        "",
        ["data.train_file: is required: a path to the data", "data.eval_file: is required"],
    ),
    ("alias bomb", ["study"], _bomb("study"), ["study: got a list [['lol', 'lol'"]),
    (
        "int step 0",
        ["search_space"],
        _SPACE + "  epochs: {type: int, low: 1, high: 3, step: 0}\n",
        ["search_space.epochs.step: got 0.0; must be a positive whole number"],
    ),
    (
        "negative float step",
        ["search_space"],
        _SPACE + "  warmup_ratio: {type: float, low: 0, high: 0.2, step: -0.1}\n",
        ["search_space.warmup_ratio.step: got -0.1; must be > 0"],
    ),
    (
        "duplicate key",
        ["study"],
        "study: {n_trials: 2}\nstudy: {n_trials: 3}\n",
        ["key 'study' appears twice in one mapping; keep one (line "],
    ),
    (
        "a list",
        ["study", "search_space", "model", "data", "training"],
        "- study\n",
        ["must hold a mapping of sections", "got a list ['study']"],
    ),
    (
        "huge epochs",
        ["training"],
        "training: {epochs: 1000000000}\n",
        ["training.epochs: got 1000000000; must be"],
    ),
    (
        "fractional int step",
        ["search_space"],
        _SPACE + "  epochs: {type: int, low: 1, high: 3, step: 1.5}\n",
        ["search_space.epochs.step: got 1.5; must be a positive whole number"],
    ),
    (
        "huge seed",
        ["study"],
        "study: {n_trials: 2, sampler: {seed: 1" + "0" * 20 + "}}\n",
        ["study.sampler.seed: got 100000000000000000000; must be in [0, 2**32) or null"],
    ),
]


# Through a process of its own for these two: refused there before torch is even imported
# (seconds); the others call the same main() in the test's process, a second apiece.
FILE_CASES_AS_A_USER_RUNS_THEM = {"empty file", "alias bomb"}


@pytest.mark.parametrize(
    ("kind", "drop", "text", "expected"), FILE_CASES, ids=[c[0] for c in FILE_CASES]
)
def test_a_bad_config_file_is_refused_before_anything_starts(
    tmp_path: Path,
    easy_data: tuple[Path, Path],
    kind: str,
    drop: list[str],
    text: str,
    expected: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    hpo_main: Callable[[list[str]], int],
) -> None:
    kept = {k: v for k, v in tiny_config(*easy_data).items() if k not in drop}
    config = tmp_path / "bad.yaml"
    config.write_text((yaml.safe_dump(kept) if kept and kind != "empty file" else "") + text)
    database = tmp_path / "study.db"
    args = ["run", "--study", "s", "--config", str(config), "--storage", f"sqlite:///{database}"]
    started = time.monotonic()
    if kind in FILE_CASES_AS_A_USER_RUNS_THEM:
        result = run_hpo(*args, cwd=tmp_path, timeout=60)
    else:
        monkeypatch.chdir(tmp_path)
        code = hpo_main(args)
        out, err = capsys.readouterr()
        result = subprocess.CompletedProcess(args, code, out, err)
    assert result.returncode == 2, result.stderr[-3000:]
    for fragment in expected:
        assert fragment in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert max(len(line) for line in result.stderr.splitlines()) < 600
    assert not database.exists()
    assert time.monotonic() - started < 20  # no torch import, no data: seconds, not minutes


def test_a_bad_device_is_refused_before_the_database(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    config = write_config(tmp_path / "c.yaml", tiny_config(*easy_data))
    database = tmp_path / "study.db"
    result = run_hpo(
        "run",
        "--study",
        "s",
        "--config",
        str(config),
        "--storage",
        f"sqlite:///{database}",
        "--device",
        "gpu",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--device: got 'gpu'; must be auto, cpu, cuda or cuda:N" in result.stderr
    assert "Traceback" not in result.stderr and not database.exists()
