"""The host metrics shared by the tasks, against their definitions: mean ranks as scipy's
rankdata gives them, ROC AUC as the share of (positive, negative) pairs ordered right."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.stats import rankdata

from hpo.trainer.metrics import binary_roc_auc, mean_ranks
from tests.conftest import loaded_by


@pytest.mark.parametrize("seed", range(20))
def test_mean_ranks_are_scipys_rankdata(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    floats = rng.normal(size=n).round(int(rng.integers(0, 3)))  # rounding makes ties
    integers = rng.integers(-3, 4, size=n)
    for values in (floats, integers, -floats, np.sort(floats), np.sort(floats)[::-1]):
        assert np.array_equal(mean_ranks(values), rankdata(values))


def test_mean_ranks_of_no_value_one_value_a_tie_and_a_nan() -> None:
    assert mean_ranks(np.array([])).shape == (0,)
    assert mean_ranks(np.array([7.0])).tolist() == [1.0]
    assert mean_ranks(np.array([2.0, 2.0, 2.0])).tolist() == [2.0, 2.0, 2.0]
    assert mean_ranks(np.array([3, 1, 3, 2])).tolist() == [3.5, 1.0, 3.5, 2.0]
    assert np.isnan(mean_ranks(np.array([1.0, np.nan, 0.5]))).all()  # as rankdata's propagate
    assert np.array_equal(mean_ranks(np.array([np.inf, -np.inf, 0.0])), [3.0, 1.0, 2.0])


def _pairs_ordered_right(scores: np.ndarray, labels: np.ndarray) -> float:
    positives = scores[labels == 1]
    negatives = scores[labels == 0]
    pairs = list(itertools.product(positives, negatives))
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)


@pytest.mark.parametrize("seed", range(10))
def test_roc_auc_is_the_share_of_pairs_ordered_right(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=40)
    labels[:2] = [0, 1]
    scores = rng.normal(size=40).round(1) + labels * rng.uniform(0, 2)
    assert binary_roc_auc(scores, labels) == pytest.approx(_pairs_ordered_right(scores, labels))


def test_roc_auc_of_one_class_is_nan_and_of_a_perfect_order_one() -> None:
    assert np.isnan(binary_roc_auc(np.array([0.1, 0.9]), np.array([1, 1])))
    assert binary_roc_auc(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1])) == 1.0
    assert binary_roc_auc(np.array([0.5, 0.5]), np.array([0, 1])) == 0.5


def test_the_metrics_import_no_scipy() -> None:
    """scipy.stats took a trial process a second or two of CPU to import at its first
    evaluation (each trial process is a fresh fork of its worker's fork server)."""
    code = (
        "import numpy as np\n"
        "from hpo.trainer.metrics import binary_roc_auc\n"
        "from hpo.trainer.tasks.regression import regression_metrics\n"
        "binary_roc_auc(np.array([0.2, 0.7]), np.array([0, 1]))\n"
        "regression_metrics(np.array([1.0, 2.0]), np.array([1.5, 2.5]))"
    )
    assert loaded_by(code, ("scipy.stats",)) == []
