"""Token classification (named entities in BIO tags): encoding on each word's first sub-token,
collation, the loss and its exact accumulation over micro-batches, seqeval's entity metrics,
the chance level, bad input, and one study end to end through `hpo run`."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpo.trainer.batching import collate
from hpo.trainer.config import DataConfig, ModelConfig, TrainingConfig
from hpo.trainer.errors import DataError
from hpo.trainer.model import build_model, load_tokenizer
from hpo.trainer.step import accumulate_gradients
from hpo.trainer.tasks import make_task, prepare_data
from hpo.trainer.tasks.base import IGNORE, Task
from tests.conftest import MINILM_TOKENIZER, TINY_BERT, tiny_config, write_config, write_csv
from tests.task_study import run_task_study

TASK = "token_classification"
NER_COLUMNS = {"text_column": "tokens", "label_column": "tags"}
PEOPLE = ["Maria", "Kenji", "Olga", "Pedro", "Aisha", "Lars"]
SURNAMES = ["Okafor", "Tanaka", "Nilsson", "Haddad"]
PLACES = ["Lagos", "Oslo", "Lima", "Buenos Aires", "Cape Town", "Hanoi"]
ORGS = ["Acme Corporation", "Summit Bank", "Orion Systems", "Helix Pharma"]
TEMPLATES = [
    "{PER} flew to {LOC} today .",
    "{PER} works for {ORG} in {LOC} .",
    "{ORG} opened an office in {LOC} .",
    "yesterday {PER} met {PER} .",
    "the weather was fine .",
]


def ner_rows(n: int, seed: int) -> list[dict[str, list[str]]]:
    """Template sentences with people, places and organisations from short lists: a tiny model
    tags them after a few dozen steps."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words: list[str] = []
        tags: list[str] = []
        for piece in rng.choice(TEMPLATES).split():
            kind = piece[1:-1] if piece.startswith("{") else None
            if kind is None:
                words.append(piece)
                tags.append("O")
                continue
            if kind == "PER":
                entity = [rng.choice(PEOPLE)] + (
                    [rng.choice(SURNAMES)] if rng.random() < 0.5 else []
                )
            else:
                entity = rng.choice(PLACES if kind == "LOC" else ORGS).split()
            words += entity
            tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(entity) - 1)
        rows.append({"tokens": words, "tags": tags})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def data_config(train: Path, evaluation: Path, max_length: int = 32) -> DataConfig:
    return DataConfig(
        train_file=str(train),
        eval_file=str(evaluation),
        text_column="tokens",
        label_column="tags",
        max_length=max_length,
    )


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER))


@pytest.fixture
def ner_files(tmp_path: Path) -> tuple[Path, Path]:
    return (
        write_jsonl(tmp_path / "train.jsonl", ner_rows(96, 1)),
        write_jsonl(tmp_path / "eval.jsonl", ner_rows(32, 2)),
    )


def task_for(config: DataConfig, training: TrainingConfig | None = None) -> Task:
    return make_task(TASK, config, training or TrainingConfig())


# -- encoding and collation ------------------------------------------------------------------------


def test_each_words_first_sub_token_carries_its_tag_and_cut_words_count_for_nothing(
    tmp_path: Path, tokenizer: Any
) -> None:
    rows = [
        {
            "tokens": ["Angela", "Merkel", "visited", "Berlinerstrasse", "today"],
            "tags": ["B-PER", "I-PER", "O", "B-LOC", "O"],
        }
    ]
    files = write_jsonl(tmp_path / "t.jsonl", rows), write_jsonl(tmp_path / "e.jsonl", rows)
    data = prepare_data(data_config(*files, max_length=7), tokenizer, TASK)
    assert data.label_names == ["B-LOC", "B-PER", "I-PER", "O"]  # sorted, "O" among them
    split = data.train
    tokens = tokenizer.convert_ids_to_tokens(split.ids.tolist())
    assert tokens == ["[CLS]", "angela", "mer", "##kel", "visited", "berlin", "[SEP]"]
    names = dict(enumerate(data.label_names))
    shown = [names.get(int(t), "-") for t in split.token_labels]
    # "##kel" and the specials count for nothing; "##erstrasse" and "today" were cut off.
    assert shown == ["-", "B-PER", "I-PER", "-", "O", "B-LOC", "-"]


def byte_level_bpe_tokenizer(folder: Path) -> Path:
    """A RoBERTa-style byte-level BPE tokenizer trained here on a few sentences (no hub)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import RobertaTokenizerFast

    texts = [" ".join(row["tokens"]) for row in ner_rows(64, 3)]
    bpe = ByteLevelBPETokenizer()
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe.train_from_iterator(texts, vocab_size=400, min_frequency=1, special_tokens=specials)
    RobertaTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
    ).save_pretrained(folder)
    return folder


def test_a_byte_level_bpe_tokenizer_reads_each_word_as_in_running_text(tmp_path: Path) -> None:
    """RoBERTa's and GPT-2's tokenizers mark a word's leading space ("Ġlives"); words given one
    by one get none unless the tokenizer adds it (add_prefix_space), and the model would see
    tokens it never saw in text. Loaded for token classification, it adds it; for other tasks
    the tokenizer is left as it is."""
    folder = byte_level_bpe_tokenizer(tmp_path / "bpe")
    model = ModelConfig(config={"model_type": "roberta"}, tokenizer=str(folder))
    as_is = load_tokenizer(model, "sequence_classification")
    assert as_is.add_prefix_space is False
    words_tokenizer = load_tokenizer(model, TASK)
    assert words_tokenizer.add_prefix_space is True
    row = {
        "tokens": ["Angela", "Merkel", "visited", "Berlin", "today"],
        "tags": ["B-PER", "I-PER", "O", "B-LOC", "O"],
    }
    files = write_jsonl(tmp_path / "t.jsonl", [row]), write_jsonl(tmp_path / "e.jsonl", [row])
    data = prepare_data(data_config(*files), words_tokenizer, TASK)
    tokens = words_tokenizer.convert_ids_to_tokens(data.train.ids.tolist())
    labels = data.train.token_labels
    labelled = [t for t, label in zip(tokens, labels, strict=True) if label != IGNORE]
    assert len(labelled) == 5  # one tag per word, on its first sub-token
    # Each word starts with the space mark, as the same words inside a sentence do.
    assert all(token.startswith("Ġ") for token in labelled), tokens
    in_text = words_tokenizer(" ".join(row["tokens"]))["input_ids"]
    assert data.train.ids.tolist() == in_text  # the same ids as the sentence read as text


def test_a_csv_holds_words_and_tags_separated_by_spaces(
    tmp_path: Path, ner_files: tuple[Path, Path], tokenizer: Any
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = ner_rows(96, 1)
    csv_file = write_csv(
        tmp_path / "train.csv",
        [{"tokens": " ".join(r["tokens"]), "tags": " ".join(r["tags"])} for r in rows],
    )
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    from_jsonl = prepare_data(data_config(*ner_files), tokenizer, TASK)
    for train in (csv_file, parquet):
        other = prepare_data(data_config(train, ner_files[1]), tokenizer, TASK)
        assert other.label_names == from_jsonl.label_names
        np.testing.assert_array_equal(other.train.ids, from_jsonl.train.ids)
        np.testing.assert_array_equal(other.train.token_labels, from_jsonl.train.token_labels)


def test_collate_pads_the_tags_with_ignore(ner_files: tuple[Path, Path], tokenizer: Any) -> None:
    data = prepare_data(data_config(*ner_files), tokenizer, TASK)
    short, long = int(np.argmin(data.train.lengths)), int(np.argmax(data.train.lengths))
    batch = collate(data.train, np.array([short, long]), data.pad_token_id)
    labels = batch["labels"]
    assert labels.shape == batch["input_ids"].shape == (2, data.train.lengths[long])
    n = data.train.lengths[short]
    start = data.train.offsets[short]
    assert labels[0, :n].tolist() == data.train.token_labels[start : start + n].tolist()
    assert (labels[0, n:] == IGNORE).all() and (batch["attention_mask"][0, n:] == 0).all()


# -- loss ------------------------------------------------------------------------------------------


def test_the_loss_is_cross_entropy_summed_over_counted_tokens() -> None:
    task = task_for(DataConfig())
    logits = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[IGNORE, 1, 3, IGNORE, IGNORE], [IGNORE, 0, 0, 2, IGNORE]])
    assert int(task.units(labels)) == 5
    mean = task.loss_sum(logits, labels) / task.units(labels)
    counted = labels != IGNORE
    expected = torch.nn.functional.cross_entropy(logits[counted], labels[counted])
    torch.testing.assert_close(mean, expected)
    # The batch finder's worst case counts every token of every example.
    worst = task.worst_case_labels(3, 48, 7)
    assert worst.shape == (3, 48) and int(task.units(worst)) == 3 * 48


def test_one_batch_of_32_and_8_micro_batches_of_4_give_the_same_gradient(
    ner_files: tuple[Path, Path], tokenizer: Any
) -> None:
    """Exact accumulation: each micro-batch's summed loss over the counted tokens of the whole
    step; micro-batches hold different numbers of counted tokens, so a mean of their means
    (transformers' bug of 2024) would weigh tokens unequally and differ."""
    config = data_config(*ner_files)
    data = prepare_data(config, tokenizer, TASK)
    cfg = TrainingConfig(label_smoothing=0.1)
    task = task_for(config, cfg)
    model_config = ModelConfig(config=dict(TINY_BERT), tokenizer=MINILM_TOKENIZER)
    model = build_model(model_config, data.label_names, seed=0, task=TASK).eval()  # no dropout
    twin = copy.deepcopy(model)
    indices = np.argsort(-data.train.lengths, kind="stable")[:32]  # longest: varied widths
    micro = [collate(data.train, part, data.pad_token_id) for part in np.split(indices, 8)]
    whole = [collate(data.train, indices, data.pad_token_id)]
    counts = [int(task.units(batch["labels"])) for batch in micro]
    assert len(set(counts)) > 1, counts  # the micro-batches count different numbers of tokens

    losses, grads = [], []
    for net, batches in ((model, micro), (twin, whole)):
        losses.append(accumulate_gradients(net, batches, cfg, nullcontext, task))
        grads.append([p.grad.clone() for p in net.parameters() if p.grad is not None])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    # The step's loss is the mean over its counted tokens (not over examples) ...
    with torch.no_grad():
        labels = whole[0]["labels"]
        logits = twin(**_inputs(whole[0])).logits
        counted = labels != IGNORE
        expected = torch.nn.functional.cross_entropy(
            logits[counted], labels[counted], label_smoothing=0.1
        )
    torch.testing.assert_close(losses[1], expected, rtol=1e-5, atol=1e-6)
    # ... and the mean of the micro-batches' mean losses is not it.
    with torch.no_grad():
        means = [
            task.loss_sum(model(**_inputs(b)).logits, b["labels"], None, 0.1) / n
            for b, n in zip(micro, counts, strict=True)
        ]
    assert abs(float(sum(means) / len(means)) - float(losses[1])) > 1e-4


def _inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}


# -- metrics ---------------------------------------------------------------------------------------

NAMES = ["B-LOC", "B-ORG", "B-PER", "I-LOC", "I-ORG", "I-PER", "O"]


Tags = list[list[str]]  # one list of tag names per example, as seqeval takes them


def _random_tag_batches(seed: int) -> tuple[dict[str, list[np.ndarray]], Tags, Tags]:
    """Evaluation outputs in batches of different widths (IGNORE on specials, sub-tokens and
    padding), and the same tags as seqeval takes them: one list of names per example."""
    rng = np.random.default_rng(seed)
    outputs: dict[str, list[np.ndarray]] = {"predictions": [], "labels": []}
    truth: Tags = []
    predicted: Tags = []
    for _ in range(6):
        size, width = int(rng.integers(1, 6)), int(rng.integers(3, 20))
        labels = rng.integers(0, len(NAMES), (size, width))
        labels[rng.random((size, width)) < 0.3] = IGNORE
        labels[:, 0] = IGNORE  # [CLS]
        # Mostly right, sometimes wrong: the tag sequences are then often not valid IOB2
        # (an I- after O, a type switch inside an entity): seqeval's default rules decide.
        predictions = np.where(
            rng.random((size, width)) < 0.7, labels, rng.integers(0, len(NAMES), (size, width))
        )
        predictions[labels == IGNORE] = rng.integers(0, len(NAMES), int((labels == IGNORE).sum()))
        outputs["labels"].append(labels)
        outputs["predictions"].append(predictions)
        for row_labels, row_predictions in zip(labels, predictions, strict=True):
            counted = row_labels != IGNORE
            truth.append([NAMES[i] for i in row_labels[counted]])
            predicted.append([NAMES[i] for i in row_predictions[counted]])
    return outputs, truth, predicted


@pytest.mark.parametrize("seed", range(5))
def test_entity_metrics_are_seqevals_and_token_accuracy_counts_counted_tokens(seed: int) -> None:
    from seqeval.metrics import accuracy_score, f1_score, precision_score, recall_score

    outputs, truth, predicted = _random_tag_batches(seed)
    found = task_for(DataConfig()).metrics(outputs, 0.25, NAMES)
    assert set(found) == {"f1", "precision", "recall", "token_accuracy", "eval_loss"}
    assert found["f1"] == pytest.approx(f1_score(truth, predicted), abs=1e-6)
    assert found["precision"] == pytest.approx(precision_score(truth, predicted), abs=1e-6)
    assert found["recall"] == pytest.approx(recall_score(truth, predicted), abs=1e-6)
    assert found["token_accuracy"] == pytest.approx(accuracy_score(truth, predicted), abs=1e-6)
    assert found["eval_loss"] == 0.25
    assert 0 < found["f1"] < 1  # a case that tells right from wrong


def test_an_entity_counts_only_when_its_type_and_span_both_match() -> None:
    index = {name: i for i, name in enumerate(NAMES)}
    truth = ["B-PER", "I-PER", "O", "B-LOC", "I-LOC", "O", "B-ORG"]
    guess = ["B-PER", "I-PER", "O", "B-LOC", "O", "O", "B-LOC"]  # span cut short; wrong type
    labels = np.array([[IGNORE] + [index[t] for t in truth] + [IGNORE]])
    predictions = np.array([[0] + [index[t] for t in guess] + [0]])
    found = task_for(DataConfig()).metrics(
        {"predictions": [predictions], "labels": [labels]}, 0.0, NAMES
    )
    assert found["precision"] == pytest.approx(1 / 3)
    assert found["recall"] == pytest.approx(1 / 3)
    assert found["token_accuracy"] == pytest.approx(5 / 7)


def test_the_chance_level_tags_every_word_with_the_most_common_tag(
    ner_files: tuple[Path, Path], tokenizer: Any
) -> None:
    data = prepare_data(data_config(*ner_files), tokenizer, TASK)
    levels = task_for(data_config(*ner_files)).chance_levels(data.eval, data.label_names)
    counted = data.eval.token_labels[data.eval.token_labels != IGNORE]
    share_o = float(np.mean(counted == data.label_names.index("O")))
    assert levels["token_accuracy"] == pytest.approx(share_o)
    assert levels["f1"] == levels["precision"] == levels["recall"] == 0.0  # no entity found
    shares = np.bincount(counted) / len(counted)
    shares = shares[shares > 0]
    assert levels["eval_loss"] == pytest.approx(float(-np.sum(shares * np.log(shares))))


# -- bad input -------------------------------------------------------------------------------------

GOOD = {"tokens": ["Maria", "flew", "to", "Oslo"], "tags": ["B-PER", "O", "O", "B-LOC"]}
BAD_CASES = [
    (
        "train",
        {"tokens": ["Maria", "flew"], "tags": ["B-PER"]},
        "train.jsonl: row 2 has 2 words but 1 tags; give every word exactly one tag",
    ),
    (
        "train",
        {"tokens": ["Maria", "flew"], "tags": ["PER", "O"]},
        "train.jsonl: row 2, tag 1 of column 'tags' is 'PER', not a BIO tag; use 'O' or B-/I-",
    ),
    (
        "eval",
        {"tokens": ["Acme", "won"], "tags": ["B-ORG", "O"]},
        "eval.jsonl: row 2, tag 1 of column 'tags' is 'B-ORG', which the training data never has",
    ),
    (
        "train",
        {"tokens": [], "tags": []},
        "train.jsonl: row 2 has no words in column 'tokens'; fill it in or drop the row",
    ),
    (
        "eval",
        {"tokens": "Maria flew", "tags": None},
        "eval.jsonl: row 2 has no tags in column 'tags'; fill it in or drop the row",
    ),
    (
        "train",
        {"tokens": ["Maria", ""], "tags": ["B-PER", "O"]},
        "train.jsonl: row 2, item 2 of column 'tokens' is empty",
    ),
    (
        "train",
        {"tokens": ["Maria", "flew"], "tags": [3, 0]},
        "train.jsonl: row 2, item 1 of column 'tags' is 3, not text; each of the tags must be a "
        "non-empty string (tags by name: 'B-PER', not ids)",
    ),
]


@pytest.mark.parametrize(
    ("split", "row", "message"),
    BAD_CASES,
    ids=[
        "unequal lengths",
        "not BIO",
        "tag only in eval",
        "no words",
        "no tags",
        "empty word",
        "tag ids",
    ],
)
def test_bad_rows_are_one_line_naming_the_file_row_and_fix(
    tmp_path: Path, tokenizer: Any, split: str, row: dict[str, Any], message: str
) -> None:
    rows = {"train": [GOOD], "eval": [GOOD]}
    rows[split] = [GOOD, row]
    files = (
        write_jsonl(tmp_path / "train.jsonl", rows["train"]),
        write_jsonl(tmp_path / "eval.jsonl", rows["eval"]),
    )
    with pytest.raises(DataError) as caught:
        prepare_data(data_config(*files), tokenizer, TASK)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert str(tmp_path) in str(caught.value)


def test_training_data_without_an_entity_is_refused(tmp_path: Path, tokenizer: Any) -> None:
    rows = [{"tokens": ["nothing", "here"], "tags": ["O", "O"]}]
    files = write_jsonl(tmp_path / "t.jsonl", rows), write_jsonl(tmp_path / "e.jsonl", rows)
    with pytest.raises(DataError, match="every tag in column 'tags' is 'O'; a tagger needs"):
        prepare_data(data_config(*files), tokenizer, TASK)


def test_a_max_length_that_leaves_no_word_is_refused(tmp_path: Path, tokenizer: Any) -> None:
    files = write_jsonl(tmp_path / "t.jsonl", [GOOD]), write_jsonl(tmp_path / "e.jsonl", [GOOD])
    with pytest.raises(DataError, match="no word keeps a token after truncation to data.max_"):
        prepare_data(data_config(*files, max_length=2), tokenizer, TASK)  # [CLS] [SEP] only


def test_bad_ner_input_through_hpo_run_exits_2_and_writes_nothing(
    tmp_path: Path,
    ner_files: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad_eval = write_jsonl(tmp_path / "bad-eval.jsonl", [GOOD, {"tokens": ["a"], "tags": ["X"]}])
    for change, message in (
        (
            {"data": {"eval_file": str(bad_eval)}},
            "bad-eval.jsonl: row 2, tag 1 of column 'tags' is 'X', not a BIO tag",
        ),
        ({"training": {"class_weights": "balanced"}}, "training.class_weights"),
        ({"study": {"metric": "accuracy"}}, "f1, precision, recall, token_accuracy, eval_loss"),
    ):
        raw = ner_config(*ner_files)
        for section, values in change.items():
            raw[section].update(values)
        config = write_config(tmp_path / "bad.yaml", raw)
        database = tmp_path / "must-not-exist.db"
        capsys.readouterr()
        code = hpo_main(
            ["run", "--study", "s", "--config", str(config), "--storage", f"sqlite:///{database}"]
        )
        err = capsys.readouterr().err
        assert code == 2 and message in err, err
        assert "Traceback" not in err and not database.exists()


# -- end to end ------------------------------------------------------------------------------------


def ner_config(train: Path, evaluation: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    raw = tiny_config(train, evaluation, **sections)
    raw["task"] = TASK
    raw["study"]["metric"] = "f1"
    raw["data"].update(NER_COLUMNS)
    return raw


def test_a_ner_study_prunes_resumes_and_downloads_a_token_classifier(
    tmp_path: Path,
    ner_files: tuple[Path, Path],
    hpo_main: Callable[[list[str]], int],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Through `hpo run`: a trial stopped by SIGTERM and resumed from its checkpoint, one
    pruned; `hpo best --download` gives a folder that loads as a token classifier with the tags
    as its labels, and tags a new sentence."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    run = run_task_study(
        tmp_path,
        hpo_main,
        capsys,
        TASK,
        ner_files,
        "f1",
        data=NER_COLUMNS,
        training={"epochs": 6, "evals_per_epoch": 1},
    )

    assert run.resumed.value is not None and run.resumed.value > 0.5  # chance: 0
    assert "best trial #1" in run.finished and "f1=" in run.finished, run.finished

    model = AutoModelForTokenClassification.from_pretrained(run.model_dir).eval()
    assert list(model.config.id2label.values()) == [
        "B-LOC",
        "B-ORG",
        "B-PER",
        "I-LOC",
        "I-ORG",
        "I-PER",
        "O",
    ]
    # It tags: each word's first sub-token, read back through the model's own tokenizer.
    words = ["Kenji", "Tanaka", "flew", "to", "Cape", "Town", "today", "."]
    encoded = AutoTokenizer.from_pretrained(run.model_dir)(
        words, is_split_into_words=True, return_tensors="pt"
    )
    with torch.no_grad():
        predicted = model(**encoded).logits.argmax(-1)[0].tolist()
    word_ids = encoded.word_ids()
    tags = [model.config.id2label[predicted[word_ids.index(w)]] for w in range(len(words))]
    assert tags == ["B-PER", "I-PER", "O", "O", "B-LOC", "I-LOC", "O", "O"], tags
