"""A fitted meta-learner as skops bytes: written from its estimators, read back only when every
type in it is one hpo trusts (skops runs no code on load; a pickle would). skops and
scikit-learn load here, on first use, not when hpo starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpo.ensemble.errors import EnsembleError, require_stacking

# Types that skops does not trust by default but that the learners hpo fits are made of: both
# are scikit-learn's own, restored from their arrays (no code runs). Anything else is refused.
TRUSTED_TYPES = (
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
    "sklearn.tree._tree.Tree",
)


def refused_types(untrusted: Sequence[str]) -> list[str]:
    """The types skops does not trust that hpo does not trust either."""
    return [t for t in untrusted if t not in TRUSTED_TYPES]


def meta_learner_bytes(learner: str, estimators: list[Any], params: list[dict[str, Any]]) -> bytes:
    """The skops file of a fitted meta-learner; refused now when it holds types hpo would
    refuse to load (XGBoost's, say), not when someone loads the folder."""
    require_stacking("saving a stacked ensemble")
    import skops.io

    data = skops.io.dumps({"estimators": estimators, "params": params})
    refused = refused_types(skops.io.get_untrusted_types(data=data))
    if refused:
        raise EnsembleError(
            f"meta-learner {learner} holds types hpo would refuse to load "
            f"({', '.join(refused[:3])}); choose another meta-learner"
        )
    return data


def meta_learner_from_bytes(data: bytes, where: str) -> dict[str, Any]:
    """The estimators and params of a skops file hpo wrote; `where` names it in the errors."""
    require_stacking(f"loading {where}")
    import skops.io

    try:
        untrusted = skops.io.get_untrusted_types(data=data)
    except Exception as e:  # skops raises several kinds on a zip that is not its own
        raise EnsembleError(f"{where} is not a skops file ({e}); build the ensemble again") from e
    refused = refused_types(untrusted)
    if refused:
        raise EnsembleError(
            f"{where} holds types hpo does not trust ({', '.join(refused[:3])}); "
            "loading them could run code: refused"
        )
    loaded = skops.io.loads(data, trusted=list(untrusted))
    if (
        not isinstance(loaded, dict)
        or not isinstance(loaded.get("estimators"), list)
        or not loaded["estimators"]
        or not isinstance(loaded.get("params", []), list)
    ):
        raise EnsembleError(f"{where} is not a meta-learner hpo saved; build the ensemble again")
    return loaded
