"""What preparing data may cost: one huge cell is cut to what max_length can reach before it is
tokenized, a CSV row or JSONL line past data.max_row_mib is refused naming it, and a CSV header
of thousands of columns costs only the columns the run reads."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from hpo.trainer.config import DataConfig, ModelConfig
from hpo.trainer.errors import DataError
from hpo.trainer.model import load_tokenizer
from hpo.trainer.readers import MAX_CSV_COLUMNS, MIB
from hpo.trainer.tasks import prepare_data
from hpo.trainer.tasks.base import IGNORE
from hpo.trainer.text_window import window_chars
from tests.conftest import MINILM_TOKENIZER, easy_rows, write_csv

MAX_LENGTH = 32
HUGE = "the quick brown fox jumps over the lazy dog " * 10_000  # 440,000 characters
# Of a pair, each text: tokenizers truncates a pair keeping every combination of the two texts'
# overflowing parts (quadratic): two whole HUGE cells took 24 GB before they were cut.
PAIR = HUGE[:10_000]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(ModelConfig(tokenizer=MINILM_TOKENIZER, config={"model_type": "bert"}))


class Recording:
    """The tokenizer, noting the most characters one row of a call hands it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.most_chars = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, texts: list[Any], pairs: list[Any] | None = None, **options: Any) -> Any:
        for row in [*texts, *(pairs or [])]:
            chars = len(row) if isinstance(row, str) else sum(map(len, row))  # words: a list
            self.most_chars = max(self.most_chars, chars)
        return self._tokenizer(texts, pairs, **options)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def prepared(
    tmp_path: Path, tokenizer: Any, rows: list[dict[str, Any]], task: str, **data: Any
) -> Any:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    config = DataConfig(
        train_file=str(path),
        eval_file=str(path),
        max_length=MAX_LENGTH,
        cache_dir=str(tmp_path / "cache"),
        **data,
    )
    return prepare_data(config, tokenizer, task)


def row_ids(split: Any, index: int) -> list[int]:
    return split.ids[split.offsets[index] : split.offsets[index + 1]].tolist()


WORDS = HUGE.split()
CASES = {
    "sequence_classification": (
        [{"text": HUGE, "label": "pos"}, {"text": "no", "label": "neg"}],
        {},
    ),
    "sequence_classification pairs": (
        [
            {"text": PAIR, "hypothesis": PAIR, "label": "pos"},
            {"text": "no", "hypothesis": "yes", "label": "neg"},
        ],
        {"text_pair_column": "hypothesis"},
    ),
    "regression": ([{"text": HUGE, "label": 1.5}, {"text": "no", "label": 0.5}], {}),
    "multi_label_classification": (
        [{"text": HUGE, "label": ["a"]}, {"text": "no", "label": []}],
        {},
    ),
    "token_classification": (
        [
            {"text": WORDS, "label": ["B-PER"] + ["O"] * (len(WORDS) - 1)},
            {"text": ["x" * len(HUGE)], "label": ["B-LOC"]},
        ],
        {},
    ),
    "causal_lm": ([{"text": HUGE}, {"text": "a short text"}], {}),
    "causal_lm prompts": (
        [{"prompt": HUGE, "completion": HUGE}, {"prompt": "a", "completion": "b"}],
        {"prompt_column": "prompt", "completion_column": "completion"},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_huge_cell_is_cut_to_what_max_length_can_reach_before_it_is_tokenized(
    tmp_path: Path, tokenizer: Any, case: str
) -> None:
    rows, data = CASES[case]
    recording = Recording(tokenizer)
    got = prepared(tmp_path, recording, rows, case.split()[0], **data)
    # A word of a whole cell is cut too: the words before it hold less than a window.
    assert 0 < recording.most_chars <= 2 * window_chars(tokenizer, MAX_LENGTH) < len(PAIR) // 5
    assert len(row_ids(got.train, 0)) == MAX_LENGTH


def test_the_cut_cell_gives_the_tokens_the_whole_cell_gave(tmp_path: Path, tokenizer: Any) -> None:
    for case, expected in (
        ("sequence_classification", tokenizer(HUGE, truncation=True, max_length=MAX_LENGTH)),
        (
            "sequence_classification pairs",
            tokenizer(PAIR, PAIR, truncation=True, max_length=MAX_LENGTH),
        ),
    ):
        rows, data = CASES[case]
        got = prepared(tmp_path / case, tokenizer, rows, "sequence_classification", **data)
        assert row_ids(got.train, 0) == expected["input_ids"]
        assert got.train.type_ids[:MAX_LENGTH].tolist() == expected["token_type_ids"]
    words = prepared(
        tmp_path / "words", tokenizer, *CASES["token_classification"][:1], "token_classification"
    )
    whole = tokenizer(WORDS, is_split_into_words=True, truncation=True, max_length=MAX_LENGTH)
    assert row_ids(words.train, 0) == whole["input_ids"]
    assert words.train.token_labels[1] == words.label_names.index("B-PER")


def test_a_causal_lm_text_cut_before_tokenizing_learns_no_end(
    tmp_path: Path, tokenizer: Any
) -> None:
    """A text that the window cuts goes on past it: even where the window's tokens fit in
    max_length (a long run of spaces drops out), no end token is learnt for it."""
    spaced = "word " + " " * len(HUGE)
    got = prepared(tmp_path, tokenizer, [{"text": spaced}, {"text": "a b"}], "causal_lm")
    ids = row_ids(got.train, 0)
    body = tokenizer("word", add_special_tokens=False)["input_ids"]
    assert ids == [tokenizer.cls_token_id, *body]  # no [SEP]: the text does not end there
    labels = got.train.token_labels[got.train.offsets[0] : got.train.offsets[1]].tolist()
    assert labels == [*body, IGNORE]
    assert row_ids(got.train, 1)[-1] == tokenizer.sep_token_id  # a whole text ends


def test_one_huge_cell_costs_the_memory_of_a_row(tmp_path: Path) -> None:
    """Measured in a process of its own: the tokenizer's memory is native, unseen by
    tracemalloc. Before the cut, a 4 MB cell took 650 MB more (30 MB: 5 GB)."""
    cell = "the quick brown fox jumps over the lazy dog " * 100_000  # 4.4 MB
    train = write_jsonl(
        tmp_path / "train.jsonl", [{"text": cell, "label": "pos"}, *easy_rows(20, 0)]
    )
    code = f"""
import resource
from hpo.trainer.config import DataConfig, ModelConfig
from hpo.trainer.model import load_tokenizer
from hpo.trainer.tasks import prepare_data
tokenizer = load_tokenizer(ModelConfig(tokenizer={MINILM_TOKENIZER!r}, config={{"model_type": "bert"}}))
tokenizer(["warm up"], truncation=True, max_length=8)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
config = DataConfig(train_file={str(train)!r}, eval_file={str(train)!r}, cache_dir={str(tmp_path)!r})
prepare_data(config, tokenizer)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""  # noqa: E501
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    grown_kib = int(run.stdout.split()[-1])
    assert grown_kib < 64 * 1024, f"{grown_kib / 1024:.0f} MiB more to prepare a 4 MB cell"


def test_a_line_or_row_past_max_row_mib_is_refused_naming_it(
    tmp_path: Path, tokenizer: Any
) -> None:
    long_text = "x" * (MIB + 10)
    jsonl = write_jsonl(
        tmp_path / "t.jsonl", [{"text": "a", "label": "x"}, {"text": long_text, "label": "y"}]
    )
    csv_row = tmp_path / "row.csv"  # a quoted field over several lines: the row is what counts
    csv_row.write_text('text,label\na,x\n"' + "y\n" * (MIB // 2 + 8) + '",y\n', encoding="utf-8")
    header = tmp_path / "header.csv"
    header.write_text(",".join(f"c{i}" for i in range(MIB // 4)) + "\n", encoding="utf-8")
    for path, where in (
        (jsonl, "line 2"),
        (csv_row, "row 2 (from line 3)"),
        (header, "the header (from line 1)"),
    ):
        config = DataConfig(train_file=str(path), eval_file=str(path), max_row_mib=1)
        with pytest.raises(DataError) as caught:
            prepare_data(config, tokenizer)
        assert str(caught.value).startswith(
            f"{path}: {where} is longer than 1 MiB (data.max_row_mib), so it is not read"
        )


def test_a_line_of_exactly_max_row_mib_is_read(tmp_path: Path, tokenizer: Any) -> None:
    frame = json.dumps({"text": "", "label": "pos"}) + "\n"
    room = MIB - len(frame.encode())
    line = frame.replace('""', '"' + "x" * (room % 2) + "é" * (room // 2) + '"')
    assert len(line.encode()) == MIB  # its end included; two bytes a character: bytes count
    path = tmp_path / "t.jsonl"
    path.write_text(line + '{"text": "b", "label": "neg"}\n', encoding="utf-8")
    config = DataConfig(
        train_file=str(path), eval_file=str(path), max_row_mib=1, cache_dir=str(tmp_path / "cache")
    )
    assert len(prepare_data(config, tokenizer).train) == 2
    path.write_text("é" + line, encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{path}: line 1 is longer than 1 MiB")):
        prepare_data(config, tokenizer)


def test_a_wide_csv_header_costs_only_the_columns_the_run_reads(
    tmp_path: Path, tokenizer: Any
) -> None:
    """The header of the widest CSV read, rows of two fields: before, every row was padded to
    the header's width (a million columns: 3 GB at 150 rows, a MemoryError at 2,400)."""
    path = tmp_path / "wide.csv"
    names = ["text", "label", *(f"extra{i}" for i in range(MAX_CSV_COLUMNS - 2))]
    rows = "".join(f"{row['text']},{row['label']}\n" for row in easy_rows(400, 0))
    path.write_text(",".join(names) + "\n" + rows, encoding="utf-8")
    config = DataConfig(train_file=str(path), eval_file=str(path), cache_dir=str(tmp_path / "c"))
    tracemalloc.start()
    try:
        got = prepare_data(config, tokenizer)
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(got.train) == 400 and got.label_names == ["neg", "pos"]
    # Padded, the 400 rows alone would hold 400 x 16,384 fields: 52 MB of pointers.
    assert peak_bytes < 20 * MIB, f"{peak_bytes / MIB:.0f} MiB"


def test_a_csv_header_past_the_widest_is_refused_in_one_line(
    tmp_path: Path, tokenizer: Any
) -> None:
    path = tmp_path / "wide.csv"
    header = ",".join(["text", "label", *(f"c{i}" for i in range(MAX_CSV_COLUMNS - 1))])
    path.write_text(header + "\ngood,pos\nbad,neg\n", encoding="utf-8")
    with pytest.raises(DataError) as caught:
        prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)
    message = str(caught.value)
    assert message.startswith(f"{path}: the header has 16,385 columns, more than hpo reads")
    assert len(message.splitlines()) == 1 and len(message) < 300


def test_a_missing_column_of_a_wide_csv_lists_its_header(tmp_path: Path, tokenizer: Any) -> None:
    path = write_csv(tmp_path / "t.csv", [{"txt": "a", "label": "x", "other": "1"}])
    with pytest.raises(
        DataError,
        match=re.escape(
            "no column 'text' (columns: ['label', 'other', 'txt']); set data.text_column"
        ),
    ):
        prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)


@pytest.mark.parametrize(
    ("task", "column", "expected"),
    [
        ("sequence_classification", "label", "row 2 has the label NaN, which names no class"),
        ("regression", "label", "row 2 of column 'label' is nan, not a finite number"),
    ],
)
def test_a_jsonl_nan_target_is_called_nan_not_missing(
    tmp_path: Path, tokenizer: Any, task: str, column: str, expected: str
) -> None:
    rows = [{"text": "a", column: 1}, {"text": "b", column: math.nan}, {"text": "c", column: 2}]
    with pytest.raises(DataError, match=re.escape(expected)):
        prepared(tmp_path, tokenizer, rows, task)
