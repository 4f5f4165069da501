"""Data: every input format, labels, the tokenization cache, length grouping and padding."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hpo.trainer.batching import Padding, collate, eval_batches, plan_epoch
from hpo.trainer.config import DataConfig, ModelConfig
from hpo.trainer.data import save_split
from hpo.trainer.errors import DataError
from hpo.trainer.model import load_tokenizer
from hpo.trainer.readers import read_table
from hpo.trainer.tasks import prepare_data
from tests.conftest import MINILM_TOKENIZER, easy_rows, loaded_by, write_csv


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(ModelConfig(tokenizer=MINILM_TOKENIZER, config={"model_type": "bert"}))


def write_format(folder: Path, name: str, rows: list[dict[str, Any]], fmt: str) -> Path:
    if fmt == "csv":
        return write_csv(folder / f"{name}.csv", rows)
    if fmt == "jsonl":
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return path
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    import datasets

    path = folder / name
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet", "saved"])
def test_every_format_gives_the_same_tokens(tmp_path: Path, fmt: str, tokenizer: Any) -> None:
    rows = easy_rows(40, 3)
    reference = prepare_data(
        DataConfig(
            train_file=str(write_csv(tmp_path / "ref.csv", rows)),
            eval_file=str(write_csv(tmp_path / "ref_eval.csv", rows[:10])),
            cache_dir=str(tmp_path / "c1"),
        ),
        tokenizer,
    )
    train = write_format(tmp_path, "train", rows, fmt)
    evaluation = write_format(tmp_path, "eval", rows[:10], fmt)
    got = prepare_data(
        DataConfig(
            train_file=str(train), eval_file=str(evaluation), cache_dir=str(tmp_path / "c2")
        ),
        tokenizer,
    )
    assert got.label_names == reference.label_names == ["neg", "pos"]
    np.testing.assert_array_equal(got.train.ids, reference.train.ids)
    np.testing.assert_array_equal(got.train.labels, reference.train.labels)
    np.testing.assert_array_equal(got.eval.offsets, reference.eval.offsets)


def test_saved_dataset_dict_splits(tmp_path: Path, tokenizer: Any) -> None:
    import datasets

    rows = easy_rows(30, 4)
    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows),
            "validation": datasets.Dataset.from_list(rows[:6]),
        }
    ).save_to_disk(str(folder))
    got = prepare_data(DataConfig(train_file=str(folder), eval_file=str(folder)), tokenizer)
    assert (len(got.train), len(got.eval)) == (30, 6)
    with pytest.raises(DataError, match="has splits"):
        prepare_data(
            DataConfig(train_file=str(folder), eval_file=str(folder), eval_split="test"), tokenizer
        )


def test_sentence_pairs_and_integer_labels(tmp_path: Path, tokenizer: Any) -> None:
    rows = [
        {"premise": f"a man plays {i}", "hypothesis": "someone plays", "label": i % 3}
        for i in range(12)
    ]
    train = write_format(tmp_path, "train", rows, "jsonl")
    config = DataConfig(
        train_file=str(train),
        eval_file=str(train),
        text_column="premise",
        text_pair_column="hypothesis",
        max_length=16,
    )
    got = prepare_data(config, tokenizer)
    assert got.label_names == ["0", "1", "2"]
    np.testing.assert_array_equal(got.train.labels, [i % 3 for i in range(12)])
    assert got.train.type_ids is not None and got.train.type_ids.max() == 1  # second segment


def test_truncation_to_max_length(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"text": "word " * 200, "label": "a"}, {"text": "short", "label": "b"}]
    path = write_csv(tmp_path / "t.csv", rows)
    got = prepare_data(
        DataConfig(train_file=str(path), eval_file=str(path), max_length=20), tokenizer
    )
    assert got.train.lengths.max() == 20


def test_cache_skips_tokenization_on_the_second_load(
    tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    train = write_csv(tmp_path / "train.csv", easy_rows(20, 5))
    config = DataConfig(
        train_file=str(train), eval_file=str(train), cache_dir=str(tmp_path / "cache")
    )
    first = prepare_data(config, tokenizer)
    calls = []
    import hpo.trainer.tasks.base as task_base

    real = task_base.tokenize_texts
    monkeypatch.setattr(
        task_base, "tokenize_texts", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    second = prepare_data(config, tokenizer)
    assert calls == []
    np.testing.assert_array_equal(first.train.ids, second.train.ids)
    # A different max length, or changed data, is a different cache entry.
    prepare_data(DataConfig(**{**config.__dict__, "max_length": 8}), tokenizer)
    assert len(calls) == 2
    write_csv(train, easy_rows(21, 5))
    prepare_data(config, tokenizer)
    assert len(calls) == 4


def test_cached_splits_are_memory_mapped_and_travel_as_their_path(
    tmp_path: Path, tokenizer: Any
) -> None:
    train = write_csv(tmp_path / "train.csv", easy_rows(300, 5))
    config = DataConfig(
        train_file=str(train), eval_file=str(train), cache_dir=str(tmp_path / "cache")
    )
    split = prepare_data(config, tokenizer).train
    assert isinstance(split.ids, np.memmap) and not split.ids.flags.writeable
    assert split.cached_at is not None and split.cached_at.parent == tmp_path / "cache"
    sent = pickle.dumps(split)
    assert len(sent) < 1000 < split.ids.nbytes  # the path, not the tokens
    got = pickle.loads(sent)
    assert isinstance(got.ids, np.memmap) and got.cached_at == split.cached_at
    np.testing.assert_array_equal(got.ids, split.ids)
    # An entry removed meanwhile (a cleaned cache): the pages still mapped here travel instead.
    shutil.rmtree(split.cached_at)
    got = pickle.loads(pickle.dumps(split))
    assert got.cached_at is None and not isinstance(got.ids, np.memmap)
    np.testing.assert_array_equal(got.ids, split.ids)
    np.testing.assert_array_equal(got.labels, split.labels)


@pytest.mark.parametrize("damage", ["truncated", "offsets of another split", "file missing"])
def test_a_damaged_cache_entry_is_rebuilt(tmp_path: Path, tokenizer: Any, damage: str) -> None:
    train = write_csv(tmp_path / "train.csv", easy_rows(30, 5))
    config = DataConfig(
        train_file=str(train), eval_file=str(train), cache_dir=str(tmp_path / "cache")
    )
    first = prepare_data(config, tokenizer).train
    assert first.cached_at is not None
    expected = np.array(first.ids), np.array(first.offsets)
    entry = first.cached_at
    del first
    if damage == "truncated":
        (entry / "ids.npy").write_bytes((entry / "ids.npy").read_bytes()[:100])
    elif damage == "offsets of another split":
        np.save(entry / "offsets.npy", np.arange(5, dtype=np.int64))
    else:
        (entry / "labels.npy").unlink()
    again = prepare_data(config, tokenizer).train
    np.testing.assert_array_equal(again.ids, expected[0])
    np.testing.assert_array_equal(again.offsets, expected[1])
    assert sorted(p.name for p in entry.parent.iterdir() if p.name.startswith(".")) == []


def test_a_second_writer_of_an_entry_keeps_the_first(tmp_path: Path, tokenizer: Any) -> None:
    train = write_csv(tmp_path / "train.csv", easy_rows(30, 5))
    config = DataConfig(
        train_file=str(train), eval_file=str(train), cache_dir=str(tmp_path / "cache")
    )
    first = prepare_data(config, tokenizer).train
    assert first.cached_at is not None
    written = sorted((p.name, p.stat().st_mtime_ns) for p in first.cached_at.iterdir())
    save_split(first, first.cached_at)  # as a worker that lost the race would
    assert sorted((p.name, p.stat().st_mtime_ns) for p in first.cached_at.iterdir()) == written
    assert not [p for p in first.cached_at.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"txt": "a", "label": "x"}, {"txt": "b", "label": "y"}], "no column 'text'"),
        ([{"text": "a", "label": ""}], "row 1 has no label"),
    ],
)
def test_bad_rows_name_the_problem(
    tmp_path: Path, tokenizer: Any, rows: list[dict[str, str]], message: str
) -> None:
    path = write_csv(tmp_path / "bad.csv", rows)
    with pytest.raises(DataError, match=message):
        prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)


def test_label_only_in_evaluation(tmp_path: Path, tokenizer: Any) -> None:
    train = write_csv(
        tmp_path / "train.csv", [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}]
    )
    evaluation = write_csv(tmp_path / "eval.csv", [{"text": "c", "label": "z"}])
    with pytest.raises(DataError, match=r"labels \['z'\] never appear in the training data"):
        prepare_data(DataConfig(train_file=str(train), eval_file=str(evaluation)), tokenizer)


def test_empty_file_and_unknown_format(tmp_path: Path, tokenizer: Any) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    with pytest.raises(DataError, match="no rows"):
        prepare_data(DataConfig(train_file=str(empty), eval_file=str(empty)), tokenizer)
    odd = tmp_path / "data.xlsx"
    odd.write_text("x")
    with pytest.raises(DataError, match="unsupported format"):
        prepare_data(DataConfig(train_file=str(odd), eval_file=str(odd)), tokenizer)


def test_epoch_plan_covers_every_example_once_in_balanced_micro_batches() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 120, size=1003)
    plan = plan_epoch(lengths, effective_batch_size=64, grad_accum_steps=3, seed=7, epoch=0)
    flat = np.concatenate([mb for step in plan for mb in step])
    assert sorted(flat.tolist()) == list(range(1003))
    assert len(plan) == -(-1003 // 64)
    assert sum(1 for step in plan if sum(map(len, step)) != 64) == 1  # only one partial step
    for step in plan:
        sizes = [len(mb) for mb in step]
        assert max(sizes) - min(sizes) <= 1

    # Grouping by length: far less padding than a plain shuffle.
    def padding(batches: list[np.ndarray]) -> int:
        return sum(int(lengths[b].max()) * len(b) - int(lengths[b].sum()) for b in batches)

    shuffled = np.array_split(rng.permutation(1003), len(plan) * 3)
    assert padding([mb for step in plan for mb in step]) < padding(shuffled) / 3
    # Steps are shuffled across the epoch and differ between epochs, but are reproducible.
    step_max = [max(lengths[np.concatenate(s)]) for s in plan]
    assert step_max != sorted(step_max) and step_max != sorted(step_max, reverse=True)
    again = plan_epoch(lengths, 64, 3, seed=7, epoch=0)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(plan, again, strict=True))
    other = plan_epoch(lengths, 64, 3, seed=7, epoch=1)
    assert not np.array_equal(plan[0][0], other[0][0])


def test_eval_batches_in_length_order() -> None:
    lengths = np.array([5, 1, 9, 3, 7])
    batches = eval_batches(lengths, 2)
    assert [b.tolist() for b in batches] == [[1, 3], [0, 4], [2]]


def test_collate_pads_dynamically(tmp_path: Path, tokenizer: Any) -> None:
    path = write_csv(
        tmp_path / "t.csv",
        [{"text": "one", "label": "a"}, {"text": "one two three four", "label": "b"}],
    )
    got = prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)
    batch = collate(got.train, np.array([0, 1]), got.pad_token_id, Padding(8))
    width = int(got.train.lengths.max())
    assert batch["input_ids"].shape == (2, 8)
    assert batch["attention_mask"].sum(dim=1).tolist() == got.train.lengths.tolist()
    assert (batch["input_ids"][0, got.train.lengths[0] :] == got.pad_token_id).all()
    assert collate(got.train, np.array([0]), got.pad_token_id)["input_ids"].shape[1] < width


def test_bucketed_padding_gives_few_widths_and_never_passes_max_length() -> None:
    buckets = Padding(buckets=True, cap=512)
    widths = {buckets.width(n) for n in range(1, 513)}
    assert sorted(widths) == [32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert all(n <= buckets.width(n) <= max(32, n * 3 // 2) for n in range(1, 513))
    assert Padding(buckets=True, cap=100).width(97) == 100  # the cap is a width of its own
    assert Padding(buckets=True, cap=20).width(7) == 20
    assert Padding(8, cap=128).width(121) == 128 and Padding(8).width(9) == 16
    assert Padding().width(13) == 13


def test_training_labels_that_are_all_the_same_are_rejected(tmp_path: Path, tokenizer: Any) -> None:
    path = write_csv(tmp_path / "one.csv", [{"text": t, "label": "pos"} for t in ("a", "b")])
    with pytest.raises(DataError, match=r"every row of column 'label' has the label 'pos'"):
        prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_integer_labels_are_mapped_to_ids_by_rank(tmp_path: Path, tokenizer: Any, fmt: str) -> None:
    values = [200_000_000, 0, -3, 200_000_000, 7]
    rows = [{"text": f"example {i}", "label": v} for i, v in enumerate(values)]
    path = write_format(tmp_path, "ints", rows, fmt)
    got = prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)
    assert got.label_names == ["-3", "0", "7", "200000000"]  # 4 classes, not 200000001
    np.testing.assert_array_equal(got.train.labels, [3, 1, 0, 3, 2])
    np.testing.assert_array_equal(got.eval.labels, got.train.labels)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1, 0, "pos"], r"mixes label types: 1 \(row 1, integer\), 'pos' \(row 3, string\)"),
        ([1, True, 0], r"mixes label types: 1 \(row 1, integer\), True \(row 2, boolean\)"),
        ([0, 0.5, 1], r"row 2 of column 'label' has the label 0.5, a fractional number"),
    ],
    ids=["integer and string", "integer and boolean", "fractional"],
)
def test_labels_of_mixed_types_are_refused_not_made_extra_classes(
    tmp_path: Path, tokenizer: Any, values: list[Any], message: str
) -> None:
    rows = [{"text": f"example {i}", "label": v} for i, v in enumerate(values)]
    path = write_format(tmp_path, "mixed", rows, "jsonl")
    with pytest.raises(DataError, match=message):
        prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)


def test_integral_floats_and_integer_strings_name_the_same_classes(
    tmp_path: Path, tokenizer: Any
) -> None:
    rows = [{"text": "a", "label": 1.0}, {"text": "b", "label": 0}]
    train = write_format(tmp_path, "train", rows, "jsonl")
    evaluation = write_csv(tmp_path / "eval.csv", [{"text": "c", "label": "1"}])
    got = prepare_data(DataConfig(train_file=str(train), eval_file=str(evaluation)), tokenizer)
    assert got.label_names == ["0", "1"]
    np.testing.assert_array_equal(got.eval.labels, [1])


def test_csv_labels_are_read_as_numbers_where_they_are_numbers(
    tmp_path: Path, tokenizer: Any
) -> None:
    """A CSV holds only text: "1" and "1.0" are one class, as 1 and 1.0 are in JSONL (they once
    were two), ranked as numbers; a column with any other label keeps them all as names."""
    labels = ["1", "1.0", "0", "10", "2"]
    rows = [{"text": f"t{i}", "label": v} for i, v in enumerate(labels)]
    path = write_csv(tmp_path / "numbers.csv", rows)
    got = prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)
    assert got.label_names == ["0", "1", "2", "10"]
    np.testing.assert_array_equal(got.train.labels, [1, 1, 0, 3, 2])
    code_rows = [{"text": t, "label": v} for t, v in (("a", "1"), ("b", "other"), ("c", "1.5"))]
    codes = write_csv(tmp_path / "codes.csv", code_rows)
    got = prepare_data(DataConfig(train_file=str(codes), eval_file=str(codes)), tokenizer)
    assert got.label_names == ["1", "1.5", "other"]  # class names, as before


def test_the_label_column_is_never_the_text(tmp_path: Path) -> None:
    config = DataConfig(train_file="t.csv", eval_file="e.csv", text_column="label")
    assert ("text_column", "label", "must differ from label_column") in config.problems()
    config = DataConfig(train_file="t.csv", eval_file="e.csv", text_pair_column="label")
    assert ("text_pair_column", "label", "must differ from label_column") in config.problems()


def test_a_csv_row_with_more_fields_than_the_header_is_named(
    tmp_path: Path, tokenizer: Any
) -> None:
    """pandas made the first row's extra fields an index and shifted every row: row 2 was then
    said to have no label."""
    path = tmp_path / "extra.csv"
    path.write_text("text,label\na,b,c,positive\nfoo,negative\nbar,positive\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"extra.csv: row 1 has 4 fields, the header 2; quote"):
        prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)


def test_repeated_columns_in_a_csv_header_are_rejected(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "dup.csv"
    path.write_text("text,label,text\ngood,pos,bad\nbad,neg,good\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"dup.csv: column names \['text'\] appear more than once"):
        prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)


def test_repeated_keys_in_a_jsonl_row_are_rejected(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "dup.jsonl"
    path.write_text(
        '{"text": "good", "label": "pos"}\n{"text": "bad", "label": "neg", "text": "good"}\n',
        encoding="utf-8",
    )
    with pytest.raises(DataError, match=r"dup.jsonl: line 2 has the key 'text' more than once"):
        prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)


def test_repeated_columns_in_parquet_are_rejected(tmp_path: Path, tokenizer: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "dup.parquet"
    columns = [pa.array(["good", "bad"]), pa.array(["pos", "neg"]), pa.array(["x", "y"])]
    pq.write_table(pa.table(columns, names=["text", "label", "label"]), path)
    with pytest.raises(DataError, match=r"column names \['label'\] appear more than once"):
        prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)


def test_a_jsonl_line_that_is_not_json_is_named(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "good", "label": "pos"}\n{"text": "bad", \n', encoding="utf-8")
    with pytest.raises(DataError, match=r"line 2 is not valid JSON"):
        prepare_data(DataConfig(train_file=str(path), eval_file=str(path)), tokenizer)


def test_a_tab_separated_file_named_csv_is_called_tab_separated(tmp_path: Path) -> None:
    tsv = tmp_path / "train.csv"
    tsv.write_text("text\tlabel\ngood meal\tpos\nbad meal\tneg\n", encoding="utf-8")
    with pytest.raises(DataError) as caught:
        read_table(str(tsv), "train")
    assert "the file is tab-separated (TSV); hpo reads .csv files separated by commas" in str(
        caught.value
    )
    assert "'text\\tlabel'" in str(caught.value)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("\ufefftext,label\nhi,1\n", {"text": ["hi"], "label": ["1"]}),  # Excel's BOM
        ("text,label\r\nhi,1\r\nyo,0\r\n", {"text": ["hi", "yo"], "label": ["1", "0"]}),
        ("text,label\rhi,1\ryo,0\r", {"text": ["hi", "yo"], "label": ["1", "0"]}),  # old Mac
        ("text,label\nhi,1", {"text": ["hi"], "label": ["1"]}),  # no final newline
        ("text,label\n", {"text": [], "label": []}),
        ("\n\ntext,label\n\nhi,1\n   \n\nyo,0\n\n", {"text": ["hi", "yo"], "label": ["1", "0"]}),
        ("text,label\nhi,1\n,\n", {"text": ["hi", ""], "label": ["1", ""]}),  # a row, empty
        ('text\na\n""\n', {"text": ["a", ""]}),  # csv's one-column empty row, kept
        (
            'text,label\n"a, b",1\n"say ""hi""",0\n',
            {"text": ["a, b", 'say "hi"'], "label": ["1", "0"]},
        ),
        ('text,label\n"two\nlines",1', {"text": ["two\nlines"], "label": ["1"]}),
        ('text,label\nhe"llo,1\n"he"llo,0\n', {"text": ['he"llo', "hello"], "label": ["1", "0"]}),
        (
            "text,label,extra\nhi,1\nyo,0,x\n",
            {"text": ["hi", "yo"], "label": ["1", "0"], "extra": ["", "x"]},
        ),
        ("text,,label\nhi,x,1\n", {"text": ["hi"], "Unnamed: 1": ["x"], "label": ["1"]}),
        (" text ,label\n 1.50 ,NA\n", {" text ": [" 1.50 "], "label": ["NA"]}),  # text as it is
        ("text,label\n" + "x" * 200_000 + ",1\n", {"text": ["x" * 200_000], "label": ["1"]}),
    ],
    ids=[
        "bom",
        "crlf",
        "cr",
        "no final newline",
        "header only",
        "blank lines",
        "empty fields",
        "quoted empty field",
        "quotes",
        "quoted newline",
        "stray quotes",
        "short row",
        "unnamed columns",
        "verbatim",
        "200k-character field",
    ],
)
def test_a_csv_reads_as_pandas_read_it_every_field_as_text(
    tmp_path: Path, body: str, expected: dict[str, list[str]]
) -> None:
    """What pandas.read_csv(dtype=object, keep_default_na=False) gave, before the csv module
    replaced it (pandas cost each worker seconds of CPU to import)."""
    path = tmp_path / "table.csv"
    path.write_bytes(body.encode("utf-8"))
    assert read_table(str(path), "train") == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("", r"table.csv is empty: a CSV file starts with a header row that names its columns"),
        ("\n \n", r"table.csv is empty"),
        (
            'text,label\nhi,1\n"open,0\nyo,1\n',
            r"table.csv: the quoted field that starts on line 3 "
            r"is never closed; close its quote, and write a quote inside a quoted text as two",
        ),
        ("text,label\nhi,1\n\nyo,1,2\n", r"table.csv: row 2 has 3 fields, the header 2"),
        ("text,label\ncaf\xe9,1\n", r"line 2 is not valid UTF-8 \(byte 0xe9 at column 4\)"),
    ],
    ids=["empty", "blank", "quote never closed", "long row after a blank line", "latin-1"],
)
def test_a_broken_csv_is_one_line_naming_where(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "table.csv"
    path.write_bytes(body.encode("latin-1") if "\xe9" in body else body.encode("utf-8"))
    with pytest.raises(DataError, match=message):
        read_table(str(path), "train")


def test_reading_a_csv_imports_no_pandas(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", easy_rows(4, 0))
    code = (
        "from hpo.trainer.readers import read_table\n"
        f"assert read_table({str(path)!r}, 'train')['label']"
    )
    assert loaded_by(code, ("pandas",)) == []
