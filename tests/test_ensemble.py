"""hpo.ensemble on synthetic member predictions whose answer is known: greedy selection,
stacking (classification, regression, multi-label), honest scores, skops saving and its
refusals, soups, the feature cache; and data.test_file, which no trial reads."""

from __future__ import annotations

import dataclasses
import json
import pickle
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpo.ensemble import (
    ChosenBy,
    EnsembleError,
    EnsembleReport,
    FeatureCache,
    FeatureSettings,
    Learner,
    Split,
    adapter_soup,
    average,
    average_token_probabilities,
    evaluate_ensemble,
    greedy_selection,
    greedy_soup,
    load_ensemble,
    save_ensemble,
    stack_features,
    uniform_soup,
    weights_sha256,
)
from hpo.errors import HPOError
from tests.conftest import tiny_config, write_config

LR = ["logistic_regression"]
TWO_FOLDS: dict[str, Any] = {"learners": LR, "folds": 2}


def _probabilities(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def complementary(rows: int, seed: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Three classes; member `a` knows classes 0 and 1, member `b` knows class 2 (and says so
    with a margin the others lack): together they know every class, each alone does not."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, rows)
    members = {}
    for name, known in (("a", (0, 1)), ("b", (2,))):
        logits = rng.normal(0, 1, (rows, 3))
        hit = np.isin(labels, known)
        logits[hit, labels[hit]] += 4
        members[name] = _probabilities(logits)
    return labels, members


def accuracy_of(outputs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(outputs.argmax(axis=1) == labels))


def test_a_stack_of_two_complementary_members_beats_each_on_the_test_split() -> None:
    labels, members = complementary(300, 0)
    test_labels, test_members = complementary(300, 1)
    report = evaluate_ensemble(
        "sequence_classification",
        Split(members, labels),
        Split(test_members, test_labels),
        learners=LR,
    )
    assert report.measured_on == "test_split" and "test split" in report.how_measured
    best_single = max(accuracy_of(p, test_labels) for p in test_members.values())
    assert report.best_member_score == pytest.approx(best_single)
    assert report.stacked_score > best_single + 0.15
    assert report.stacking_beats_best_member and report.choice == "stacking"
    assert set(report.to_json()) >= {"soft_voting", "greedy_selection", "best_member", "stacking"}
    stacked = report.stacked
    assert stacked is not None
    outputs = stacked.predict(stack_features(test_members, ["a", "b"]))
    assert accuracy_of(outputs, test_labels) == pytest.approx(report.stacked_score)


def test_greedy_selection_does_not_count_a_duplicated_member_twice() -> None:
    labels, members = complementary(300, 2)
    alone = greedy_selection("sequence_classification", members, labels)
    doubled = greedy_selection(
        "sequence_classification", {**members, "a_copy": members["a"].copy()}, labels
    )
    assert alone.score > max(accuracy_of(p, labels) for p in members.values())
    assert doubled.score == pytest.approx(alone.score)
    weights = doubled.weights
    assert weights.get("a", 0) + weights.get("a_copy", 0) == pytest.approx(alone.weights["a"])
    assert weights["b"] == pytest.approx(alone.weights["b"])
    with_copy = {**members, "a_copy": members["a"]}
    np.testing.assert_allclose(average(with_copy, weights), average(members, alone.weights))


def test_ridge_stacking_undoes_a_members_scale_for_regression() -> None:
    rng = np.random.default_rng(3)

    def split(rows: int) -> Split:
        truth = rng.normal(0, 1, rows)
        # `scaled` knows the answer but doubles it; `noisy` is right on average only.
        members = {"scaled": 2 * truth + rng.normal(0, 0.05, rows)}
        members["noisy"] = truth + rng.normal(0, 0.5, rows)
        return Split(members, truth)

    report = evaluate_ensemble("regression", split(200), split(200))
    assert report.metric == "rmse" and report.best_learner == "ridge"
    assert report.best_member_score > 0.4
    assert report.stacked_score < 0.1 and report.choice == "stacking"


def test_multi_label_fits_a_meta_learner_per_label() -> None:
    rng = np.random.default_rng(4)

    def split(rows: int) -> Split:
        truth = rng.random((rows, 3)) < 0.4
        members = {}
        for name, known in (("first_two", [0, 1]), ("last", [2])):
            probabilities = rng.random((rows, 3))
            probabilities[:, known] = np.where(truth[:, known], 0.8, 0.2)
            members[name] = probabilities
        return Split(members, truth.astype(int))

    report = evaluate_ensemble("multi_label_classification", split(300), split(300), learners=LR)
    assert report.metric == "micro_f1"
    assert report.stacked is not None and len(report.stacked.estimators) == 3
    assert report.stacked_score > 0.98 > max(report.member_scores.values()) + 0.15


@pytest.mark.parametrize("positives", [[3], [3, 9]])
def test_a_label_with_one_or_two_positive_rows_is_tuned_with_no_failed_fit(
    positives: list[int],
) -> None:
    """Few evaluation rows: a label's only positive rows can all sit in the fold held out,
    leaving the other rows one class, where no learner fits (scikit-learn's FitFailedWarning,
    every grid point's score nan, the grid point picked blind)."""
    import warnings

    from hpo.ensemble.learners import learner
    from hpo.ensemble.stacking import fit_stacked, tuning_folds

    rng = np.random.default_rng(0)
    labels = np.zeros((12, 2), dtype=int)
    labels[::2, 0] = 1
    labels[positives, 1] = 1
    features = np.concatenate([labels + 0.3 * rng.random(labels.shape), rng.random((12, 2))], 1)
    for name in ("logistic_regression", "linear_svm"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a failed fit or scoring is a warning: an error here
            model = fit_stacked(
                "multi_label_classification", learner(name), features, labels, "micro_f1", ["a"]
            )
        assert ((model.predict(features) > 0.5) == labels).mean() > 0.9
    folds = tuning_folds("multi_label_classification", labels[:, 1], seed=0)
    assert folds and all(set(labels[fit, 1]) == {0, 1} for fit, _ in folds)
    if len(positives) == 2:  # stratified: each positive in a fold of its own, all 5 folds kept
        assert len(folds) == 5


def test_cross_validation_of_one_evaluation_row_is_refused_in_one_line() -> None:
    one = Split({"a": np.array([[0.3, 0.7]]), "b": np.array([[0.6, 0.4]])}, np.array([1]))
    with pytest.raises(EnsembleError, match="has 1 row"):
        evaluate_ensemble("sequence_classification", one, learners=LR)


def memoriser() -> Learner:
    from sklearn.neighbors import KNeighborsClassifier

    return Learner("memoriser", lambda seed: KNeighborsClassifier(n_neighbors=1))


def test_cross_validated_scores_never_come_from_rows_the_learner_was_fitted_on() -> None:
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 2, 200)  # noise: nothing can be learnt
    members = {n: _probabilities(rng.normal(0, 1, (200, 2))) for n in ("a", "b")}
    evaluation = Split(members, labels)
    # The learner memorises: scored on the rows it was fitted on, it is always right.
    model = evaluate_ensemble(
        "sequence_classification", evaluation, evaluation, learners=[memoriser()]
    )
    assert model.stacked_score == 1.0
    report = evaluate_ensemble("sequence_classification", evaluation, learners=[memoriser()])
    assert report.measured_on == "cross_validation" and report.folds == 5
    assert "5-fold cross-validation" in report.how_measured
    assert report.stacked_score < 0.65


def test_a_stack_no_better_than_the_best_member_is_flagged_and_not_chosen() -> None:
    rng = np.random.default_rng(6)
    labels = rng.integers(0, 3, 150)
    members = {"perfect": np.eye(3)[labels], "noise": _probabilities(rng.normal(0, 1, (150, 3)))}
    report = evaluate_ensemble("sequence_classification", Split(members, labels), learners=LR)
    assert report.best_member == "perfect" and report.best_member_score == 1.0
    assert not report.stacking_beats_best_member and report.choice == "best_member"
    assert "not better than the best member" in report.notes[0]


def test_a_test_split_that_favours_stacking_does_not_choose_it() -> None:
    # A learner that memorises scores 1.0 on a test split that repeats its rows; out of fold
    # on the evaluation split it is below the best member, and the best member is saved.
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200)
    logits = rng.normal(0, 1, (200, 2))
    logits[np.arange(200), labels] += 1.0  # member a: right about 3 times in 4
    members = {"a": _probabilities(logits), "b": _probabilities(rng.normal(0, 1, (200, 2)))}
    evaluation = Split(members, labels)
    report = evaluate_ensemble(
        "sequence_classification", evaluation, evaluation, learners=[memoriser()]
    )
    assert report.stacked_score == 1.0 and report.stacking_beats_best_member  # on the test split
    assert report.chosen_by.stacking < report.chosen_by.best_member
    assert report.choice == "best_member" and report.saved_score == report.best_member_score
    said = (
        "chosen by cross-validation on the evaluation split: the best member; on the test "
        "split stacking beats it (1.0000 against"
    )
    assert any(note.startswith(said) for note in report.notes), report.notes
    chosen_by = report.to_json()["chosen_by"]
    assert chosen_by["on"] == "5-fold cross-validation on the evaluation split"
    assert chosen_by["stacking"] == report.chosen_by.stacking
    assert report.to_json()["saved_score"] == report.best_member_score


def test_stacking_must_beat_the_best_member_by_more_than_the_folds_standard_error() -> None:
    """The one-standard-error rule: a gain within the folds' noise keeps the best member (one
    model's inference cost); accuracy higher is better, RMSE lower."""
    assert not ChosenBy(0.80, 0.79, 5, 0.02).stacking_wins("maximize")
    assert ChosenBy(0.80, 0.75, 5, 0.02).stacking_wins("maximize")
    assert ChosenBy(0.30, 0.35, 5, 0.02).stacking_wins("minimize")
    assert not ChosenBy(0.34, 0.35, 5, 0.02).stacking_wins("minimize")
    labels, members = complementary(200, 0)  # stacking far above each member, every fold
    report = evaluate_ensemble("sequence_classification", Split(members, labels), learners=LR)
    cv = report.chosen_by
    gain = cv.stacking - cv.best_member
    assert 0 < cv.standard_error < gain / 3 and report.choice == "stacking"
    assert report.to_json()["chosen_by"]["standard_error"] == cv.standard_error
    # The same gain with folds that disagree more than it: the best member, said so.
    report.chosen_by = dataclasses.replace(cv, standard_error=gain + 0.01)
    assert report.choice == "best_member" and report.saved_score == report.best_member_score
    # Near-duplicate members (one model and a noisy copy): stacking's out-of-fold gain, if
    # any, is within its standard error, and the best member is saved.
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1, (300, 3))
    labels = rng.integers(0, 3, 300)
    logits[np.arange(300), labels] += 1.5
    twins = {
        "a": _probabilities(logits),
        "b": _probabilities(logits + rng.normal(0, 0.1, (300, 3))),
    }
    report = evaluate_ensemble("sequence_classification", Split(twins, labels), learners=LR)
    assert report.choice == "best_member", report.chosen_by
    assert "standard error" in report.notes[0]


def test_stacking_chosen_by_cross_validation_is_saved_when_the_test_split_disfavours_it() -> None:
    labels, members = complementary(200, 0)  # stacking far above each member out of fold
    rng = np.random.default_rng(3)
    test_labels = rng.integers(0, 3, 200)
    test_members = {  # on the test split, a is right and b confidently wrong
        "a": np.eye(3)[test_labels] * 0.9 + 0.05,
        "b": _probabilities(rng.normal(0, 1, (200, 3)) + 4 * np.eye(3)[rng.integers(0, 3, 200)]),
    }
    report = evaluate_ensemble(
        "sequence_classification",
        Split(members, labels),
        Split(test_members, test_labels),
        learners=LR,
    )
    assert report.chosen_by.stacking > report.chosen_by.best_member + 0.1
    assert report.best_member == "a" and report.best_member_score == 1.0
    assert not report.stacking_beats_best_member and report.choice == "stacking"
    assert report.saved_score == report.stacked_score < 1.0
    assert report.notes == [
        "chosen by cross-validation on the evaluation split: stacking; on the test split it "
        f"does not beat the best member ({report.stacked_score:.4f} against 1.0000)"
    ]
    assert "chosen by 5-fold cross-validation on the evaluation split" in report.how_measured


@pytest.mark.parametrize(
    ("task", "words"),
    [("causal_lm", "soup"), ("token_classification", "averaging their token probabilities")],
)
def test_stacking_refuses_tasks_it_cannot_stack_in_one_line(task: str, words: str) -> None:
    labels, members = complementary(30, 7)
    with pytest.raises(EnsembleError) as caught:
        evaluate_ensemble(task, Split(members, labels))
    assert isinstance(caught.value, HPOError)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_token_probabilities_are_averaged_per_example() -> None:
    first = [np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([[0.5, 0.5]])]
    second = [np.array([[0.0, 1.0], [0.0, 1.0]]), np.array([[1.0, 0.0]])]
    averaged = average_token_probabilities([first, second])
    np.testing.assert_allclose(averaged[0], [[0.5, 0.5], [0.0, 1.0]])
    np.testing.assert_allclose(averaged[1], [[0.75, 0.25]])
    with pytest.raises(EnsembleError, match="one tokenizer"):
        average_token_probabilities([first, [second[0], np.zeros((3, 2))]])


def member_folders(root: Path, names: list[str]) -> dict[str, Path]:
    folders = {}
    for index, name in enumerate(names):
        folder = root / "members" / name
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes([index]) * 64)
        folders[name] = folder
    return folders


def saved_stack(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray], EnsembleReport]:
    labels, members = complementary(200, 8)
    report = evaluate_ensemble("sequence_classification", Split(members, labels), learners=LR)
    assert report.choice == "stacking"
    folder = save_ensemble(tmp_path / "ens", report, member_folders(tmp_path, ["a", "b"]))
    return folder, members, report


def test_a_saved_stack_loads_back_and_predicts_the_same(tmp_path: Path) -> None:
    folder, members, report = saved_stack(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["ensemble.json", "meta_learner.skops"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left aside
    loaded = load_ensemble(folder)
    assert loaded.kind == "stacking" and list(loaded.members) == ["a", "b"]
    assert loaded.record["scores"]["measured_on"] == "cross_validation"
    assert len(loaded.record["members"][0]["sha256"]) == 64
    assert loaded.model is not None and report.stacked is not None
    features = stack_features(members, ["a", "b"])
    np.testing.assert_allclose(loaded.model.predict(features), report.stacked.predict(features))
    with pytest.raises(EnsembleError, match="already exists"):
        save_ensemble(folder, report, {})


def test_the_feature_cache_key_changes_with_what_turns_rows_into_features(tmp_path: Path) -> None:
    """The feature cache's member key covers the weights and the files beside them (tokenizer,
    hpo_inference.json's max_length): an edited max_length with the same weights is computed
    again, not read back from the cache; the model card (*.md) changes nothing."""
    from hpo.ensemble.saving import features_sha256

    member = tmp_path / "member"
    member.mkdir()
    (member / "model.safetensors").write_bytes(b"weights")
    (member / "tokenizer.json").write_text("{}")
    (member / "hpo_inference.json").write_text(json.dumps({"max_length": 64}))
    key = features_sha256(member)
    assert len(key) == 64 and key != weights_sha256(member)
    (member / "README.md").write_text("# a card")
    assert features_sha256(member) == key
    # Each edit changes the size: hpo's file digests are remembered per size, times and inode,
    # and two same-size writes within one tick of the file system's clock would look alike.
    (member / "hpo_inference.json").write_text(json.dumps({"max_length": 128}))
    longer = features_sha256(member)
    assert longer != key
    (member / "tokenizer.json").write_text('{"model": {}}')
    assert features_sha256(member) not in (key, longer)
    (member / "model.safetensors").write_bytes(b"other weights")
    assert features_sha256(member) not in (key, longer)


def test_a_member_folder_with_a_link_out_of_it_is_not_copied(tmp_path: Path) -> None:
    """Copying a member copies what its links point to: a link inside the folder is copied as
    its file, a link out of it (to /, to ~/.ssh) is refused in one line and nothing is copied;
    a link loop too."""
    from hpo.ensemble.saving import copy_member

    member = tmp_path / "member"
    (member / "sub").mkdir(parents=True)
    (member / "model.safetensors").write_bytes(b"weights")
    (member / "sub" / "alias.safetensors").symlink_to(member / "model.safetensors")
    copy_member(member, tmp_path / "copy")
    assert (tmp_path / "copy" / "sub" / "alias.safetensors").read_bytes() == b"weights"
    assert not (tmp_path / "copy" / "sub" / "alias.safetensors").is_symlink()
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "key").write_text("private")
    for name, target in (("keys", secrets), ("root", Path("/")), ("loop", member / "sub" / "loop")):
        link = member / "sub" / name
        link.symlink_to(target)
        with pytest.raises(EnsembleError) as caught:
            copy_member(member, tmp_path / f"copy-{name}")
        assert "sub/" + name in str(caught.value) and "leads out" in str(caught.value)
        assert "\n" not in str(caught.value) and not (tmp_path / f"copy-{name}").exists()
        link.unlink()


def one_line_refusal(folder: Path, words: str) -> None:
    with pytest.raises(EnsembleError) as caught:
        load_ensemble(folder)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_a_pickle_named_as_the_meta_learner_is_refused(tmp_path: Path) -> None:
    folder, _, _ = saved_stack(tmp_path)
    (folder / "meta_learner.skops").write_bytes(pickle.dumps({"estimators": []}))
    one_line_refusal(folder, "not a skops file")


def test_a_skops_file_of_untrusted_types_is_refused(tmp_path: Path) -> None:
    import skops.io

    folder, _, _ = saved_stack(tmp_path)
    skops.io.dump({"estimators": [Untrusted()]}, folder / "meta_learner.skops")
    one_line_refusal(folder, "does not trust")


@pytest.mark.parametrize("saved", [{"estimators": 5}, {"estimators": []}, {"params": 7}])
def test_a_skops_file_of_trusted_types_but_no_learners_is_refused(
    tmp_path: Path, saved: dict[str, Any]
) -> None:
    import skops.io

    folder, _, _ = saved_stack(tmp_path)
    skops.io.dump({"estimators": [None], **saved}, folder / "meta_learner.skops")
    one_line_refusal(folder, "not a meta-learner hpo saved")


class Untrusted:
    def __reduce__(self) -> Any:
        return (print, ("code ran",))


def test_a_changed_or_missing_member_is_refused(tmp_path: Path) -> None:
    folder, _, _ = saved_stack(tmp_path)
    weights = tmp_path / "members" / "b" / "model.safetensors"
    weights.write_bytes(b"other weights")
    one_line_refusal(folder, "sha256 differs")
    for path in weights.parent.iterdir():
        path.unlink()
    weights.parent.rmdir()
    one_line_refusal(folder, "member 'b' is missing")


def test_the_best_member_is_saved_when_stacking_does_not_beat_it(tmp_path: Path) -> None:
    rng = np.random.default_rng(10)
    labels = rng.integers(0, 3, 120)
    members = {"perfect": np.eye(3)[labels], "noise": _probabilities(rng.normal(0, 1, (120, 3)))}
    report = evaluate_ensemble("sequence_classification", Split(members, labels), learners=LR)
    folders = member_folders(tmp_path, ["perfect", "noise"])
    loaded = load_ensemble(save_ensemble(tmp_path / "ens", report, folders))
    assert loaded.kind == "best_member" and list(loaded.members) == ["perfect"]
    assert loaded.model is None and not (tmp_path / "ens" / "meta_learner.skops").exists()


def tiny_models(seeds: list[int]) -> list[dict[str, torch.Tensor]]:
    models = []
    for seed in seeds:
        torch.manual_seed(seed)
        models.append(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)))
    return [m.state_dict() for m in models]


def test_the_uniform_soup_is_the_mean_of_the_members_weights() -> None:
    first, second = tiny_models([0, 1])
    soup = uniform_soup([first, second])
    for key in first:
        torch.testing.assert_close(soup[key], (first[key] + second[key]) / 2)
    lora = [
        {"q.lora_A.weight": torch.ones(2, 4) * i, "q.lora_B.weight": torch.ones(4, 2)}
        for i in (1, 3)
    ]
    torch.testing.assert_close(adapter_soup(lora)["q.lora_A.weight"], torch.full((2, 4), 2.0))


def test_a_soup_of_different_shapes_is_refused_in_one_line() -> None:
    first = tiny_models([0])[0]
    wider = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)).state_dict()
    with pytest.raises(EnsembleError) as caught:
        uniform_soup([first, wider], ["base", "wider"])
    assert "'wider'" in str(caught.value) and "one base model" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_greedy_soup_keeps_only_members_that_help() -> None:
    target = torch.zeros(4)
    members = {
        "near": {"w": torch.tensor([0.1, -0.1, 0.1, -0.1])},
        "other_side": {"w": torch.tensor([-0.1, 0.1, -0.1, 0.1])},
        "far": {"w": torch.tensor([5.0, 5.0, 5.0, 5.0])},
    }
    calls: list[list[float]] = []

    def score(state: dict[str, torch.Tensor]) -> float:
        calls.append(state["w"].tolist())
        return -float(torch.linalg.norm(state["w"] - target))

    soup = greedy_soup(members, score)
    assert soup.kept == ["near", "other_side"]
    torch.testing.assert_close(soup.state_dict["w"], target)
    assert soup.score == 0.0 and soup.tried["far"] < soup.score


def test_the_feature_cache_computes_a_members_features_once(tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path / "features")
    computed: list[int] = []

    def compute() -> np.ndarray:
        computed.append(1)
        return np.arange(6, dtype=np.float32).reshape(3, 2)

    key: tuple[str, str, str] = ("a" * 64, "b" * 64, "probabilities")
    first = cache.get_or_compute(*key, compute)
    second = cache.get_or_compute(*key, compute)
    assert computed == [1]
    np.testing.assert_array_equal(first, second)
    assert second.dtype == np.float32
    other_data = cache.get_or_compute("a" * 64, "c" * 64, "probabilities", compute)
    assert computed == [1, 1] and other_data.shape == (3, 2)
    assert not [p for p in (tmp_path / "features").rglob(".*")]  # nothing left aside
    with pytest.raises(EnsembleError, match="not a sha256"):
        cache.get("../x", "b" * 64, "probabilities")


def test_data_test_file_resolves_like_eval_file(
    tmp_path: Path, easy_data: tuple[Path, Path]
) -> None:
    from hpo.config.loader import load_config

    train, evaluation = easy_data
    (tmp_path / "data" / "test.csv").write_text("text,label\nx,0\n")
    config = tiny_config(train, evaluation, data={"test_file": "data/test.csv"})
    loaded = load_config(write_config(tmp_path / "config.yaml", config))
    assert loaded.data.test_file == str(tmp_path / "data" / "test.csv")
    config["data"]["test_file"] = "data/nowhere.csv"
    with pytest.raises(HPOError, match="data.test_file: .*not found"):
        load_config(write_config(tmp_path / "config.yaml", config))


def test_no_trial_reads_the_test_file(
    tmp_path: Path, easy_data: tuple[Path, Path], hpo_main: Callable[[list[str]], int]
) -> None:
    train, evaluation = easy_data
    # A test file that any reader refuses: a trial that read it would fail.
    test_file = tmp_path / "data" / "test.csv"
    test_file.write_bytes(b"\xff\xfe\x00 not a table \x00" * 10)
    config = tiny_config(
        train,
        evaluation,
        study={"n_trials": 1, "trial_isolation": "none"},
        data={"test_file": str(test_file)},
        training={"max_steps": 2, "evals_per_epoch": 1},
    )
    path = write_config(tmp_path / "config.yaml", config)
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert hpo_main(["run", "--study", "s", "--config", str(path), "--storage", url]) == 0
    with sqlite3.connect(tmp_path / "db.sqlite") as db:
        states = [s for (s,) in db.execute("SELECT state FROM trials")]
    assert states == ["COMPLETE"]


def test_embedding_features_are_scaled_and_reduced_and_saved_with_the_stack(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(11)
    labels = rng.integers(0, 2, 160)
    # Mean-pooled embeddings of two members: 16 columns each, the label in a few, on a large
    # scale that StandardScaler brings back; PCA keeps 4 components of the 32.
    embeddings = rng.normal(0, 1, (160, 32)) * 50
    embeddings[:, :4] += labels[:, None] * 150
    members = {n: _probabilities(rng.normal(0, 1, (160, 2))) for n in ("a", "b")}
    settings = FeatureSettings(kind="embedding", scale=True, pca_components=4)
    report = evaluate_ensemble(
        "sequence_classification",
        Split(members, labels, features=embeddings),
        learners=LR,
        settings=settings,
    )
    assert report.stacked_score > 0.9 and report.choice == "stacking"
    assert report.stacked is not None
    steps = dict(report.stacked.estimators[0].steps)
    assert steps["pca"].n_components_ == 4 and "scale" in steps
    loaded = load_ensemble(
        save_ensemble(tmp_path / "ens", report, member_folders(tmp_path, ["a", "b"]))
    )
    assert loaded.model is not None and loaded.model.settings == settings
    np.testing.assert_allclose(loaded.model.predict(embeddings), report.stacked.predict(embeddings))


# -- the default learner, and the cache of fitted ensembles -------------------------------------


def test_the_default_is_one_learner_and_all_tries_every_installed_one() -> None:
    from hpo.ensemble import available_learners
    from hpo.ensemble.learners import resolve_learners

    def names(task: str, chosen: Any) -> list[str]:
        return [lr.name for lr in resolve_learners(task, chosen)]

    assert names("sequence_classification", None) == ["logistic_regression"]
    assert names("sequence_classification", []) == ["logistic_regression"]
    assert names("regression", None) == ["ridge"]
    every = available_learners("sequence_classification")
    assert len(every) >= 4 and names("sequence_classification", ["all"]) == every
    assert names("sequence_classification", "all") == every
    assert names("multi_label_classification", ["linear_svm", "linear_svm"]) == ["linear_svm"]
    with pytest.raises(EnsembleError, match="or all"):
        names("regression", ["random_forest"])
    labels, members = complementary(120, 0)
    report = evaluate_ensemble("sequence_classification", Split(members, labels))
    assert list(report.stacking_scores) == ["logistic_regression"]


def _cached(
    tmp_path: Path,
    split: Any,
    task: str = "sequence_classification",
    test: Split | None = None,
    **options: Any,
) -> tuple[EnsembleReport, int]:
    """evaluate_cached over `split` (and `test`), and how many meta-learner fits it ran."""
    from hpo.ensemble import ReportCache, evaluate_cached, stacking

    fits = []
    tuned = stacking._tuned

    def counted(*args: Any, **kwargs: Any) -> Any:
        fits.append(1)
        return tuned(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(stacking, "_tuned", counted)
        report = evaluate_cached(task, split, test, ReportCache(tmp_path / "ens"), **options)
    return report, len(fits)


def test_a_second_ensemble_over_the_same_features_fits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpo.ensemble import honest, stacking

    labels, members = complementary(150, 1)
    split = Split(members, labels)
    first, fits = _cached(tmp_path, split, learners=LR)
    assert fits > 1  # 5 folds and the final fit

    def no_fit(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("fitted again: the ensemble cache was not read")

    monkeypatch.setattr(stacking, "_tuned", no_fit)
    monkeypatch.setattr(honest, "greedy_selection", no_fit)
    monkeypatch.setattr(honest, "evaluate_ensemble", no_fit)
    second, _ = _cached(tmp_path, Split(dict(members), labels.copy()), learners=LR)
    assert second.to_json() == first.to_json()
    assert second.selection == first.selection and second.choice == first.choice
    assert first.stacked is not None and second.stacked is not None
    features = stack_features(members, ["a", "b"])
    monkeypatch.undo()  # the meta-learner read back predicts as the one fitted
    np.testing.assert_allclose(second.stacked.predict(features), first.stacked.predict(features))
    assert second.stacked.skops_file() == first.stacked.skops_file()
    # Saved from the cache, the folder holds the same meta-learner and loads back.
    folders = {}
    for name in ("a", "b"):
        folder = tmp_path / "members" / name
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(name.encode())
        folders[name] = folder
    second.notes.clear()
    monkeypatch.setattr(EnsembleReport, "choice", property(lambda r: "stacking"))
    saved = save_ensemble(tmp_path / "saved", second, folders)
    loaded = load_ensemble(saved)
    assert loaded.model is not None
    np.testing.assert_allclose(loaded.model.predict(features), first.stacked.predict(features))


@pytest.mark.parametrize("task", ["regression", "multi_label_classification"])
def test_regression_and_multi_label_stacks_read_back_from_the_cache(
    tmp_path: Path, task: str
) -> None:
    rng = np.random.default_rng(8)

    def split(rows: int) -> Split:
        if task == "regression":
            truth = rng.normal(0, 1, rows)
            members = {"scaled": 2 * truth + rng.normal(0, 0.05, rows)}
            members["noisy"] = truth + rng.normal(0, 0.5, rows)
            return Split(members, truth)
        labels = rng.random((rows, 3)) < 0.4
        members = {}
        for name, known in (("first_two", [0, 1]), ("last", [2])):
            probabilities = rng.random((rows, 3))
            probabilities[:, known] = np.where(labels[:, known], 0.8, 0.2)
            members[name] = probabilities
        return Split(members, labels.astype(int))

    evaluation, test = split(100), split(60)
    first, fits = _cached(tmp_path, evaluation, task, test)
    second, again = _cached(tmp_path, evaluation, task, test)
    assert fits > 0 and again == 0 and first.choice == "stacking"
    assert second.to_json() == first.to_json() and second.measured_on == "test_split"
    assert second.chosen_by == first.chosen_by and second.saved_score == first.saved_score
    assert first.stacked is not None and second.stacked is not None
    features = test.stack_features(list(test.predictions))
    np.testing.assert_allclose(second.stacked.predict(features), first.stacked.predict(features))


def test_a_changed_member_label_or_option_fits_again(tmp_path: Path) -> None:
    # Two folds, not five: each of the 17 evaluations below fits the meta-learner per fold.
    labels, members = complementary(90, 2)
    split = Split(members, labels)
    _, fits = _cached(tmp_path, split, **TWO_FOLDS)
    assert fits > 0
    assert _cached(tmp_path, split, **TWO_FOLDS)[1] == 0
    changed = dict(members, b=members["b"].copy())
    changed["b"][0] = changed["b"][0][::-1]
    flipped = labels.copy()
    flipped[0] = (flipped[0] + 1) % 3
    for other, options in (
        (Split(changed, labels), TWO_FOLDS),  # a member's outputs
        (Split(members, flipped), TWO_FOLDS),  # a label
        (Split({"b": members["b"], "a": members["a"]}, labels), TWO_FOLDS),  # order
        (split, {**TWO_FOLDS, "learners": ["linear_svm"]}),
        (split, {**TWO_FOLDS, "settings": FeatureSettings(scale=True)}),
        (split, {**TWO_FOLDS, "seed": 1}),
        (split, {**TWO_FOLDS, "folds": 3}),
        (split, {**TWO_FOLDS, "metric": "macro_f1"}),
    ):
        assert _cached(tmp_path, other, **options)[1] > 0, options
        assert _cached(tmp_path, other, **options)[1] == 0, options  # and stored in turn


def test_a_damaged_cache_entry_is_fitted_again_never_an_error(tmp_path: Path) -> None:
    from hpo.ensemble import ReportCache

    labels, members = complementary(90, 3)
    split = Split(members, labels)
    first, _ = _cached(tmp_path, split, **TWO_FOLDS)
    (entry,) = (tmp_path / "ens").glob("*.zip")
    whole = entry.read_bytes()
    middle = len(whole) // 2
    for damaged in (
        whole[:middle],  # cut short
        whole[:middle] + bytes([whole[middle] ^ 0xFF]) + whole[middle + 1 :],  # a flipped byte
        b"",
        b"PK\x03\x04 not a zip",
        pickle.dumps({"report": 1}),
    ):
        entry.write_bytes(damaged)
        again, fits = _cached(tmp_path, split, **TWO_FOLDS)
        assert fits > 0 and again.to_json() == first.to_json()
        assert ReportCache(tmp_path / "ens").get(entry.stem) is not None  # replaced whole
    assert not [p for p in (tmp_path / "ens").glob(".*")]  # nothing left aside
    cache = ReportCache(tmp_path / "ens")
    step = max(1, len(whole) // 300)
    for position in range(0, len(whole), step):  # a byte flipped: the same report, or none
        entry.write_bytes(
            whole[:position] + bytes([whole[position] ^ 0x5A]) + whole[position + 1 :]
        )
        read = cache.get(entry.stem)
        assert read is None or read.to_json() == first.to_json(), position


def test_an_entry_written_before_chosen_by_is_fitted_again_never_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import zipfile

    from hpo.ensemble import report_cache

    labels, members = complementary(90, 6)
    split = Split(members, labels)
    first, _ = _cached(tmp_path, split, **TWO_FOLDS)
    key = report_cache.report_key("sequence_classification", split, None, **TWO_FOLDS)
    monkeypatch.setattr(report_cache, "FORMAT", 1)  # an older hpo kept its entries elsewhere
    assert report_cache.report_key("sequence_classification", split, None, **TWO_FOLDS) != key
    monkeypatch.undo()
    entry = tmp_path / "ens" / f"{key}.zip"
    with zipfile.ZipFile(entry) as stored:
        text, skops = json.loads(stored.read("report.json")), stored.read("meta_learner.skops")
    del text["report"]["chosen_by"]  # as format 1 wrote it
    for number in (1, report_cache.FORMAT):  # even found under this key, it is not read
        with zipfile.ZipFile(entry, "w") as old:
            old.writestr("report.json", json.dumps({**text, "format": number}))
            old.writestr("meta_learner.skops", skops)
        again, fits = _cached(tmp_path, split, **TWO_FOLDS)
        assert fits > 0 and again.to_json() == first.to_json(), number


def test_a_stack_not_chosen_is_cached_without_its_fit_and_fitted_when_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(6)
    labels = rng.integers(0, 3, 150)
    members = {"perfect": np.eye(3)[labels], "noise": _probabilities(rng.normal(0, 1, (150, 3)))}
    split = Split(members, labels)
    first, _ = _cached(tmp_path, split, learners=LR)
    assert first.choice == "best_member"
    second, fits = _cached(tmp_path, split, learners=LR)  # skops (all of sklearn) not loaded
    assert fits == 0 and second.to_json() == first.to_json()
    assert second.stacked is not None and second.stacked.skops_bytes is None
    with pytest.raises(EnsembleError, match="without its fit"):
        second.stacked.predict(stack_features(members, ["perfect", "noise"]))
    monkeypatch.setattr(EnsembleReport, "choice", property(lambda r: "stacking"))
    third, fits = _cached(tmp_path, split, learners=LR)  # a run that saves the stack: fitted
    assert fits > 0 and third.stacked is not None and third.stacked.skops_bytes is not None
    assert _cached(tmp_path, split, learners=LR)[1] == 0  # and now stored with its fit


def test_a_cache_folder_that_cannot_be_written_only_costs_the_next_run_a_fit(
    tmp_path: Path,
) -> None:
    labels, members = complementary(120, 5)
    (tmp_path / "ens").write_text("a file where the cache folder would be")
    for _ in range(2):
        report, fits = _cached(tmp_path, Split(members, labels), learners=LR)
        assert fits > 0 and report.best_learner == "logistic_regression"


def test_a_learner_of_the_callers_is_never_cached(tmp_path: Path) -> None:
    labels, members = complementary(120, 4)

    def make(seed: int) -> Any:
        from sklearn.linear_model import LogisticRegression

        return LogisticRegression(C=0.5)

    own = Learner("logistic_regression", make)  # even under a built-in name
    split = Split(members, labels)
    for _ in range(2):
        assert _cached(tmp_path, split, learners=[own])[1] > 0
    assert not (tmp_path / "ens").exists()


def _edited(record: dict[str, Any], edit: str, outside: Path) -> Any:
    """`record` as an attacker edited it (`edit` names how)."""
    first = record["members"][0]
    if edit == "a member's folder out by ..":
        first["folder"] = "../outside"
    elif edit == "a member's folder a link out":
        first["folder"] = "link"
    elif edit in ("no sha256", "no folder", "no name"):
        del first[edit.split()[1]]
    elif edit == "a sha256 not hex":
        first["sha256"] = "z" * 64
    elif edit == "a sha256 a huge number":
        first["sha256"] = 10**300
    elif edit == "a member twice":
        record["members"].append(dict(first))
    elif edit == "no members":
        record["members"] = []
    elif edit == "members a string":
        record["members"] = "ab"
    elif edit == "a member a string":
        record["members"][0] = "a"
    elif edit == "the meta-learner elsewhere":
        record["meta_learner"] = str(outside / "meta_learner.skops")
    elif edit == "num_outputs a string":
        record["num_outputs"] = "3"
    elif edit == "features of another shape":
        record["features"] = {"kind": "predictions", "run": "code"}
    elif edit == "a list":
        return ["format", "kind", "task", "members"]
    return record


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ("a member's folder out by ..", "leads out of the ensemble's folder"),
        ("a member's folder a link out", "leads out of the ensemble's folder"),
        ("no sha256", "without its name, folder and sha256"),
        ("no folder", "without its name, folder and sha256"),
        ("no name", "without its name, folder and sha256"),
        ("a sha256 not hex", "not 64 hex digits"),
        ("a sha256 a huge number", "without its name, folder and sha256"),
        ("a member twice", "listed twice"),
        ("no members", "not a list of members"),
        ("members a string", "not a list of members"),
        ("a member a string", "without its name, folder and sha256"),
        ("the meta-learner elsewhere", "meta_learner"),
        ("num_outputs a string", "num_outputs"),
        ("features of another shape", "features"),
        ("a list", "not an ensemble record hpo wrote"),
    ],
)
def test_an_edited_record_is_refused_in_one_line_and_reads_nothing_outside(
    tmp_path: Path, edit: str, words: str
) -> None:
    folder, _, _ = saved_stack(tmp_path)
    outside = tmp_path / "outside"  # a model whose sha256 the attacker wrote in the record
    outside.mkdir()
    (outside / "model.safetensors").write_bytes(b"elsewhere")
    (folder / "link").symlink_to(outside)
    record = json.loads((folder / "ensemble.json").read_text())
    record["members"][0]["sha256"] = weights_sha256(outside)
    (folder / "ensemble.json").write_text(json.dumps(_edited(record, edit, outside)))
    one_line_refusal(folder, words)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"format": 1' + "0" * 5000 + "}"])
def test_a_record_nested_too_deep_or_of_a_huge_number_is_damaged_in_one_line(
    tmp_path: Path, text: str
) -> None:
    folder, _, _ = saved_stack(tmp_path)
    (folder / "ensemble.json").write_text(text)
    one_line_refusal(folder, "is damaged")


def test_a_weights_name_that_is_no_file_is_not_read(tmp_path: Path) -> None:
    """A link to a device (/dev/zero would be read for ever) is not a member's weights."""
    folder = member_folders(tmp_path, ["a"])["a"]
    before = weights_sha256(folder)
    (folder / "extra.bin").symlink_to("/dev/null")
    assert weights_sha256(folder) == before


def test_an_empty_or_unwritable_feature_cache_costs_a_computation_never_an_error(
    tmp_path: Path,
) -> None:
    """An entry left empty (a crash before the disk had the bytes), and a cache folder that
    cannot be written (a file in its place, a full disk): the features are computed again."""
    key: tuple[str, str, str] = ("a" * 64, "b" * 64, "predictions")
    cache = FeatureCache(tmp_path / "features")
    cache.put(*key, np.ones((2, 2)))
    cache.path(*key).write_bytes(b"")
    computed = cache.get_or_compute(*key, lambda: np.zeros((2, 2)))
    np.testing.assert_array_equal(computed, np.zeros((2, 2)))
    (tmp_path / "blocked").write_text("a file where the cache folder would be")
    blocked = FeatureCache(tmp_path / "blocked")
    for _ in range(2):
        np.testing.assert_array_equal(blocked.get_or_compute(*key, lambda: np.ones(3)), np.ones(3))


def test_cached_probabilities_are_never_read_back_under_another_label_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member's probabilities are cached in the first member's label order; another first
    member with the same labels in another id order must not read them as its own."""
    from hpo.commands import ensemble as command
    from hpo.commands.ensemble_members import DataFiles

    rows = [{"text": "a", "label": "neg"}, {"text": "b", "label": "pos"}]
    source = tmp_path / "eval.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def says_pos(folder: Path, rows: Any, order: list[str], *_: Any) -> np.ndarray:
        return np.array([[float(name == "pos") for name in order] for _ in rows])

    monkeypatch.setattr(command, "member_predictions", says_pos)
    request = command.EnsembleRequest(out=str(tmp_path / "out"), cache_dir=str(tmp_path / "c"))
    data = DataFiles("sequence_classification", source, None, "label")
    members = member_folders(tmp_path, ["m"])
    for order in (["neg", "pos"], ["pos", "neg"]):
        split, _ = command._split(members, source, data, order, request)
        assert split.predictions["m"][:, order.index("pos")].tolist() == [1.0, 1.0]


def test_an_out_folder_made_while_the_ensemble_is_saved_is_kept_and_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another hpo ensemble writing the same --out finishes first: its folder stays as it is,
    this one is refused in one line (not an OSError traceback), nothing is left aside."""
    from hpo.ensemble import saving

    labels, members = complementary(200, 8)
    report = evaluate_ensemble("sequence_classification", Split(members, labels), learners=LR)
    out = tmp_path / "ens"
    dump = saving._dump_meta_learner

    def theirs_first(model: Any, path: Path) -> None:
        out.mkdir()
        (out / "ensemble.json").write_text("theirs")
        dump(model, path)

    monkeypatch.setattr(saving, "_dump_meta_learner", theirs_first)
    with pytest.raises(EnsembleError, match="made while the ensemble was built") as caught:
        save_ensemble(out, report, member_folders(tmp_path, ["a", "b"]))
    assert "\n" not in str(caught.value)
    assert (out / "ensemble.json").read_text() == "theirs"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
