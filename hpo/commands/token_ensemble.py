"""`hpo ensemble` of taggers (token classification): the members' tag probabilities per word
averaged, nothing fitted, so the score is honest on the evaluation split (or data.test_file's).
The average is saved (the members copied, ensemble.json of kind "average") when it beats the
best member; else the best member, a plain model folder.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo.commands.ensemble_members import labels_by_id
from hpo.errors import HPOError

if TYPE_CHECKING:
    import numpy as np

KIND = "word_probabilities"


def token_ensemble(
    members: dict[str, Path],
    evaluation: Path,
    test: Path | None,
    label_column: str,
    out: Path,
    device: str,
    batch_size: int,
) -> tuple[str, str]:
    """The table to print, and what was saved ("average" or "best_member")."""
    import numpy as np

    order = labels_by_id(next(iter(members.values())))
    splits = {"evaluation": evaluation, **({"test": test} if test else {})}
    probabilities, truth = _probabilities(members, splits, label_column, order, device, batch_size)

    def accuracy(split: str, outputs: np.ndarray) -> float:
        return float(np.mean(outputs.argmax(axis=1) == truth[split]))

    for split, path in splits.items():  # else each word would be scored on another's tag
        words = len(next(iter(probabilities[split].values())))
        if words != len(truth[split]):
            raise HPOError(
                f"{path}: {len(truth[split])} tags for {words} words; give each row a tag per word"
            )
    chosen_on = {n: accuracy("evaluation", p) for n, p in probabilities["evaluation"].items()}
    best = max(chosen_on, key=lambda n: chosen_on[n])
    scored = "test" if test else "evaluation"
    member_scores = {n: accuracy(scored, p) for n, p in probabilities[scored].items()}
    averaged = accuracy(scored, np.mean(list(probabilities[scored].values()), axis=0))
    saved = "average" if average_wins(averaged, member_scores[best]) else "best_member"
    measured = "the test split" if test else "the evaluation split (nothing fitted on it)"
    lines = [f"{'candidate':<44} {'word accuracy':>13}"]
    lines += [f"{'best single member (' + best + ')':<44} {member_scores[best]:>13.4f}"]
    lines += [f"{'average of token probabilities':<44} {averaged:>13.4f}"]
    lines.append(f"measured: on {measured}")
    card = {
        "task": "token_classification",
        "metric": "word_accuracy",
        "measured_on": "test_split" if test else "evaluation_split",
        "member_scores": member_scores,
        "best_member": {"name": best, "score": member_scores[best]},
        "average": {"score": averaged},
        "choice": saved,
    }
    _save(out, saved, members, best, card)
    what = "the average of every member" if saved == "average" else f"the best member ({best})"
    lines.append(f"saved: {what}")
    return "\n".join(lines), saved


def _probabilities(
    members: dict[str, Path],
    splits: dict[str, Path],
    label_column: str,
    order: list[str],
    device: str,
    batch_size: int,
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Each split's members' word probabilities (cached) and its true tags."""
    from hpo.ensemble import FeatureCache
    from hpo.ensemble.cache import ordered_kind
    from hpo.ensemble.saving import features_sha256
    from hpo.trainer.digests import file_sha256

    probabilities: dict[str, dict[str, np.ndarray]] = {}
    truth: dict[str, np.ndarray] = {}
    for split, path in splits.items():
        rows = _rows(path)
        truth[split] = _tags(rows, label_column, order, path)
        digest, cache = file_sha256(path), FeatureCache()
        probabilities[split] = {}
        for name, folder in members.items():

            def compute(folder: Path = folder, rows: list[dict[str, Any]] = rows) -> np.ndarray:
                return _member_words(folder, rows, order, device, batch_size)

            probabilities[split][name] = cache.get_or_compute(
                features_sha256(folder), digest, ordered_kind(KIND, order), compute
            )
    return probabilities, truth


def average_wins(averaged: float, best: float) -> bool:
    """The average is kept only when strictly better than the best member."""
    return averaged > best


def _rows(path: Path) -> list[dict[str, Any]]:
    from hpo.commands.predict import input_rows

    if not path.is_file() or path.suffix.lower() not in (".csv", ".jsonl"):
        raise HPOError(f"{path}: the members predict a .csv or .jsonl file; none there")
    with input_rows(path) as (_, rows):
        return list(rows)


def _tags(rows: list[dict[str, Any]], column: str, order: list[str], path: Path) -> np.ndarray:
    import numpy as np

    from hpo.commands.features import row_words

    index = {name: i for i, name in enumerate(order)}
    found = []
    for number, row in enumerate(rows, start=1):
        value = row.get(column)
        if not isinstance(value, (str, list)) or not value:
            what = f"{type(value).__name__}, not" if value else "no"
            raise HPOError(f"{path}: row {number} holds {what} tags in column {column!r}")
        for tag in row_words(row, column):
            if tag not in index:
                raise HPOError(f"{path}: row {number} has tag {tag!r}, none of the members'")
            found.append(index[tag])
    return np.asarray(found)


def _member_words(
    folder: Path, rows: Sequence[dict[str, Any]], order: list[str], device: str, batch_size: int
) -> np.ndarray:
    from hpo.commands.features import word_probabilities
    from hpo.trainer.device import resolve_device
    from hpo.trainer.inference import Predictor

    predictor = Predictor(folder, resolve_device(device, "--device"), batch_size)
    if sorted(predictor.labels) != sorted(order):
        raise HPOError(f"member {folder} tags with other tags than the first member")
    return word_probabilities(predictor, rows, order)


def _save(out: Path, saved: str, members: dict[str, Path], best: str, card: dict[str, Any]) -> None:
    from hpo.ensemble import weights_sha256
    from hpo.ensemble.saving import FORMAT, MEMBERS, RECORD, copy_member, rename_in

    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        folder = staging / "ensemble"
        if saved == "best_member":
            copy_member(members[best], folder)
        else:
            entries = []
            for name, member in members.items():
                copy_member(member, folder / MEMBERS / name)
                entries.append(
                    {
                        "name": name,
                        "folder": f"{MEMBERS}/{name}",
                        "sha256": weights_sha256(folder / MEMBERS / name),
                        "score": card["member_scores"][name],
                    }
                )
            record = {"format": FORMAT, "kind": "average", "task": card["task"]}
            record |= {"members": entries, "scores": card}
            (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        (folder / "ensemble_card.json").write_text(json.dumps(card, indent=2) + "\n")
        rename_in(folder, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
